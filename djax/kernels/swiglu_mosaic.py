"""The SwiGLU gate/up product for few rows with its activation fused, as a Pallas Mosaic GPU
kernel (Hopper: TMA copies, WGMMA), for block forwards (`mlp_impl="mosaic"`).

Each CTA owns one row tile of 64 and `block_n` columns of the output. Its ring
(`tma_ring`) holds per slot the step's x tile and the gate and up weight tiles of its
columns side by side, multiplied by WGMMA into two fp32 accumulators; the CTA writes
`silu(gate) * up` in x's dtype. Given `ScaledRows` (rows already multiplied by the norm's
scale, `handoff.ScaledRows`) it applies the RMSNorm after the product: the rows' per-tile
sums of squares come in by TMA at the CTA's start and scale each accumulator row by
`1 / rms`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tma_ring
from djax.kernels.handoff import ScaledRows
from djax.kernels.tma_ring import ROW_TILE, Tiles

Array = jax.Array

# The most tiles of sums of squares a `ScaledRows` input may carry (one TMA copy's rows).
MAX_TILES = 256


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """128 columns of each side (64 where 128 do not divide n) in 64-wide steps, 3 stages:
    96 CTAs at LLaDA-8B's MLP (4096 -> 2 x 12288), the fastest tiling of
    `bench.kernels.mosaic --sweep` there."""
    block_n = 128 if n % 128 == 0 else tma_ring.TILE
    return Tiles(block_n=block_n, block_k=tma_ring.TILE, splits=1, stages=3)


def silu_times(gate: Array, up: Array) -> Array:
    """`silu(gate) * up` in fp32, written with the ops Mosaic GPU lowers."""
    return gate / (1.0 + jnp.exp(-gate)) * up


def _inv_rms(squares_smem, barrier, width: int, eps: float, interpreting: bool) -> Array:
    """Inside a kernel: `1 / rms` [64] fp32 of the row tile's rows, in the layout of an
    accumulator's rows, from their per-tile sums of squares `squares_smem` [tiles, 64] over
    `width` columns (copied in with `barrier`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.barrier_wait(barrier)

    def add(tile, total):
        return total + tma_ring.accumulator_rows(squares_smem[tile], interpreting)

    # A loop, not one add per tile written out: Mosaic GPU's layout inference, run while
    # lowering, grows with the kernel's written-out code (128 tiles at LLaDA-8B's width).
    total = tma_ring.accumulator_rows(squares_smem[0], interpreting)
    total = jax.lax.fori_loop(1, squares_smem.shape[0], add, total)
    return jax.lax.rsqrt(total / width + eps)


def _kernel(x_gmem, w_gmem, *refs, tiles, steps, m, n, column_tiles, eps, interpreting):
    """One CTA: one (row tile, column tile) of x [m8, k] and w [k, 2n] (gate columns, then
    up columns), with `eps` the squares [tiles, m8] of `ScaledRows`, into out [m, n];
    `interpreting` in Mosaic GPU's interpreter."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if eps is None:
        squares_gmem, (out_gmem, *ring, out_smem) = None, refs
    else:
        squares_gmem, out_gmem, *ring, out_smem, squares_smem, squares_bar = refs
    cta = jax.lax.axis_index("cta")
    row_tile, column_tile = cta // column_tiles, cta % column_tiles
    start = column_tile * tiles.block_n
    cols = pl.ds(start, tiles.block_n)
    rows = pl.ds(row_tile * ROW_TILE, ROW_TILE)
    if squares_gmem is not None:  # in flight while the weights stream
        plgpu.copy_gmem_to_smem(squares_gmem.at[:, rows], squares_smem, squares_bar.at[0])

    def finish(gate, up):
        if squares_gmem is not None:
            width = x_gmem.shape[1]
            inv_rms = _inv_rms(squares_smem, squares_bar.at[0], width, eps, interpreting)
            inv_rms = jax.lax.broadcast_in_dim(inv_rms, gate.shape, [0])
            gate, up = gate * inv_rms, up * inv_rms
        out_smem[...] = silu_times(gate, up).astype(out_smem.dtype)

    tma_ring.stream(
        x_gmem,
        [
            lambda ks: w_gmem.at[ks, pl.ds(start, tiles.block_n)],
            lambda ks: w_gmem.at[ks, pl.ds(n + start, tiles.block_n)],
        ],
        ring,
        tiles,
        0,
        steps,
        rows,
        finish,
    )
    tma_ring.store_rows(out_smem, lambda rows: out_gmem.at[rows, cols], row_tile, m)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def swiglu_matmul(
    x: Array | ScaledRows, w: Array, tiles: Tiles | None = None, interpret: bool | None = None
) -> Array:
    """`silu(x @ w[:, 0]) * (x @ w[:, 1])` in one Mosaic GPU kernel.

    x: [m, k], or `ScaledRows` [m, k] whose RMSNorm the kernel applies to the product's rows
    (at most 256 tiles of sums of squares, [tiles, 64] fp32 of shared memory beside the
    ring); w: [k, 2, n] (gate and up), both bf16 or both fp16, k and n multiples of 64.
    Returns [m, n] in x's dtype, accumulated in fp32. Row counts that are not multiples of 8
    are padded with zero rows for the kernel (an extra copy of x and of the squares).
    `tiles`: the program shape (default `tiles_for`; `splits` must be 1); `interpret`: run
    in Mosaic GPU's interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    squares, eps = (x.squares, x.eps) if isinstance(x, ScaledRows) else (None, None)
    x = x.scaled if isinstance(x, ScaledRows) else x
    if squares is not None and (
        squares.shape[1:] != x.shape[:1] or not 1 <= squares.shape[0] <= MAX_TILES
    ):
        raise ValueError(
            f"swiglu_mosaic.swiglu_matmul: squares {squares.shape}, rows {x.shape}; expected "
            f"[tiles, {x.shape[0]}] with 1 <= tiles <= {MAX_TILES}"
        )
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(
            f"swiglu_mosaic.swiglu_matmul: x {x.shape}, w {w.shape}; expected x [m, k] and "
            "w [k, 2, n]"
        )
    m, k = x.shape
    n = w.shape[-1]
    if w.shape[:2] != (k, 2) or not tma_ring.fits(k, n):
        raise ValueError(
            f"swiglu_mosaic.swiglu_matmul: x {x.shape}, w {w.shape}; expected w [{k}, 2, n] "
            f"with {k} and n multiples of 64"
        )
    tma_ring.check_operands("swiglu_mosaic.swiglu_matmul", x, w)
    tiles = tiles or tiles_for(m, k, n)
    if tiles.splits != 1:
        raise ValueError(f"{tiles}: the SwiGLU product takes splits=1")
    squares_bytes = 0 if squares is None else squares.shape[0] * ROW_TILE * 4
    tiles.check(k, n, weights=2, out_bytes=x.dtype.itemsize, extra=squares_bytes)
    column_tiles = n // tiles.block_n
    inputs = [tma_ring.aligned_rows(x), w.reshape(k, 2 * n)]
    scratch = [
        *tma_ring.ring_scratch(tiles, x.dtype, weights=2),
        plgpu.SMEM((ROW_TILE, tiles.block_n), x.dtype),
    ]
    if squares is not None:
        missing = -m % tma_ring.ROW_ALIGN
        inputs.append(jnp.pad(squares, ((0, 0), (0, missing))) if missing else squares)
        scratch += [
            plgpu.SMEM((squares.shape[0], ROW_TILE), jnp.float32),
            plgpu.Barrier(num_barriers=1),
        ]
    params = tma_ring.interpret_params(interpret)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            steps=k // tiles.block_k,
            m=m,
            n=n,
            column_tiles=column_tiles,
            eps=eps,
            interpreting=params is not None,
        ),
        out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, ROW_TILE) * column_tiles,),
        grid_names=("cta",),
        scratch_types=scratch,
        interpret=params,
    )
    return kernel(*inputs)
