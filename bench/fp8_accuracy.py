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
from pathlib import Path

import jax

import djax
from bench.common import save
from bench.decoders import runs
from djax.demo import default_model_path, describe, task
from djax.demo.evaluate import accuracy_by_task, demo_config, score

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
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the demo)")
    p.add_argument("--problems", type=int, default=256, help="held-out problems")
    p.add_argument("--seed", type=int, default=7, help="which held-out problems")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", default=None, help="compute dtype (default: djax.load's)")
    args = p.parse_args(argv)

    folder = args.model or default_model_path()
    models = {weights: djax.load(folder, args.dtype, weights=weights) for weights in WEIGHTS}
    dtype = str(models["dtype"].dtype)
    problems = task.make_problems(args.problems, "test", args.seed)
    device = jax.devices()[0].device_kind
    print(f"{describe(folder) or folder}\n{args.problems} problems, batch {args.batch}, {device}")
    rows = []
    for label, fields in runs():
        config = demo_config(**fields)
        row: dict = {"label": label, "config": dataclasses.asdict(config)}
        for weights, model in models.items():
            result, texts = score(model, problems, config, args.batch)
            row[weights] = {**result.summary(), "by_task": accuracy_by_task(problems, texts)}
            print(
                f"  {label} / {weights}: {result.accuracy:.4f} exact, "
                f"{result.tokens_per_forward:.2f} tok/fwd, "
                f"{result.forwards_per_answer:.2f} fwd/answer",
                flush=True,
            )
        rows.append(row)
    print(f"\n{markdown(rows, dtype)}\n")
    save(
        "decoders_fp8",
        {
            "model": str(folder),
            "model_info": describe(folder),
            "dtype": dtype,
            "weights": list(WEIGHTS),
            "problems": args.problems,
            "seed": args.seed,
            "batch": args.batch,
            "counting": "as bench.decoders: forwards/answer: forwards of the answer's batch "
            "(lockstep), averaged over answers; tokens/forward: answer tokens before the first "
            "stop token per such forward",
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
