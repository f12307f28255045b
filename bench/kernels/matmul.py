"""A SwiGLU MLP's gate/up product and activation, XLA against djax's Pallas kernel
(`djax.kernels.swiglu`), at the row counts of a denoising block (32 per row of the batch).

`xla` is `GatedMLP`'s XLA path (`layers.swiglu_xla`: one fused gate/up matmul, then
`silu(gate) * up`); `pallas` is the kernel at its default tiles and at each tiling of the
sweep. Each is checked against fp32 (relative L2 error) and timed by its kernels' device
time in a profiler trace (µs per call, summed over its kernels: no loop or timer overhead).
`weight_TB_per_s` is weight bytes over that time (the weights dominate the bytes here).

    python -m bench.kernels.matmul [--model dense] [--rows 32 64] [--sweep-rows 32 384] [--tiny]

Sweeps at more than `BLOCK_ROWS` rows (a refresh) take `REFRESH_TILINGS` instead of `TILINGS`.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.kernels.timing import rel_error, time_row
from djax.kernels.swiglu import Tiles, swiglu_matmul
from djax.models.layers import swiglu_xla

# Around the configuration XLA's autotuner picked for this shape (64 columns, 64-wide steps,
# 5 stages) and wider ones.
TILINGS = tuple(
    Tiles(block_m=32, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    for bn, bk, warps, stages in [
        (32, 32, 4, 5),
        (32, 64, 2, 6),
        (64, 64, 4, 5),
        (64, 128, 4, 3),
        (64, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 64, 4, 4),
        (128, 64, 4, 5),
        (128, 64, 8, 4),
        (128, 128, 8, 3),
        (256, 64, 8, 3),
    ]
)
# Sweeps above this many rows (a refresh: hundreds of rows, compute-bound) take
# REFRESH_TILINGS: row tiles of 64-256, most with 8 warps so that two fp32 accumulators of
# block_m x block_n fit in registers.
BLOCK_ROWS = 64
REFRESH_TILINGS = tuple(
    Tiles(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages in [
        (64, 128, 64, 4, 4),
        (64, 128, 64, 8, 4),
        (64, 256, 64, 8, 3),
        (128, 64, 64, 8, 4),
        (128, 128, 32, 8, 4),
        (128, 128, 64, 8, 3),
        (256, 64, 64, 8, 3),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["dense"], default="dense")
    parser.add_argument("--rows", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--sweep-rows", nargs="*", type=int, default=[32])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config(args.model, args.tiny)
    k, n = cfg.d_model, cfg.mlp_hidden
    keys = jax.random.split(jax.random.key(0), 2)
    w = (jax.random.normal(keys[0], (k, 2, n)) * k**-0.5).astype(jnp.bfloat16)
    rows = []
    for m in sorted(set(args.rows) | set(args.sweep_rows)):
        x = jax.random.normal(keys[1], (m, k), jnp.bfloat16)
        reference = swiglu_xla(x.astype(jnp.float32), w.astype(jnp.float32))
        runs = [("xla", swiglu_xla), ("pallas", swiglu_matmul)]
        if m in args.sweep_rows:
            runs += [
                (
                    f"pallas {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}",
                    functools.partial(swiglu_matmul, tiles=t),
                )
                for t in (TILINGS if m <= BLOCK_ROWS else REFRESH_TILINGS)
            ]
        for label, run in runs:
            row = {"rows": m, "k": k, "n": n, "impl": label}
            try:
                row["rel_error"] = rel_error(jax.jit(run)(x, w), reference)
                time_row(row, jax.jit(run), (x, w), args.calls, w.nbytes)
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print(row, flush=True)
            rows.append(row)
    save("matmul", {"model": args.model, "results": rows})


if __name__ == "__main__":
    main()
