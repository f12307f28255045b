"""Forward-pass speed at LLaDA-8B and LLaDA-MoE shapes, against the roofline.

Random bf16 weights are built directly on the device. Times are medians of forwards run
back to back inside one compiled loop (as the engine runs them). Cases:
  refresh S: a whole-sequence forward over S tokens with logits for one 32-token block
             (floor: the longer of FLOPs / measured matmul rate and the weights' bytes /
             measured read rate, as `bench.generate`'s limit counts a forward);
  block:     a 32-token forward attending to a K/V buffer of `--kv-len` positions, writing
             its K/V into the buffer (floor: bytes of weights read / measured bandwidth;
             the K/V buffer read is reported beside it).
Each MoE model runs under every `--moe-impls` entry, each dense one under every
`--attention-impls` entry.

    python -m bench.forward [--models dense moe] [--seqs 384 1280] [--kv-len 1280]
                            [--attention-impls ...] [--moe-impls ...] [--routing spread]
                            [--profile] [--tiny]

`--profile`: each row also holds where its forward's device time goes, per forward, with
the kernels of one forward in order (`profile`). `--routing spread`: LLaDA-MoE's tokens
spread over the experts as a trained router's are (`bench.common.use_routing`); results
`forward_spread_<device>.json`.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp

from bench.common import (
    ROUTINGS,
    measure_ceilings,
    model_config,
    save,
    time_in_program,
    use_routing,
    weight_bytes,
)
from bench.profile import profile_in_program
from djax import programs
from djax.kernel_options import KernelOptions
from djax.models import init_params
from djax.models.kernel_choice import Shapes
from djax.models.layers import Window

BLOCK = 32
# The refresh `ragged_dot_kernels` compiles.
RAGGED_ROWS = 256


def active_matmul_params(config, params) -> int:
    """Weights each token multiplies by (MoE: attention, router and its top-k experts)."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        top, last = path[0].key, path[-1].key
        if top in ("embed", "lm_head") or leaf.ndim < 2 or last.endswith("_scale"):
            continue  # fp8 weights' scales multiply outputs, not rows
        if (
            top.startswith("ff_")
            and leaf.ndim >= 3
            and last in ("gate_up", "down")
            and (config.is_moe and leaf.shape[0] == config.n_experts)
        ):
            total += leaf.size * config.experts_per_token // config.n_experts
        else:
            total += leaf.size
    return total


def forward_flops(config, params, rows: int, kv_len: int, head_rows: int = BLOCK) -> float:
    """FLOPs of one sequence's forward: `rows` token rows through the weights each token
    multiplies by, their attention to `kv_len` keys, and the head on `head_rows` rows."""
    attention = 4 * rows * kv_len * config.n_heads * config.head_dim * config.n_layers
    return (
        2 * rows * active_matmul_params(config, params)
        + attention
        + (2 * head_rows * config.d_model * config.vocab_size)
    )


def refresh_flops(config, params, seq: int) -> float:
    """A whole-sequence forward of `seq` tokens with logits for one `BLOCK`."""
    return forward_flops(config, params, seq, seq)


def block_flops(config, params, kv_len: int) -> float:
    """A block forward: `BLOCK` rows attending to `kv_len` keys, and the head."""
    return forward_flops(config, params, BLOCK, kv_len)


def kv_bytes(config, kv_len: int, dtype) -> int:
    return (
        2
        * config.n_layers
        * kv_len
        * config.n_kv_heads
        * config.head_dim
        * jnp.dtype(dtype).itemsize
    )


def module_for(config, dtype, options: dict, seqs: list[int]):
    """The module with `options` resolved as the engine resolves them for one sequence:
    block forwards of `BLOCK` rows, refreshes of the longest of `seqs`."""
    kernels = programs.kernel_choice(
        KernelOptions(**options), config, dtype, Shapes(1, BLOCK, max(seqs), BLOCK)
    )
    return programs.local_module(config, dtype, kernels, None)


def _inputs(config, seq: int, dtype):
    x = jax.random.normal(jax.random.key(1), (1, seq, config.d_model), dtype)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    return x, positions


def refresh_program(module, config, seq: int) -> tuple:
    """A refresh's loop step and its first state: a whole-sequence forward of `seq` tokens
    with logits for the last block."""
    x, positions = _inputs(config, seq, module.dtype)
    valid = jnp.ones((1, seq), bool)

    def step(x, params):
        hidden, _ = module.apply(
            {"params": params}, x, positions, valid, None, Window(), seq - BLOCK, BLOCK
        )
        logits = module.apply({"params": params}, hidden, method="logits")
        return x + (1e-6 * jnp.mean(logits)).astype(x.dtype)

    return step, x


def random_kv(config, seq: int, dtype) -> tuple:
    """Random K/V buffers of one row, [1, seq, kv_heads, head_dim] per layer."""
    shape = (1, seq, config.n_kv_heads, config.head_dim)
    return tuple(
        (
            jax.random.normal(jax.random.key(i), shape, dtype),
            jax.random.normal(jax.random.key(i + 1), shape, dtype),
        )
        for i in range(config.n_layers)
    )


def block_program(module, config, kv_len: int) -> tuple:
    """A block forward's loop step and its first state: 32 tokens against a K/V buffer of
    `kv_len` positions, writing their K/V into it (the state: tokens' input and buffers)."""
    x, _ = _inputs(config, BLOCK, module.dtype)
    start = kv_len - 2 * BLOCK
    positions = (start + jnp.arange(BLOCK, dtype=jnp.int32))[None]
    valid = jnp.ones((1, kv_len), bool)

    def step(carry, params):
        x, kv = carry
        hidden, kv = module.apply(
            {"params": params}, x, positions, valid, kv, Window(start), 0, BLOCK, True
        )
        logits = module.apply({"params": params}, hidden, method="logits")
        return x + (1e-6 * jnp.mean(logits)).astype(x.dtype), kv

    return step, (x, random_kv(config, kv_len, module.dtype))


