"""The split-K product for few rows as a Pallas Mosaic GPU kernel (Hopper: TMA copies,
WGMMA), for block forwards' q/k/v, output and down products (`matmul_impl="mosaic"`).

Each CTA owns one row tile of 64, one column tile and one of `splits` slices of the
contraction, streams its x and weight tiles through a ring of shared-memory slots
(`tma_ring`) and writes its slice's fp32 partial product; the slices' sum is left to the
kernel that consumes them (`handoff.Partials`: `residual_norm_mosaic`,
`rope_write_mosaic.rope_and_write` and `Partials.total()` take them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tma_ring
from djax.kernels.handoff import Partials
from djax.kernels.tma_ring import ROW_TILE, Tiles

Array = jax.Array

# The fewest CTAs `tiles_for` aims at: one wave on a GPU of ~132 SMs.
MIN_CTAS = 96


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """128-column tiles in 64-wide steps (4 stages) where they alone give `MIN_CTAS`
    column tiles; else 64-column tiles in up to 128-wide steps (4 stages), the contraction
    cut into the fewest slices (up to 8, of at least 2 steps) that reach `MIN_CTAS`. At
    LLaDA-8B's block products: q/k/v (4096 -> 12288) 96 tiles unsplit, the attention
    output (4096 -> 4096) and down (12288 -> 4096) products 64 tiles x 2 slices (among
    the fastest tilings of `bench.kernels.mosaic --sweep`)."""
    if n % 128 == 0 and n // 128 >= MIN_CTAS:
        return Tiles(block_n=128, block_k=tma_ring.largest_block(k, 64), splits=1, stages=4)
    block_n = tma_ring.TILE
    block_k = tma_ring.largest_block(k, 128)
    splits = 1
    while (
        (n // block_n) * splits < MIN_CTAS
        and k % (splits * 2 * block_k) == 0
        and k // (splits * 2 * block_k) >= 2
        and splits < 8
    ):
        splits *= 2
    return Tiles(block_n=block_n, block_k=block_k, splits=splits, stages=4)


def _kernel(x_gmem, w_gmem, out_gmem, *ring_and_out, tiles, steps, m, column_tiles):
    """One CTA: one (row tile, column tile, slice) of x [m8, k] @ w [k, n] into out
    [splits, m, n] fp32."""
    *ring, out_smem = ring_and_out
    cta = jax.lax.axis_index("cta")
    per_row_tile = column_tiles * tiles.splits
    row_tile, rest = cta // per_row_tile, cta % per_row_tile
    split, column_tile = rest // column_tiles, rest % column_tiles
    cols = pl.ds(column_tile * tiles.block_n, tiles.block_n)

    def finish(product):
        out_smem[...] = product

    tma_ring.stream(
        x_gmem,
        [lambda ks: w_gmem.at[ks, cols]],
        ring,
        tiles,
        split * steps,
        steps,
        pl.ds(row_tile * ROW_TILE, ROW_TILE),
        finish,
    )
    tma_ring.store_rows(out_smem, lambda rows: out_gmem.at[split, rows, cols], row_tile, m)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def matmul_partials(
    x: Array, w: Array, tiles: Tiles | None = None, interpret: bool | None = None
) -> Partials:
    """`x @ w` as `tiles.splits` fp32 partial products, in Mosaic GPU.

    x: [..., k]; w: [k, n], both bf16 or both fp16, k and n multiples of 64. Returns
    `Partials` with parts [splits, ..., n] and x's dtype.
    Row counts that are not multiples of 8 are padded with zero rows for the kernel (an
    extra copy of x). `tiles`: the program shape (default `tiles_for`); `interpret`: run in
    Mosaic GPU's interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k, n = w.shape
    if x.shape[-1] != k or not tma_ring.fits(k, n):
        raise ValueError(
            f"split_k_mosaic.matmul_partials: x {x.shape}, w {w.shape}; expected x [..., {k}] "
            "and k, n multiples of 64"
        )
    tma_ring.check_operands("split_k_mosaic.matmul_partials", x, w)
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    tiles = tiles or tiles_for(m, k, n)
    tiles.check(k, n, weights=1, out_bytes=4)
    column_tiles = n // tiles.block_n
    row_tiles = pl.cdiv(m, ROW_TILE)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            steps=k // (tiles.splits * tiles.block_k),
            m=m,
            column_tiles=column_tiles,
        ),
        out_type=jax.ShapeDtypeStruct((tiles.splits, m, n), jnp.float32),
        grid=(row_tiles * tiles.splits * column_tiles,),
        grid_names=("cta",),
        scratch_types=[
            *tma_ring.ring_scratch(tiles, x.dtype, weights=1),
            plgpu.SMEM((ROW_TILE, tiles.block_n), jnp.float32),
        ],
        interpret=tma_ring.interpret_params(interpret),
    )
    parts = kernel(tma_ring.aligned_rows(rows), w)
    return Partials(parts.reshape((tiles.splits, *x.shape[:-1], n)), x.dtype)
