"""Tensor / expert parallelism speed: LLaDA-8B with TP=n and LLaDA-MoE with EP=n against one
device, in the same run, at the `bench/generate.py` setting (batch 1, prompt 128, gen 256,
block 32, dual cache, 64 fixed steps = 4 tokens per forward).

Random bf16 weights are built already sharded on the devices. The block-forward time is
measured by difference: the same generation with 128 steps instead of 64 runs the same 8
refreshes and 64 more block forwards, so block ms = (t_128 − t_64) / 64. `--dinfer` adds
dInfer's LLaDA-MoE setting (gen 1024, block 64, vicinity 16/16 with 4 warm-up steps, 4
tokens per forward).

    python -m bench.parallel [--sizes 1 2] [--models dense moe] [--weights dtype fp8]
        [--variants default fp8_impl=scaled] [--routing model|spread] [--dinfer] [--tiny]

`--weights`: each model under each weight form (`fp8`: projections and experts in e4m3,
split as the bf16 ones are; `auto` runs them in the fp8 kernels on Hopper GPUs, each
device's share K-major). `--variants`: each a set
of kernel options (`bench.common.parse_options`; `default`: none) run at every size, each
row carrying its `options` and its speedup over one device under the same options.
`--routing spread`: LLaDA-MoE's tokens spread as a trained router's (`bench.common.
use_routing`; the headline MoE setting). Each row carries `weights`, `routing` and
`kernels` (what `auto` resolved for the setting's programs); a row on several devices carries
`tokens_equal_vs_1`, the fraction of its generated tokens equal to one device's under the
same options (sums split across devices round differently, so random weights may flip a
few).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import numpy as np

from bench.common import (
    ROUTINGS,
    SETTING,
    bench_model,
    model_config,
    parse_options,
    save,
    use_routing,
)
from djax import GenerationConfig, Model, engine, generate
from djax.config import WEIGHTS

DINFER = GenerationConfig(
    gen_length=1024,
    block_length=64,
    steps=256,
    decoder="low_confidence",
    cache="vicinity",
    vicinity_before=16,
    vicinity_after=16,
    vicinity_warmup=4,
    early_stop=False,
)


def timed(model: Model, prompt: list[int], config: GenerationConfig, repeats: int) -> dict:
    first = generate(model, [prompt], config)  # compiles
    runs = sorted(generate(model, [prompt], config).stats.seconds for _ in range(repeats))
    return {
        "seconds": runs[len(runs) // 2],
        "forwards": first.stats.forwards,
        "refreshes": first.stats.refreshes,
        "compile_s": first.stats.compile_seconds,
        "answer_ids": first.answer_ids,
    }


def measure(model: Model, prompt: list[int], base: GenerationConfig, repeats: int) -> dict:
    """Speed figures at `base` (and at twice its steps, for the block forward by difference);
    `answer_ids` holds the generated tokens at `base`, for comparing runs."""
    short = timed(model, prompt, base, repeats)
    longer = timed(model, prompt, dataclasses.replace(base, steps=2 * base.steps), repeats)
    extra = longer["forwards"] - short["forwards"]
    plan, _ = engine.make_plan(model, base, 1, len(prompt))
    return {
        "kernels": engine.kernel_choice(model, plan).explain(),
        "tokens_per_s": base.gen_length / short["seconds"],
        "tokens_per_forward": base.gen_length / short["forwards"],
        "ms_per_forward": 1e3 * short["seconds"] / short["forwards"],
        "block_forward_ms": 1e3 * (longer["seconds"] - short["seconds"]) / extra,
        "forwards": short["forwards"],
        "refreshes": short["refreshes"],
        "seconds": short["seconds"],
        "compile_s": short["compile_s"],
        "answer_ids": short["answer_ids"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dinfer", action="store_true")
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=["dtype"])
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--routing", choices=ROUTINGS, default="model", help="see use_routing")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    use_routing(args.routing)
    prompt = np.arange(10, 10 + args.prompt_len).tolist()
    variants = [parse_options(text) for text in args.variants]
    rows = []
    for name, weights, options in itertools.product(args.models, args.weights, variants):
        config = model_config(name, args.tiny)
        settings = [("bench", SETTING)]
        if args.dinfer and config.is_moe:
            settings.append(("dinfer", DINFER))
        for n in args.sizes:
            model, split = bench_model(config, n, options, weights)
            for label, base in settings:
                row = {"model": name, "weights": weights, "options": options}
                row.update({"routing": args.routing, "setting": label, "devices": n, **split})
                try:
                    row.update(measure(model, prompt, base, args.repeats))
                except Exception as err:  # keep the other cases of a costly run
                    row["error"] = f"{type(err).__name__}: {err}"[:2000]
                print(row)
                rows.append(row)
            del model

    def case(row: dict) -> tuple:
        return row["model"], row["weights"], row["setting"], sorted(row["options"].items())

    for row in rows:
        one = [r for r in rows if case(r) == case(row) and r["devices"] == 1]
        if one and "tokens_per_s" in one[0] and "tokens_per_s" in row:
            row["speedup_vs_1"] = row["tokens_per_s"] / one[0]["tokens_per_s"]
        if one and "answer_ids" in one[0] and "answer_ids" in row and row["devices"] > 1:
            ours, theirs = np.asarray(row["answer_ids"]), np.asarray(one[0]["answer_ids"])
            row["tokens_equal_vs_1"] = float(np.mean(ours == theirs))
    for row in rows:
        row.pop("answer_ids", None)
    save(
        "parallel" + ("_spread" if args.routing == "spread" else ""),
        {
            "options": vars(args),
            "devices_used": max(args.sizes),
            "setting": dataclasses.asdict(SETTING),
            "dinfer_setting": dataclasses.asdict(DINFER),
            "results": rows,
            "visible_devices": len(jax.devices()),
        },
        "fp8" if "fp8" in args.weights else None,
    )


if __name__ == "__main__":
    main()
