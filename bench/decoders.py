"""Decoders × cache policies on the demo task: exact match, tokens per forward, forwards per
answer.

    python -m bench.decoders [--model FOLDER] [--problems 256] [--batch 64]

Every decoder (low_confidence at 1 token per step, threshold 0.9, factor 1.0, credit,
hierarchy 0.9/0.4) runs under every cache policy (none, prefix, dual, vicinity), plus
threshold + dual with iteration smoothing, on the same held-out problems of
`djax.demo.task` (test split), in batches through `djax.generate` with the chat template.

How forwards are counted (see `djax.demo.evaluate`): a batch decodes in lockstep until its
slowest row is done, so each answer is charged every forward of its batch.
`forwards/answer` is the mean of that charge and `tokens/forward` the answer tokens (up to
the first stop token) per charged forward. At `--batch 1` both are exact per-answer
figures; at larger batches they are what an answer costs when served in such a batch.
Refreshes (whole-sequence forwards) count as forwards like any other.

Writes JSON through `bench.common.save` (device, commit, command line, date, every config
with its totals and per-task exact match) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax

import djax
from bench.common import save
from djax.demo import default_model_path, describe, task
from djax.demo.evaluate import accuracy_by_task, demo_config, score

DECODERS = {
    "low_confidence": {"decoder": "low_confidence", "steps": task.GEN_LENGTH},
    "threshold": {"decoder": "threshold", "threshold": 0.9},
    "factor": {"decoder": "factor", "factor": 1.0},
    "credit": {"decoder": "credit", "threshold": 0.9},
    "hierarchy": {"decoder": "hierarchy", "threshold": 0.9, "low_threshold": 0.4},
}
CACHES = ("none", "prefix", "dual", "vicinity")


def runs() -> list[tuple[str, dict]]:
    """(label, GenerationConfig fields) of every benchmarked configuration."""
    grid = [
        (f"{name} / {cache}", fields | {"cache": cache})
        for name, fields in DECODERS.items()
        for cache in CACHES
    ]
    smoothed = DECODERS["threshold"] | {"cache": "dual", "smoothing": True}
    return [*grid, ("threshold / dual / smoothing", smoothed)]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| decoder / cache | exact match | tokens/forward | forwards/answer | refreshes/batch"
        " | seconds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['accuracy']:.4f} | {r['tokens_per_forward']:.2f} | "
            f"{r['forwards_per_answer']:.2f} | {r['refreshes'] / r['batches']:.2f} | "
            f"{r['seconds']:.2f} |"
        )
    return "\n".join(lines)


COUNTING = (
    "forwards/answer: forwards of the answer's batch (lockstep), averaged over answers; "
    "tokens/forward: answer tokens before the first stop token per such forward"
)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a run on the demo task: model folder, problems, seed, batch, dtype."""
    parser.add_argument("--model", type=Path, default=None, help="model folder (the demo)")
    parser.add_argument("--problems", type=int, default=256, help="held-out problems")
    parser.add_argument("--seed", type=int, default=7, help="which held-out problems")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="compute dtype (default: djax.load's)")


def demo_problems(args: argparse.Namespace) -> tuple[Path, list]:
    """The model folder and the held-out problems of `args` (`add_demo_arguments`), said
    on stdout with the device."""
    folder = args.model or default_model_path()
    problems = task.make_problems(args.problems, "test", args.seed)
    device = jax.devices()[0].device_kind
    print(f"{describe(folder) or folder}\n{args.problems} problems, batch {args.batch}, {device}")
    return folder, problems


def demo_payload(folder: Path, dtype: str, args: argparse.Namespace) -> dict:
    """What a demo run's results file says of its model and problems."""
    return {
        "model": str(folder),
        "model_info": describe(folder),
        "dtype": dtype,
        "problems": args.problems,
        "seed": args.seed,
        "batch": args.batch,
    }


def evaluate(model: djax.Model, problems: list, config, batch: int, label: str) -> tuple:
    """Score `config` on the problems: (the totals with per-task exact match, the result),
    said on stdout under `label`."""
    result, texts = score(model, problems, config, batch)
    print(
        f"  {label}: {result.accuracy:.4f} exact, {result.tokens_per_forward:.2f} tok/fwd, "
        f"{result.forwards_per_answer:.2f} fwd/answer",
        flush=True,
    )
    return {**result.summary(), "by_task": accuracy_by_task(problems, texts)}, result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_demo_arguments(p)
    args = p.parse_args(argv)
    folder, problems = demo_problems(args)
    model = djax.load(folder, args.dtype)
    rows = []
    for label, fields in runs():
        config = demo_config(**fields)
        totals, _ = evaluate(model, problems, config, args.batch, label)
        rows.append({"label": label, "config": dataclasses.asdict(config), **totals})
    print(f"\n{markdown(rows)}\n")
    payload = demo_payload(folder, str(model.dtype), args)
    save("decoders", {**payload, "counting": COUNTING, "results": rows})


if __name__ == "__main__":
    main()
