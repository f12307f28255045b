"""The demo model's accuracy with fp8 weights beside its own dtype's, for every decoder and
cache policy of `bench.decoders`: exact match, forwards per answer, tokens per forward.

    python -m bench.fp8_accuracy [--model FOLDER] [--problems 256] [--batch 64]

The same held-out problems and configurations as `bench.decoders`, run with the model loaded
in its dtype (`weights="dtype"`) and with `weights="fp8"` (projections as e4m3 with a scale
per output channel, `djax.models.fp8`) under each product path (`fp8_impl`): `dequant`
(the weights converted inside the dot) and `scaled` (the rows quantised to e4m3 too: what
`auto` runs on GPUs with fp8 tensor cores). Forwards are counted as in `bench.decoders`.

Writes JSON through `bench.common.save` (`decoders_fp8_<device>.json`; each result row holds
`dtype`, `fp8_dequant` and `fp8_scaled`) and prints a markdown table in the README's format.
"""

from __future__ import annotations

import argparse
import dataclasses

import djax
from bench.common import save
from bench.decoders import COUNTING, add_demo_arguments, demo_payload, demo_problems, evaluate, runs
from djax.demo.evaluate import demo_config

# What each column loads: djax.load's `weights` and kernel options.
VARIANTS = {
    "dtype": {"weights": "dtype"},
    "fp8_dequant": {"weights": "fp8", "fp8_impl": "dequant"},
    "fp8_scaled": {"weights": "fp8", "fp8_impl": "scaled"},
}


def markdown(rows: list[dict], dtype: str) -> str:
    """One line per configuration: exact match, forwards per answer and tokens per forward
    in `dtype`, fp8 `dequant` and fp8 `scaled`."""
    lines = [
        f"| decoder / cache | exact match, {dtype} / fp8 dequant / fp8 scaled | forwards per "
        "answer | tokens per forward |",
        "|---|---|---|---|",
    ]
    for row in rows:
        runs_ = [row[name] for name in VARIANTS]
        exact = " / ".join(f"{100 * r['accuracy']:.1f}%" for r in runs_)
        forwards = " / ".join(f"{r['forwards_per_answer']:.1f}" for r in runs_)
        tokens = " / ".join(f"{r['tokens_per_forward']:.2f}" for r in runs_)
        lines.append(f"| {row['label']} | {exact} | {forwards} | {tokens} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_demo_arguments(p)
    args = p.parse_args(argv)
    folder, problems = demo_problems(args)
    models = {name: djax.load(folder, args.dtype, **load) for name, load in VARIANTS.items()}
    dtype = str(models["dtype"].dtype)
    rows = []
    for label, fields in runs():
        config = demo_config(**fields)
        row: dict = {"label": label, "config": dataclasses.asdict(config)}
        for name, model in models.items():
            row[name], _ = evaluate(model, problems, config, args.batch, f"{label} / {name}")
        rows.append(row)
    print(f"\n{markdown(rows, dtype)}\n")
    payload = demo_payload(folder, dtype, args)
    counting = f"as bench.decoders: {COUNTING}"
    save("decoders_fp8", {**payload, "variants": VARIANTS, "counting": counting, "results": rows})


if __name__ == "__main__":
    main()
