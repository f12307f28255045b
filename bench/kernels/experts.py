"""The routed-expert computation of one LLaDA-MoE layer (64 experts, top-8, model 2048,
expert ffn 1024) per expert path, at block (32 tokens) and refresh (384, 1280) sizes.

Paths: `dense` (every expert on every token), `grouped` (`jax.lax.ragged_dot`, also under
XLA's experimental ragged-dot options), `hopper` (JAX's Mosaic GPU ragged-dot kernel, at a
few tile shapes; GPU only) and `mosaic` (djax's expert-tile kernels, `expert_tiles_mosaic`,
at the tiles of `MOSAIC_TILES`; interpreted off GPUs). Each is checked against `dense` in fp32
(relative L2 error) and timed in-program; the floor is the bytes of the experts the tokens
hit, read once, at the measured read bandwidth, or the routed FLOPs at the matmul rate.

`--sweep` replaces the first three paths by the Hopper kernel at a wider set of tiles
(`SWEEP`).
`--mosaic` compares the expert-tile kernels (`expert_tiles_mosaic`, at `MOSAIC_TILES`) with
bf16 and with fp8 weights (`djax.models.fp8`, quantised from the bf16 ones; `fp8
converted`: e4m3 tiles converted to bf16 in the kernel, `moe="mosaic"`) and the fp8 x fp8
products on the same weights held K-major (`fp8 x fp8 k-major`, at `FP8_MOSAIC_TILES`:
`moe="fp8_mosaic"`, `fp8_impl="mosaic"`'s) against XLA's paths in both weight forms (the
engine's: `grouped` and `dense`, fp8 as `scaled` and `dequant`); the floor of an fp8 path
counts the e4m3 values' bytes.
`--routing spread` routes as `bench.generate --routing spread` does (`spread_routing`: a
block's tokens reach every expert, as a trained router spreads them).
`--permutation` times only the sort of the token-expert pairs by expert (device µs of each
kernel from a profiler trace): XLA's sort (`argsort`, and again to invert it), the engine's
running count (`group_layout` at `align=1`, no sort), and a pairwise compare-and-sum.

    python -m bench.kernels.experts [--tokens 32 384 1280] [--sweep | --permutation | --mosaic]
        [--routing model|spread] [--tiny]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    ROUTINGS,
    measure_ceilings,
    model_config,
    save,
    spread_routing,
    time_in_program,
)
from bench.kernels.timing import kernel_us
from djax.kernels.tma_ring import ROW_ALIGN, Tiles
from djax.models import fp8
from djax.models.llada_moe import (
    experts_dense,
    experts_grouped,
    fp8_mosaic_mlp,
    group_layout,
    mosaic_mlp,
    ragged_mlp,
    route,
)

HOPPER_TILES = (
    {"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
    {"block_m": 64, "block_n": 256, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
    {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
    {"block_m": 128, "block_n": 256, "block_k": 64, "max_concurrent_steps": 3, "grid_block_n": 2},
)
# --sweep: 64-row tiles (a block's 256 token-expert pairs fill few 128-row ones) at every
# column width, contraction step, pipeline depth and column-tile grouping below.
SWEEP = tuple(
    {"block_m": 64, "block_n": n, "block_k": k, "max_concurrent_steps": steps, "grid_block_n": g}
    for n in (128, 256)
    for k in (64, 128)
    for steps in (2, 4, 6)
    for g in (1, 2)
)
# djax's expert-tile kernels (`expert_tiles_mosaic`): (gate/up, down) tiles; None is `tiles_for`
# (128 columns, 64-wide steps, 4 stages, row tiles of `row_tile_for`: 32 rows at a block's
# 32 tokens, 64 at a refresh's), for fp8 weights `converted_tiles_for` (2 stages at 32 rows).
# `r64` reads x 64 rows at a time whatever the experts' rows, `r16` 16 (an expert of more
# rows is read in several tiles); two stages leave room for two CTAs per SM; 64-column
# gate/up tiles make twice the CTAs.
MOSAIC_TILES = (
    None,
    (Tiles(block_n=128, stages=4), Tiles(block_n=128, stages=4)),
    (Tiles(block_n=128, stages=2, rows=16), Tiles(block_n=128, stages=2, rows=16)),
    (Tiles(block_n=128, stages=6, rows=16), Tiles(block_n=128, stages=6, rows=16)),
    (Tiles(block_n=64, stages=4, rows=16), Tiles(block_n=128, stages=4, rows=16)),
    (Tiles(block_n=128, stages=4, rows=32), Tiles(block_n=128, stages=4, rows=32)),
    (Tiles(block_n=128, stages=2, rows=32), Tiles(block_n=128, stages=2, rows=32)),
    (
        Tiles(block_n=128, block_k=128, stages=2, rows=16),
        Tiles(block_n=128, block_k=128, stages=3, rows=16),
    ),
)
# The fp8 x fp8 expert products (`fp8_mosaic_mlp`): None is `fp8_tiles_for` (128-wide steps,
# 4 stages); 256-wide steps in 2 stages halve the steps.
FP8_MOSAIC_TILES = (
    None,
    (
        Tiles(block_n=128, block_k=128, stages=2, rows=32),
        Tiles(block_n=128, block_k=128, stages=2, rows=32),
    ),
    (
        Tiles(block_n=128, block_k=256, stages=2, rows=32),
        Tiles(block_n=128, block_k=256, stages=2, rows=32),
    ),
    (
        Tiles(block_n=128, block_k=256, stages=2, rows=16),
        Tiles(block_n=128, block_k=256, stages=2, rows=16),
    ),
)
XLA_RAGGED_OPTIONS = {
    "default": {},
    "ragged_dot_fusion": {"xla_gpu_experimental_use_ragged_dot_fusion": True},
    "ragged_dot_grouped_gemm": {"xla_gpu_experimental_use_ragged_dot_grouped_gemm": True},
}


def hopper_mlp(tiles: dict):
    """The experts' SwiGLU MLP of `ragged_mlp` with JAX's Mosaic GPU ragged-dot kernel in
    place of `jax.lax.ragged_dot`, at `tiles`."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    def mlp(x, source_rows, gate_up, down, group_sizes):
        n_local, d_model, _, ffn = gate_up.shape
        dot = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=group_sizes, **tiles)
        h = dot(x[source_rows], gate_up.reshape(n_local, d_model, 2 * ffn))
        return dot(jax.nn.silu(h[:, :ffn]) * h[:, ffn:], down)

    return mlp


