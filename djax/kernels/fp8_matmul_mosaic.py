"""The product of few rows and an fp8 weight as a Pallas Mosaic GPU kernel (Hopper: TMA
copies, fp8 x fp8 WGMMA): rows quantised to e4m3 with a scale per row, weights e4m3 with a
scale per output column, both scales applied to the fp32 product.

The weight is read transposed, `w_t` [n, k] (the contraction contiguous): Hopper's WGMMA
takes 8-bit operands only K-major, so both e4m3 tiles go from the ring of shared-memory
slots (`tma_ring`, its K-major form: x tiles [64, block_k], weight tiles
[block_n, block_k], every slot swizzled at 128 bytes = 128 e4m3 values) into the tensor
cores as they are, with no conversion in the kernel. Each CTA owns one row tile of 64, one
column tile and one of `splits` slices of the contraction, and writes its slice's product
times `x_scale` (per row) and `w_scale` (per column) as an fp32 partial (`handoff.Partials`,
as `split_k_mosaic` leaves them; the slices' sum is the product).

Rules: k a multiple of 128 (`block_k` is), n a multiple of 64, `block_n` at most 256
(WGMMA's widest N). Rows are quantised by `quantize_rows`, the rule of
`djax.models.fp8.quantize` over the row (the `scaled` product's). Mosaic GPU's interpreter
has no transposed WGMMA operand: there each step's weight tile is first copied, transposed,
into a scratch tile of its own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import split_k_mosaic, tma_ring
from djax.kernels.handoff import Partials
from djax.kernels.tma_ring import ROW_TILE, Tiles
from djax.models.fp8 import FP8, quantize

Array = jax.Array

K_TILE = tma_ring.SWIZZLE  # e4m3 values in a swizzled row: block_k is a multiple of this
MAX_BLOCK_N = 256  # WGMMA's widest N


def quantize_rows(x: Array) -> tuple[Array, Array]:
    """x [..., k] -> (e4m3 values [..., k], fp32 scale [...]): each row over its k values
    as `djax.models.fp8.quantize` (scale = the row's max |x| / 448, 1 for a zero row)."""
    return quantize(x, (x.ndim - 1,))


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """`split_k_mosaic.tiles_for`'s tiles (its column tiles, slices and stages) with block_k
    doubled, the same bytes a step at one byte a value (128 where the doubled step does not
    divide a slice)."""
    base = split_k_mosaic.tiles_for(m, k, n)
    block_k = 2 * base.block_k
    if block_k % K_TILE or k % (base.splits * block_k):
        block_k = K_TILE
    return dataclasses.replace(base, block_k=block_k)


def check_tiles(tiles: Tiles, k: int, n: int) -> None:
    """Raise a ValueError naming `tiles` unless they take a `k -> n` fp8 product: the ring's
    rules at one byte a value (`Tiles.check`), the fp32 output tile and scales in shared
    memory, and block_n at most `MAX_BLOCK_N`."""
    if tiles.block_n > MAX_BLOCK_N:
        raise ValueError(f"{tiles}: block_n must be at most {MAX_BLOCK_N} (WGMMA's widest N)")
    scales = (ROW_TILE + tiles.block_n) * 4
    tiles.check(k, n, weights=1, out_bytes=4, extra=scales, itemsize=1)


def _multiply(untransposed=None):
    """A step's product into an accumulator ref: fp8 x fp8 WGMMA of an x slot [64, block_k]
    and a weight slot [block_n, block_k] read transposed. Mosaic GPU's interpreter has no
    transposed WGMMA operand: given `untransposed`, a [block_k, block_n] scratch ref, the
    slot's tile is copied into it transposed and multiplied from there."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def multiply(acc, x_slot, w_slot):
        if untransposed is None:
            plgpu.wgmma(acc, x_slot, plgpu.transpose_ref(w_slot, (1, 0)))
            return
        untransposed[...] = w_slot[...].T
        plgpu.wgmma(acc, x_slot, untransposed)

    return multiply


def _kernel(
    x_gmem,
    w_gmem,
    x_scale_gmem,
    w_scale_gmem,
    out_gmem,
    *refs,
    tiles,
    steps,
    m,
    column_tiles,
    interpreting,
):
    """One CTA: one (row tile, column tile, slice) of xq [m8, k] @ w_t [n, k]^T, scaled by
    x_scale [1, m8] per row and w_scale [1, n] per column, into out [splits, m, n] fp32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpreting:
        *refs, untransposed = refs
    *ring, out_smem, x_scale_smem, w_scale_smem, scale_bars = refs
    cta = jax.lax.axis_index("cta")
    per_row_tile = column_tiles * tiles.splits
    row_tile, rest = cta // per_row_tile, cta % per_row_tile
    split, column_tile = rest // column_tiles, rest % column_tiles
    cols = pl.ds(column_tile * tiles.block_n, tiles.block_n)
    rows = pl.ds(row_tile * ROW_TILE, ROW_TILE)
    # in flight while the tiles stream; rows past x's end read as zeros
    plgpu.copy_gmem_to_smem(x_scale_gmem.at[:, rows], x_scale_smem, scale_bars.at[0])
    plgpu.copy_gmem_to_smem(w_scale_gmem.at[:, cols], w_scale_smem, scale_bars.at[1])

    def finish(product):
        plgpu.barrier_wait(scale_bars.at[0])
        plgpu.barrier_wait(scale_bars.at[1])
        row_scale = tma_ring.accumulator_rows(x_scale_smem[0], interpreting)
        column_scale = tma_ring.accumulator_columns(w_scale_smem[0], interpreting)
        product = product * jax.lax.broadcast_in_dim(row_scale, product.shape, [0])
        out_smem[...] = product * jax.lax.broadcast_in_dim(column_scale, product.shape, [1])

    tma_ring.stream(
        x_gmem,
        [lambda ks: w_gmem.at[cols, ks]],
        ring,
        tiles,
        split * steps,
        steps,
        rows,
        finish,
        multiply=_multiply(untransposed if interpreting else None),
    )
    tma_ring.store_rows(out_smem, lambda rows: out_gmem.at[split, rows, cols], row_tile, m)


@functools.partial(jax.jit, static_argnames=("tiles", "dtype", "interpret"))
def matmul_partials(
    xq: Array,
    x_scale: Array,
    w_t: Array,
    w_scale: Array,
    tiles: Tiles | None = None,
    dtype=jnp.bfloat16,
    interpret: bool | None = None,
) -> Partials:
    """`(xq * x_scale) @ (w_t * w_scale)^T` as `tiles.splits` fp32 partial products, by
    fp8 x fp8 WGMMA in Mosaic GPU.

    xq: [..., k] e4m3 rows, x_scale [...] fp32 (`quantize_rows`); w_t: [n, k] e4m3 (an
    `Fp8Weight`'s values transposed), w_scale [n] fp32; k a multiple of 128, n of 64.
    Returns `Partials` with parts [splits, ..., n] fp32 and `dtype` (the product's dtype
    once summed). Row counts that are not multiples of 8 are padded with zero rows for the
    kernel (an extra copy of xq and x_scale). `tiles`: the program shape (default
    `tiles_for`, checked by `check_tiles`); `interpret`: run in Mosaic GPU's interpreter
    (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "fp8_matmul_mosaic.matmul_partials"
    if xq.dtype != FP8 or w_t.dtype != FP8:
        raise ValueError(f"{name}: xq {xq.dtype}, w_t {w_t.dtype}; expected both float8_e4m3fn")
    if x_scale.dtype != jnp.float32 or w_scale.dtype != jnp.float32:
        raise ValueError(
            f"{name}: x_scale {x_scale.dtype}, w_scale {w_scale.dtype}; expected both float32"
        )
    if w_t.ndim != 2 or xq.ndim < 1 or xq.shape[-1] != w_t.shape[1]:
        raise ValueError(
            f"{name}: xq {xq.shape}, w_t {w_t.shape}; expected xq [..., k] and w_t [n, k]"
        )
    n, k = w_t.shape
    if k % K_TILE or n % tma_ring.TILE:
        raise ValueError(
            f"{name}: w_t {w_t.shape}; expected k a multiple of {K_TILE} and n of {tma_ring.TILE}"
        )
    if x_scale.shape != xq.shape[:-1] or w_scale.shape != (n,):
        raise ValueError(
            f"{name}: x_scale {x_scale.shape}, w_scale {w_scale.shape}; expected "
            f"{xq.shape[:-1]} and ({n},)"
        )
    rows = xq.reshape(-1, k)
    m = rows.shape[0]
    tiles = tiles or tiles_for(m, k, n)
    check_tiles(tiles, k, n)
    column_tiles = n // tiles.block_n
    row_scale = tma_ring.aligned_rows(x_scale.reshape(m, 1)).reshape(1, -1)
    params = tma_ring.interpret_params(interpret)
    scratch = [
        *tma_ring.ring_scratch(tiles, FP8, weights=1, k_major=True),
        plgpu.SMEM((ROW_TILE, tiles.block_n), jnp.float32),
        plgpu.SMEM((1, ROW_TILE), jnp.float32),
        plgpu.SMEM((1, tiles.block_n), jnp.float32),
        plgpu.Barrier(num_barriers=2),
    ]
    if params is not None:  # the interpreter's untransposed weight tile (`_multiply`)
        scratch.append(plgpu.SMEM((tiles.block_k, tiles.block_n), FP8))
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            steps=k // (tiles.splits * tiles.block_k),
            m=m,
            column_tiles=column_tiles,
            interpreting=params is not None,
        ),
        out_type=jax.ShapeDtypeStruct((tiles.splits, m, n), jnp.float32),
        grid=(pl.cdiv(m, ROW_TILE) * tiles.splits * column_tiles,),
        grid_names=("cta",),
        scratch_types=scratch,
        interpret=params,
    )
    parts = kernel(tma_ring.aligned_rows(rows), w_t, row_scale, w_scale.reshape(1, n))
    return Partials(parts.reshape((tiles.splits, *xq.shape[:-1], n)), jnp.dtype(dtype))


def matmul(
    x: Array, w_t: Array, w_scale: Array, tiles: Tiles | None = None, interpret=None
) -> Partials:
    """x [..., k] (bf16 or fp16) times the fp8 weight (w_t [n, k] e4m3, w_scale [n] fp32):
    the rows quantised by `quantize_rows`, then `matmul_partials` in x's dtype."""
    xq, x_scale = quantize_rows(x)
    return matmul_partials(xq, x_scale, w_t, w_scale, tiles, x.dtype, interpret)
