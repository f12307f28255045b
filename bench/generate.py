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

`--models llada2_mini` (the LLaDA2.0-mini shape) generates by block diffusion, which
`djax.generate` chooses from the family (`djax.block_diffusion`): under its block cache
(`dual`) a run's forwards are the prefill of the prompt's whole blocks (`refreshes`: one,
or none for a prompt shorter than a block; it computes no logits, so reads no head), then
per generated block (`blocks`) a first step feeding the block and the one before it (2 ×
block rows, writing the finished block's K/V into the append-only cache) and its other steps
feeding the block alone; `cache="none"` runs whole-sequence forwards. The limit counts each
kind of forward with its own rows and experts (`experts_hit`: `prefill`, `block_and_previous`,
`block`). `--steps` stays the total over the generated blocks (a prompt of a multiple of 32
tokens generates 256 / 32 = 8: `--steps 256` is 32 steps a block, `64` is 8 a block, 4
tokens per forward); the cache `prefix` is skipped; `--routing spread` moves LLaDA2's
experts by `spread_grouped_routing`, keeping each token's groups. Results:
`generate_llada2[_spread]_<device>.json`.

    python -m bench.generate [--models dense moe llada2_mini] [--batch 1 8] [--variants
        default norm_impl=xla] [--steps 64 32] [--routing model|spread] [--no-threshold]
        [--sampling greedy temperature=0.7,top_p=0.9] [--tiny]

Each `--variants` entry is a set of module options (`default`: the engine's own choices),
run in turn on the same weights. The threshold decoder runs with the dual cache at the first
`--steps` count (`--no-threshold`: not at all, a program less to compile per variant).
With two `--steps` counts the dual-cache runs also split their time between the two kinds
of forward, inside the generation: both counts do the same refreshes
(one per block), so the time difference over the forward-count difference is one block
forward, and what is left of a run over its refreshes is one refresh (`splits`; under
block diffusion both do the same prefill and first steps, and the split is the block forward
alone).

Each `--sampling` entry runs every case again with those sampling fields of
`GenerationConfig` (`greedy`, the default: temperature 0; or `temperature=T[,top_k=K]
[,top_p=P]`), its rows labelled `sampling`; a run with any sampled entry saves as
`generate_sampling_<device>.json`, so the greedy baselines stay as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
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
from bench.forward import active_matmul_params, forward_flops
from djax import GenerationConfig, Model, block_diffusion, engine, generate
from djax.config import LLADA2, WEIGHTS, ModelConfig


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
    hit = experts_hit(model, prompts, config) if model.config.is_moe else {}
    kernels = None  # block diffusion's programs are planned apart (`djax.block_diffusion`)
    if not model.config.block_diffusion:
        plan, _ = engine.make_plan(model, config, batch, prompt_len)
        kernels = engine.kernel_choice(model, plan).explain()
    limit = block_diffusion_limit if model.config.block_diffusion else denoising_limit
    limit_s = limit(model, s, prompt_len, batch, config, hit, ceilings)
    tokens = batch * config.gen_length  # early stop is off: every answer position is generated
    return {
        "family": model.config.family,
        "prompt_len": prompt_len,
        "batch": batch,
        "cache": config.cache,
        "decoder": config.decoder,
        "forwards": s.forwards,
        "refreshes": s.refreshes,
        "blocks": s.blocks,
        "tokens_per_forward": tokens / s.forwards,
        "seconds": s.seconds,
        "tokens_per_s": tokens / s.seconds,
        "ms_per_forward": 1e3 * s.seconds / s.forwards,
        "limit_tokens_per_s": tokens / limit_s,
        "pct_of_limit": 100 * limit_s / s.seconds,
        "compile_s": first.stats.compile_seconds,
        "experts_hit": hit,
        "steps": config.steps,
        "kernels": kernels,
    }


def forward_seconds(
    model: Model,
    batch: int,
    ceilings: dict,
    rows: int,
    kv_len: int,
    experts: float | None,
    head_rows: int,
) -> float:
    """One forward's physical limit: the longer of its FLOPs (`rows` token rows of each of
    the `batch` sequences, attending to `kv_len` keys, the head on `head_rows`) at the
    matmul rate (the products of fp8 weights at the fp8 rate, attention and the head at
    the bf16 rate) and reading its weights once (`experts` experts of each MoE layer; no
    head without `head_rows`) at the HBM read rate."""
    flops = forward_flops(model.config, model.params, rows, kv_len, head_rows)
    products = 2 * rows * active_matmul_params(model.config, model.params)
    bf16_rate = ceilings["matmul_flops_per_s"]
    product_rate = ceilings["fp8_matmul_flops_per_s"] if model.weights == "fp8" else bf16_rate
    compute = batch * (products / product_rate + (flops - products) / bf16_rate)
    read = weight_bytes(model.params, experts, head=head_rows > 0)
    return max(compute, read / ceilings["hbm_read_bytes_per_s"])


def denoising_limit(model, s, prompt_len, batch, config, hit, ceilings) -> float:
    """LLaDA's forwards: `s.refreshes` whole-sequence forwards, the rest block forwards of
    `block_length` rows against the whole sequence's keys; the head on one block."""
    seq, b = prompt_len + config.gen_length, config.block_length
    refresh = forward_seconds(model, batch, ceilings, seq, seq, hit.get("whole"), b)
    window = hit.get("window", hit.get("whole"))
    block = forward_seconds(model, batch, ceilings, b, seq, window, b)
    return s.refreshes * refresh + (s.forwards - s.refreshes) * block


def block_diffusion_limit(model, s, prompt_len, batch, config, hit, ceilings) -> float:
    """Block diffusion's forwards (`djax.block_diffusion`). Under its cache: the prefill of
    the prompt's whole blocks (`s.refreshes`: one or none; no head), each generated block's
    first step feeding the block and the one before it (`s.blocks`), and its other steps
    feeding the block alone, each attending to at most the whole sequence's keys. Without
    the cache every step is a whole-sequence forward. The head runs on the block's rows."""
    seq, b = prompt_len + config.gen_length, config.block_length
    if config.cache == "none":
        return s.forwards * forward_seconds(model, batch, ceilings, seq, seq, hit.get("whole"), b)
    whole_blocks = prompt_len // b * b
    prefill = forward_seconds(
        model, batch, ceilings, whole_blocks, whole_blocks, hit.get("prefill"), 0
    )
    first = forward_seconds(model, batch, ceilings, 2 * b, seq, hit.get("block_and_previous"), b)
    block = forward_seconds(model, batch, ceilings, b, seq, hit.get("block"), b)
    steps = s.forwards - s.refreshes - s.blocks
    return s.refreshes * prefill + s.blocks * first + steps * block


def forward_splits(rows: list[dict]) -> list[dict]:
    """Block-forward and refresh ms inside the generation, from pairs of rows that differ
    only in their step count (so in their block forwards, not their refreshes)."""
    found = []
    for a in rows:
        for b in rows:
            same = (
                "model",
                "weights",
                "options",
                "prompt_len",
                "batch",
                "cache",
                "decoder",
                "sampling",
                "refreshes",
            )
            if a["steps"] <= b["steps"] or any(a[k] != b[k] for k in same):
                continue
            blocks = a["forwards"] - a["refreshes"], b["forwards"] - b["refreshes"]
            block_s = (a["seconds"] - b["seconds"]) / (blocks[0] - blocks[1])
            split = {
                **{k: a[k] for k in same},
                "steps": (a["steps"], b["steps"]),
                "block_forward_ms": 1e3 * block_s,
            }
            if a["family"] != LLADA2:  # block diffusion has a prefill, not refreshes
                refresh_s = (b["seconds"] - blocks[1] * block_s) / b["refreshes"]
                split["refresh_ms"] = 1e3 * refresh_s
            found.append(split)
    return found


SAMPLING_FIELDS = {"temperature": float, "top_k": int, "top_p": float}


def parse_sampling(text: str) -> dict[str, float | int]:
    """A `--sampling` entry: `greedy` ({}), or `temperature=T[,top_k=K][,top_p=P]` with a
    temperature above 0 (the filters act on sampled rows only)."""
    if text == "greedy":
        return {}
    fields = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in SAMPLING_FIELDS:
            raise argparse.ArgumentTypeError(
                f"sampling {text!r}; expected 'greedy' or temperature=T[,top_k=K][,top_p=P]"
            )
        try:
            fields[key] = SAMPLING_FIELDS[key](value)
        except ValueError:
            message = f"sampling {text!r}: {key}={value!r} is not a number"
            raise argparse.ArgumentTypeError(message) from None
    if not fields.get("temperature", 0) > 0:
        raise argparse.ArgumentTypeError(f"sampling {text!r}: expected a temperature above 0")
    try:  # GenerationConfig's own checks (a finite temperature, top_p in (0, 1], ...)
        dataclasses.replace(SETTING, **fields)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"sampling {text!r}: {err}") from None
    return fields


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
        "--threshold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the threshold decoder's row (--no-threshold: the setting's rows alone)",
    )
    parser.add_argument(
        "--sampling",
        nargs="+",
        type=parse_sampling,
        default=[{}],
        help="sampling fields per run: greedy, or temperature=T[,top_k=K][,top_p=P]",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        choices=WEIGHTS,
        default=["dtype"],
        help="weight forms to run, each model under each (fp8: projections and experts in fp8)",
    )
    args = parser.parse_args()
    engine.enable_compile_cache(tempfile.mkdtemp(prefix="djax_xla_cache_"))
    use_routing(args.routing)
    ceilings = measure_ceilings(args.tiny)
    variants = [parse_options(text) for text in args.variants]
    configs = {name: model_config(name, args.tiny) for name in args.models}
    name = "generate"
    if any(config.block_diffusion for config in configs.values()):
        name += "_llada2"
    if args.routing == "spread":
        name += "_spread"
    base = SETTING
    rows = []
    suffix = "fp8" if "fp8" in args.weights else None
    if any(args.sampling):
        suffix = "sampling" if suffix is None else f"{suffix}_sampling"
    for (model_name, config), weights in itertools.product(configs.items(), args.weights):
        model, _ = bench_model(config, 1, (("moe_impl", args.moe_impl),), weights)
        for options in variants:
            if weights != "fp8" and "fp8_impl" in options:
                continue  # fp8_impl picks the fp8 products: nothing to vary in other weights
            variant = model.with_options(**options)
            for prompt_len in args.prompts:
                for batch in args.batch:
                    runs = cases(config, base, args.caches, args.steps, args.threshold)
                    for case, sampling in itertools.product(runs, args.sampling):
                        case = dataclasses.replace(case, **sampling)
                        row = run_case(variant, prompt_len, batch, case, ceilings, args.repeats)
                        labels = {"model": model_name, "weights": weights, "options": options}
                        labels["sampling"] = sampling or "greedy"
                        rows.append(labels | row)
                        print(rows[-1])
                        # saved after every row: a run cut short keeps the rows it measured
                        splits = forward_splits([r for r in rows if r["decoder"] == base.decoder])
                        payload = {"ceilings": ceilings, "setting": dataclasses.asdict(base)}
                        payload |= {"options": vars(args), "results": rows, "splits": splits}
                        save(name, payload, suffix)
        del model, variant
    for split in forward_splits([r for r in rows if r["decoder"] == base.decoder]):
        print(split)


def cases(
    config: ModelConfig,
    base: GenerationConfig,
    caches: list[str],
    steps: list[int],
    threshold: bool = True,
) -> list[GenerationConfig]:
    """The runs of one model: `base` under each cache at each step count, then (with
    `threshold`) the threshold decoder with the dual cache at the first step count. Block
    diffusion runs the caches it has (`dual`, its append-only block cache, and `none`); the
    others are skipped."""
    if config.block_diffusion:
        skipped = [c for c in caches if c not in block_diffusion.CACHES]
        if skipped:
            print(f"block diffusion ({config.family}) has no cache {skipped}: skipped")
        caches = [c for c in caches if c in block_diffusion.CACHES]
    runs = [dataclasses.replace(base, cache=c, steps=n) for c in caches for n in steps]
    if not threshold:
        return runs
    return [*runs, dataclasses.replace(base, decoder="threshold", cache="dual", steps=steps[0])]


if __name__ == "__main__":
    main()