def paths(sweep: bool = False) -> list[tuple[str, object, dict]]:
    out = [] if sweep else [("dense", experts_dense, {})]
    if not sweep:
        out += [(f"grouped {k}", experts_grouped, v) for k, v in XLA_RAGGED_OPTIONS.items()]
    if jax.default_backend() == "gpu":
        for tiles in SWEEP if sweep else HOPPER_TILES:
            label = "hopper " + " ".join(f"{k}={v}" for k, v in tiles.items())
            run = functools.partial(experts_grouped, mlp=hopper_mlp(tiles))
            out.append((label, run, {}))
    for tiles in MOSAIC_TILES:
        label = "mosaic " + ("tiles_for" if tiles is None else _mosaic_label(tiles))
        mlp = functools.partial(mosaic_mlp, tiles=tiles)
        out.append((label, functools.partial(experts_grouped, mlp=mlp, align=ROW_ALIGN), {}))
    return out


def mosaic_paths() -> list[tuple[str, object, dict, str]]:
    """`--mosaic`'s paths as (label, run, compile options, weights: `bf16`, `fp8` or
    `fp8_k_major`)."""
    out = [
        ("grouped (xla) bf16", experts_grouped, {}, "bf16"),
        ("dense (xla) bf16", experts_dense, {}, "bf16"),
    ]
    for impl in ("scaled", "dequant"):
        grouped = functools.partial(
            experts_grouped, mlp=functools.partial(ragged_mlp, fp8_impl=impl)
        )
        out.append((f"grouped (xla) fp8 {impl}", grouped, {}, "fp8"))
        out.append(
            (f"dense (xla) fp8 {impl}", functools.partial(experts_dense, fp8_impl=impl), {}, "fp8")
        )
    for weights in ("bf16", "fp8"):
        for tiles in MOSAIC_TILES:
            default = "converted_tiles_for" if weights == "fp8" else "tiles_for"
            label = default if tiles is None else _mosaic_label(tiles)
            mlp = functools.partial(mosaic_mlp, tiles=tiles)
            run = functools.partial(experts_grouped, mlp=mlp, align=ROW_ALIGN)
            form = "fp8 converted" if weights == "fp8" else weights
            out.append((f"mosaic {form} {label}", run, {}, weights))
    for tiles in FP8_MOSAIC_TILES:
        label = "fp8_tiles_for" if tiles is None else _mosaic_label(tiles)
        mlp = functools.partial(fp8_mosaic_mlp, tiles=tiles)
        run = functools.partial(experts_grouped, mlp=mlp, align=ROW_ALIGN)
        out.append((f"mosaic fp8 x fp8 k-major {label}", run, {}, "fp8_k_major"))
    return out


