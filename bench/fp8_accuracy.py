"""The demo model's accuracy with fp8 weights beside its own dtype's, for every decoder and
cache policy of `bench.decoders`: exact match, forwards per answer, tokens per forward.

    python -m bench.fp8_accuracy [--model FOLDER] [--problems 256] [--batch 64]

The same held-out problems and configurations as `bench.decoders`, run twice: with the
model loaded in its dtype (`weights="dtype"`) and with `weights="fp8"` (projections as e4m3
with a scale per output channel, `djax.models.fp8`). Forwards are counted as there.

Writes JSON through `bench.common.save` (`decoders_fp8_<device>.json`) and prints a
markdown table in the README's format.
"""

from __future__ import annotations

import argparse
import dataclasses

import djax
from bench.common import save
from bench.decoders import COUNTING, add_demo_arguments, demo_payload, demo_problems, evaluate, runs
from djax.demo.evaluate import demo_config

WEIGHTS = ("dtype", "fp8")


def markdown(rows: list[dict], dtype: str) -> str:
    """One line per configuration: exact match, forwards per answer and tokens per forward
    in `dtype` and in fp8."""
    lines = [
        f"| decoder / cache | exact match, {dtype} | exact match, fp8 | forwards per answer, "
        f"{dtype} | forwards per answer, fp8 | tokens per forward, {dtype} | tokens per "
        "forward, fp8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ref, ours = row["dtype"], row["fp8"]
        lines.append(
            f"| {row['label']} | {100 * ref['accuracy']:.1f}% | {100 * ours['accuracy']:.1f}% | "
            f"{ref['forwards_per_answer']:.1f} | {ours['forwards_per_answer']:.1f} | "
            f"{ref['tokens_per_forward']:.2f} | {ours['tokens_per_forward']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_demo_arguments(p)
    args = p.parse_args(argv)
    folder, problems = demo_problems(args)
    models = {weights: djax.load(folder, args.dtype, weights=weights) for weights in WEIGHTS}
    dtype = str(models["dtype"].dtype)
    rows = []
    for label, fields in runs():
        config = demo_config(**fields)
        row: dict = {"label": label, "config": dataclasses.asdict(config)}
        for weights, model in models.items():
            row[weights], _ = evaluate(model, problems, config, args.batch, f"{label} / {weights}")
        rows.append(row)
    print(f"\n{markdown(rows, dtype)}\n")
    payload = demo_payload(folder, dtype, args)
    counting = f"as bench.decoders: {COUNTING}"
    save(
        "decoders_fp8", {**payload, "weights": list(WEIGHTS), "counting": counting, "results": rows}
    )


if __name__ == "__main__":
    main()
