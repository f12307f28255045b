"""Whole-generation speed through `djax.generate`, at the setting every engine is compared on:
gen_length 256, block 32, 64 fixed steps (4 tokens per forward, so every engine does the
same work), prompts of 128 and 512 tokens, caches none / prefix / dual, plus the threshold
decoder with the dual cache, at each `--batch` (default 1: that many different prompts of
the same length, decoded together). Random bf16 weights built on the device (so the
threshold decoder commits about one token per forward: its row shows the per-forward cost).

The physical limit of a run is the sum over its forwards of the longer of two times: the
forward's FLOPs (every row of the batch) at the measured matmul rate, and reading its weights
once at the measured HBM read rate. Batch-1 block forwards are bound by the weights,
refreshes and large batches by the FLOPs. Tokens/s (answer tokens of the whole batch) is
reported beside it, with each program's compile time (`bench.compile` measures it from the
persistent cache, in a fresh process). For LLaDA-MoE the weights counted are those of the
experts the forwards' tokens reach (`experts_hit`, counted in a run of its own).
`--routing spread` moves each token's experts by its row (`spread_routing`), so a block
reaches every expert as a spread-out trained router would; the random router sends a
block's mask tokens to ~10. Results: `generate_<device>.json`, or
`generate_spread_<device>.json` with `--routing spread`.

    python -m bench.generate [--models dense moe] [--batch 1 8] [--variants default
        norm_impl=xla] [--steps 64 32] [--routing model|spread] [--tiny]

Each `--variants` entry is a set of module options (`default`: the engine's own choices),
run in turn on the same weights. With two `--steps` counts the dual-cache runs also split
their time between the two kinds of forward, inside the generation: both counts do the same
refreshes (one per block), so the time difference over the forward-count difference is one
block forward, and what is left of a run over its refreshes is one refresh (`splits`).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import numpy as np

from bench.common import (
    ROUTINGS,
    SETTING,
    bench_model,
    experts_hit,
    measure_ceilings,
    model_config,
    parse_options,
    save,
    use_routing,
    weight_bytes,
)
from bench.forward import block_flops, refresh_flops
from djax import GenerationConfig, Model, engine, generate
from djax.config import WEIGHTS


def run_case(
    model: Model,
    prompt_len: int,
    batch: int,
    config: GenerationConfig,
    ceilings: dict,
    repeats: int,
) -> dict:
    """The median of `repeats` generations of `batch` random prompts of `prompt_len` tokens
    (after one that compiles), against the run's physical limit."""
    rng = np.random.default_rng(prompt_len)
    high = min(1000, model.config.mask_token_id)
    prompts = [rng.integers(0, high, prompt_len).tolist() for _ in range(batch)]
    first = generate(model, prompts, config)
    runs = [generate(model, prompts, config) for _ in range(repeats)]
    best = sorted(runs, key=lambda r: r.stats.seconds)[len(runs) // 2]
    s = best.stats
    seq = prompt_len + config.gen_length
    hit = experts_hit(model, prompts, config) if model.config.is_moe else {}
    bandwidth, rate = ceilings["hbm_read_bytes_per_s"], ceilings["matmul_flops_per_s"]
    refresh_s = max(
        batch * refresh_flops(model.config, model.params, seq) / rate,
        weight_bytes(model.params, hit.get("whole")) / bandwidth,
    )
    block_s = max(
        batch * block_flops(model.config, model.params, seq) / rate,
        weight_bytes(model.params, hit.get("window", hit.get("whole"))) / bandwidth,
    )
    limit_s = s.refreshes * refresh_s + (s.forwards - s.refreshes) * block_s
    tokens = batch * config.gen_length  # early stop is off: every answer position is generated
    return {
        "prompt_len": prompt_len,
        "batch": batch,
        "cache": config.cache,
        "decoder": config.decoder,
        "forwards": s.forwards,
        "refreshes": s.refreshes,
        "tokens_per_forward": tokens / s.forwards,
        "seconds": s.seconds,
        "tokens_per_s": tokens / s.seconds,
        "ms_per_forward": 1e3 * s.seconds / s.forwards,
        "limit_tokens_per_s": tokens / limit_s,
        "pct_of_limit": 100 * limit_s / s.seconds,
        "compile_s": first.stats.compile_seconds,
        "experts_hit": hit,
        "steps": config.steps,
    }


def forward_splits(rows: list[dict]) -> list[dict]:
    """Block-forward and refresh ms inside the generation, from pairs of rows that differ
    only in their step count (so in their block forwards, not their refreshes)."""
    found = []
    for a in rows:
        for b in rows:
            same = ("model", "options", "prompt_len", "batch", "cache", "decoder", "refreshes")
            if a["steps"] <= b["steps"] or any(a[k] != b[k] for k in same):
                continue
            blocks = a["forwards"] - a["refreshes"], b["forwards"] - b["refreshes"]
            block_s = (a["seconds"] - b["seconds"]) / (blocks[0] - blocks[1])
            refresh_s = (b["seconds"] - blocks[1] * block_s) / b["refreshes"]
            found.append(
                {
                    **{k: a[k] for k in same},
                    "steps": (a["steps"], b["steps"]),
                    "block_forward_ms": 1e3 * block_s,
                    "refresh_ms": 1e3 * refresh_s,
                }
            )
    return found


def positive(text: str) -> int:
    """A batch size from the command line: a positive integer."""
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"batch {text!r}; expected a positive integer")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    parser.add_argument("--prompts", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch", nargs="+", type=positive, default=[1], help="prompts per call")
    parser.add_argument("--caches", nargs="+", default=["none", "prefix", "dual"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        help="module option sets: default, or key=value[,key=value] (e.g. mlp_impl=xla)",
    )
    parser.add_argument(
        "--steps", nargs="+", type=int, default=[SETTING.steps], help="step counts to run"
    )
    parser.add_argument("--moe-impl", default="auto")
    parser.add_argument("--routing", choices=ROUTINGS, default="model", help="see use_routing")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument(
        "--weights", choices=WEIGHTS, default="dtype", help="fp8: projections and experts in fp8"
    )
    args = parser.parse_args()
    engine.enable_compile_cache(tempfile.mkdtemp(prefix="djax_xla_cache_"))
    use_routing(args.routing)
    ceilings = measure_ceilings(args.tiny)
    variants = [parse_options(text) for text in args.variants]
    base = SETTING
    rows = []
    for name in args.models:
        config = model_config(name, args.tiny)
        model, _ = bench_model(config, 1, (("moe_impl", args.moe_impl),), args.weights)
        cases = [
            dataclasses.replace(base, cache=c, steps=steps)
            for c in args.caches
            for steps in args.steps
        ]
        cases.append(dataclasses.replace(base, decoder="threshold", cache="dual"))
        for options in variants:
            variant = model.with_options(**options)
            for prompt_len in args.prompts:
                for batch in args.batch:
                    for case in cases:
                        row = run_case(variant, prompt_len, batch, case, ceilings, args.repeats)
                        row = {"model": name, "weights": args.weights, "options": options, **row}
                        rows.append(row)
                        print(rows[-1])
        del model, variant
    splits = forward_splits([r for r in rows if r["decoder"] == base.decoder])
    for split in splits:
        print(split)
    save(
        "generate" if args.routing == "model" else "generate_spread",
        {
            "ceilings": ceilings,
            "setting": dataclasses.asdict(base),
            "options": vars(args),
            "results": rows,
            "splits": splits,
        },
        "fp8" if args.weights == "fp8" else None,
    )


if __name__ == "__main__":
    main()