def _mosaic_label(tiles) -> str:
    return " / ".join(f"n{t.block_n} k{t.block_k} s{t.stages} r{t.rows}" for t in tiles)


def sort_by_layout(group, n_groups: int):
    """The engine's way: `group_layout` at `align=1` as (order, rank, sizes)."""
    rank, order, sizes = group_layout(group, n_groups)
    return order, rank, sizes


def sort_by_xla(group, n_groups: int):
    """(order, rank, sizes) of a stable sort by group from XLA's sort and its inverse."""
    order = jnp.argsort(group, stable=True)
    sizes = jnp.sum(group[:, None] == jnp.arange(n_groups), axis=0, dtype=jnp.int32)
    return order, jnp.argsort(order), sizes


def sort_by_pairs(group, n_groups: int):
    """(order, rank, sizes) from a compare-and-sum over every pair of items (p² work)."""
    index = jnp.arange(group.shape[0])
    earlier = (group[None, :] < group[:, None]) | (
        (group[None, :] == group[:, None]) & (index[None, :] < index[:, None])
    )
    rank = jnp.sum(earlier, axis=1, dtype=jnp.int32)
    order = jnp.zeros_like(rank).at[rank].set(index, unique_indices=True)
    sizes = jnp.sum(group[:, None] == jnp.arange(n_groups), axis=0, dtype=jnp.int32)
    return order, rank, sizes