def timed(program, params, iters: int, profile: bool, donate: bool = False) -> dict:
    """`ms` of one step of `program` (`refresh_program` or `block_program`'s pair), and with
    `profile` its `profile` (`bench.profile.profile_in_program`, on a fresh state)."""
    step, state = program()
    row = {"ms": 1e3 * time_in_program(step, state, iters, params, donate=donate)}
    if profile:
        step, state = program()
        summary = profile_in_program(step, state, iters, params, donate=donate)
        keep = ("busy_us_per_step", "kernels_us_per_step", "last_step_kernels", "error")
        row["profile"] = {k: v for k, v in summary.items() if k in keep}
    return row


def ragged_dot_kernels(module, params, config) -> list[str]:
    """Which ops XLA emits for `ragged_dot` on this backend (from the optimized HLO of a
    `RAGGED_ROWS`-token refresh; `module` resolved for one)."""
    x, positions = _inputs(config, RAGGED_ROWS, module.dtype)
    valid = jnp.ones((1, RAGGED_ROWS), bool)
    fn = jax.jit(lambda p, x: module.apply({"params": p}, x, positions, valid)[0])
    text = fn.lower(params, x).compile().as_text()
    targets = {f"custom-call {t}" for t in re.findall(r'custom_call_target="([^"]+)"', text)}
    opcodes = {f"op {op}" for op in re.findall(r"= \S+ (ragged-dot|dot)\(", text)}
    fusions = {f"fusion kind {k}" for k in re.findall(r"kind=(k\w+)", text)}
    return sorted(targets | opcodes | fusions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[384, 1280])
    parser.add_argument("--kv-len", type=int, default=1280)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--attention-impls", nargs="+", default=["xla", "cudnn"])
    parser.add_argument("--moe-impls", nargs="+", default=["xla", "mosaic"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--routing", choices=ROUTINGS, default="model", help="see use_routing")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="each row also holds where its forward spends its device time, with its "
        "kernels in order (bench.profile.profile_in_program)",
    )
    args = parser.parse_args()
    use_routing(args.routing)
    dtype = jnp.bfloat16
    ceilings = measure_ceilings(args.tiny)
    print({k: f"{v:.3e}" for k, v in ceilings.items()})
    rows = []

    def add(row: dict) -> None:  # printed as it comes, its profile left to the file
        rows.append(row)
        print({k: v for k, v in row.items() if k != "profile"}, flush=True)

    for name in args.models:
        config = model_config(name, args.tiny)
        params = init_params(config, dtype, seed=0)
        w_bytes = weight_bytes(params)
        read_floor = 1e3 * w_bytes / ceilings["hbm_read_bytes_per_s"]
        variants = (
            [{"moe_impl": i} for i in args.moe_impls]
            if config.is_moe
            else [{"attention_impl": i} for i in args.attention_impls]
        )
        for options in variants:
            gpu_only = "cudnn" in options.values() or "mosaic" in options.values()
            if gpu_only and jax.default_backend() != "gpu":
                continue
            module = module_for(config, dtype, options, args.seqs)
            for seq in args.seqs:
                program = functools.partial(refresh_program, module, config, seq)
                timing = timed(program, params, args.iters, args.profile)
                flops = 1e3 * refresh_flops(config, params, seq) / ceilings["matmul_flops_per_s"]
                floor = max(flops, read_floor)
                bound = "flops / matmul rate" if flops >= read_floor else "weights / read rate"
                add(
                    {
                        "model": name,
                        "case": f"refresh {seq}",
                        **options,
                        "kernels": module.kernels.explain(),
                        **timing,
                        "floor_ms": floor,
                        "floor": bound,
                        "flops_floor_ms": flops,
                        "read_floor_ms": read_floor,
                        "roofline_pct": 100 * floor / timing["ms"],
                    }
                )
            program = functools.partial(block_program, module, config, args.kv_len)
            timing = timed(program, params, args.iters, args.profile, donate=True)
            ms = timing["ms"]
            floor = 1e3 * w_bytes / ceilings["hbm_bytes_per_s"]
            kv_ms = 1e3 * kv_bytes(config, args.kv_len, dtype) / ceilings["hbm_bytes_per_s"]
            add(
                {
                    "model": name,
                    "case": f"block {BLOCK} vs kv {args.kv_len}",
                    **options,
                    "kernels": module.kernels.explain(),
                    **timing,
                    "floor_ms": floor,
                    "floor": "weight bytes / bandwidth",
                    "kv_read_ms": kv_ms,
                    "roofline_pct": 100 * floor / ms,
                    "x_floor": ms / floor,
                    "read_floor_ms": read_floor,
                    "x_read_floor": ms / read_floor,
                }
            )
        extra = {}
        if config.is_moe:
            module = module_for(config, dtype, {"moe_impl": "xla"}, [RAGGED_ROWS])
            extra["ragged_dot_hlo_ops"] = ragged_dot_kernels(module, params, config)
        add({"model": name, "weight_bytes": w_bytes, **extra})
        del params
    suite = "forward_spread" if args.routing == "spread" else "forward"
    save(suite, {"ceilings": ceilings, "routing": args.routing, "results": rows})


if __name__ == "__main__":
    main()