def permutation_rows(tokens: list[int], n_experts: int, top_k: int, calls: int) -> list[dict]:
    """Device µs of each way to sort `tokens × top_k` random pairs by expert; every way's
    results must equal the engine's."""
    rows = []
    for n in tokens:
        group = jax.random.randint(jax.random.key(n), (n * top_k,), 0, n_experts, jnp.int32)
        expected = None
        for label, sort in (
            ("xla sort", sort_by_xla),
            ("running count (engine)", sort_by_layout),
            ("pairwise", sort_by_pairs),
        ):
            fn = jax.jit(sort, static_argnums=1)
            out = fn(group, n_experts)
            expected = expected or out
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(out, expected, strict=True))
            kernels = kernel_us(fn, (group, n_experts), calls)
            row = {"tokens": n, "pairs": n * top_k, "path": label, "equal": same}
            row |= {"us": sum(kernels.values()), "kernels_us": kernels}
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[32, 384, 1280])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="the Hopper kernel at SWEEP tiles")
    parser.add_argument("--permutation", action="store_true", help="only the sort by expert")
    parser.add_argument(
        "--mosaic",
        action="store_true",
        help="the Mosaic GPU expert tiles vs XLA, bf16, fp8 converted and fp8 x fp8",
    )
    parser.add_argument("--routing", choices=ROUTINGS, default="model")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config("moe", args.tiny)
    e, m, f, k = cfg.n_experts, cfg.d_model, cfg.expert_hidden, cfg.experts_per_token
    if args.permutation:
        rows = permutation_rows(args.tokens, e, k, args.iters)
        save("experts", {"permutation": True, "shape": [e, m, f, k], "results": rows})
        return
    route_fn = spread_routing(route) if args.routing == "spread" else route
    ceilings = measure_ceilings(args.tiny)
    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = (jax.random.normal(keys[0], (e, m, 2, f)) / np.sqrt(m)).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[1], (e, f, m)) / np.sqrt(f)).astype(jnp.bfloat16)
    experts_by_form = {"bf16": (gate_up, down)}
    if args.mosaic:
        params = fp8.quantize_params({"gate_up": gate_up, "down": down})
        moved = fp8.to_layout(params, True)  # as `fp8_impl="mosaic"` holds them
        experts_by_form["fp8"] = tuple(
            fp8.Fp8Weight(params[name], params[f"{name}_scale"]) for name in ("gate_up", "down")
        )
        experts_by_form["fp8_k_major"] = tuple(
            fp8.Fp8Weight(moved[name], moved[f"{name}_scale"], True, leading=1)
            for name in ("gate_up", "down")
        )
    router = jax.random.normal(keys[2], (m, e), jnp.bfloat16)
    rows = []
    for n in args.tokens:
        x = jax.random.normal(keys[3], (n, m), jnp.bfloat16)
        weights, experts = jax.jit(route_fn, static_argnums=(3, 4))(x, router, None, k, False)
        hit = int(jnp.unique(experts).size)
        flops = 2 * n * k * 3 * m * f
        floors = {}
        for form, item in (("bf16", 2), ("fp8", 1), ("fp8_k_major", 1)):
            floor_bytes = hit * item * (gate_up[0].size + down[0].size)
            floors[form] = max(
                floor_bytes / ceilings["hbm_read_bytes_per_s"],
                flops / ceilings["matmul_flops_per_s"],
            )
        reference = experts_dense(
            x.astype(jnp.float32),
            weights,
            experts,
            gate_up.astype(jnp.float32),
            down.astype(jnp.float32),
            0,
        )
        runs = mosaic_paths() if args.mosaic else [(*path, "bf16") for path in paths(args.sweep)]
        for label, run, options, form in runs:
            floor_s = floors[form]
            gate_up_w, down_w = experts_by_form[form]
            row = {"tokens": n, "path": label, "experts_hit": hit, "floor_ms": 1e3 * floor_s}
            try:
                compiled = jax.jit(run).lower(x, weights, experts, gate_up_w, down_w, 0)
                y = compiled.compile(options)(x, weights, experts, gate_up_w, down_w, 0)
                err = jnp.linalg.norm(y.astype(jnp.float32) - reference)
                row["rel_error"] = float(err / jnp.linalg.norm(reference))

                def step(x, weights, experts, gate_up, down, run=run):
                    y = run(x, weights, experts, gate_up, down, 0)
                    return x + (1e-3 * y).astype(x.dtype)

                seconds = time_in_program(
                    step, x, args.iters, weights, experts, gate_up_w, down_w, options=options
                )
                row["ms"] = 1e3 * seconds
                row["x_floor"] = seconds / floor_s
            except Exception as err:  # keep the other paths of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print(row, flush=True)
            rows.append(row)
    name = "experts_mosaic" if args.mosaic else "experts"
    payload = {"ceilings": ceilings, "shape": [e, m, f, k], "routing": args.routing}
    save(name, payload | {"results": rows}, None if args.routing == "model" else args.routing)


if __name__ == "__main__":
    main()
