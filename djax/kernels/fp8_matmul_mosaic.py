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
as `split_k_mosaic` leaves them; the slices' sum is the product). The SwiGLU form
(`swiglu_matmul`, unsplit) holds the gate and up weight tiles of its columns side by side in
each slot, scales both fp32 products and writes `silu(gate) * up`, as `swiglu_mosaic` does
for 16-bit weights; with `out_fp8` (128-column tiles) it quantises its tile of the
activation itself, each row with a scale of its own (`quantize_slices`' rule), and the
products take such rows: a scale per row and 128-column slice of the contraction, each
slice's product scaled before it is added (`tma_ring.SliceScales`), so the down product
needs no quantisation between the two kernels.

Rules: k a multiple of 128 (`block_k` is), n a multiple of 64, `block_n` at most 256
(WGMMA's widest N). Rows are quantised by `quantize_rows`: `quantize`, the rule of every
fp8 weight (`djax.models.fp8`), over the row (as the `scaled` product does). Mosaic GPU's
interpreter has no transposed WGMMA operand: there each step's weight tile is first copied,
transposed, into a scratch tile of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import split_k_mosaic, swiglu_mosaic, tma_ring
from djax.kernels.handoff import Partials, QuantizedRows
from djax.kernels.tma_ring import ROW_TILE, Tiles

Array = jax.Array

FP8 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8).max)  # 448
K_TILE = tma_ring.SWIZZLE  # e4m3 values in a swizzled row: block_k is a multiple of this
MAX_BLOCK_N = 256  # WGMMA's widest N
SLICE = K_TILE  # columns a row's scale covers where rows are quantised per slice
OUT_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)))


def fits(k: int, n: int) -> bool:
    """Whether the kernel takes a `k -> n` product (k a multiple of 128, n of 64)."""
    return k % K_TILE == 0 and n % tma_ring.TILE == 0


def quantize(w: Array, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """`w` -> (e4m3 values of w's shape, fp32 scale of w's shape without `axes`): the scale
    is the max |w| over `axes` / 448 (1 where that max is 0), the values `w / scale`
    rounded to nearest e4m3. The one rule of djax's fp8 weights (`djax.models.fp8`) and
    rows."""
    wf = w.astype(jnp.float32)
    scale = scale_of(jnp.max(jnp.abs(wf), axis=axes, keepdims=True))
    return e4m3_values(wf, scale), jnp.squeeze(scale, axes)


# The least scale: fp32's least normal. A smaller one is a subnormal, which XLA flushes to
# 0 (the values would become w / 0: 448, or NaN for zeros).
MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)


def scale_of(peak: Array) -> Array:
    """`quantize`'s scale of values whose max |value| is `peak` (fp32): `peak / 448` as
    `peak` times 1/448 rounded to fp32 (what XLA's compiler makes of the division by a
    constant, on every backend; written so, a Mosaic GPU kernel rounds it the same way),
    at least `MIN_SCALE` (a peak below ~5e-36 then maps below 448, never to NaN), 1 where
    `peak` is 0. Also inside a Mosaic GPU kernel (`residual_norm_mosaic`)."""
    return jnp.where(peak > 0, jnp.maximum(peak * (1 / E4M3_MAX), MIN_SCALE), 1.0)


def e4m3_values(wf: Array, scale: Array) -> Array:
    """`quantize`'s values: fp32 `wf / scale` clipped to +-448 and rounded to nearest e4m3
    (ties to even). Also inside a Mosaic GPU kernel (`residual_norm_mosaic`)."""
    return jnp.clip(wf / scale, -E4M3_MAX, E4M3_MAX).astype(FP8)


def quantize_rows(x: Array) -> tuple[Array, Array]:
    """x [..., k] -> (e4m3 values [..., k], fp32 scale [...]): `quantize` over each row."""
    return quantize(x, (x.ndim - 1,))


def quantize_slices(x: Array) -> tuple[Array, Array]:
    """x [rows, k] (k a multiple of `SLICE`) -> (e4m3 values [rows, k], fp32 scales
    [k / SLICE, rows]): `quantize` over each row's slices of `SLICE` columns, the scales
    slice-major, as `expert_tiles_mosaic`'s gate/up product writes its activation and its
    down product reads it."""
    rows, k = x.shape
    values, scale = quantize(x.reshape(rows, k // SLICE, SLICE), (2,))
    return values.reshape(rows, k), scale.T


def quantize_heads(out: Array) -> QuantizedRows:
    """An attention output out [b, t, ..., head_dim] (head_dim `SLICE`) as the output
    product takes it per slice: `QuantizedRows` of e4m3 values [b, t, heads · head_dim] and
    scales [heads, b · t] (`quantize_slices`: each row of each head on its own), in out's
    dtype; what the split-K/V kernel writes itself under `out_fp8`."""
    b, t = out.shape[:2]
    values, scale = quantize_slices(out.reshape(b * t, -1))
    return QuantizedRows(values.reshape(b, t, -1), scale, out.dtype)


def quantized(x: Array | QuantizedRows) -> QuantizedRows:
    """x's rows as the fp8 kernels take them: as a kernel already quantised them, or
    quantised here (`quantize_rows`)."""
    if isinstance(x, QuantizedRows):
        return x
    return QuantizedRows(*quantize_rows(x), x.dtype)


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """`split_k_mosaic.tiles_for`'s tiles (its column tiles, slices and stages) with block_k
    doubled, the same bytes a step at one byte a value (128 where the doubled step does not
    divide a slice)."""
    base = split_k_mosaic.tiles_for(m, k, n)
    block_k = 2 * base.block_k
    if block_k % K_TILE or k % (base.splits * block_k):
        block_k = K_TILE
    return dataclasses.replace(base, block_k=block_k)


def swiglu_tiles_for(m: int, k: int, n: int) -> Tiles:
    """`swiglu_mosaic.tiles_for`'s tiles (n per side) with block_k doubled (at least 128)."""
    base = swiglu_mosaic.tiles_for(m, k, n)
    block_k = 2 * base.block_k
    return dataclasses.replace(base, block_k=block_k if k % block_k == 0 else K_TILE)


def x_slices(name: str, xq: Array, x_scale: Array) -> int:
    """How `x_scale` scales xq [..., k]: 0 per row (x_scale [...], `quantize_rows`), else
    the count of its slices (x_scale [k / SLICE, rows], rows all of xq's, `quantize_slices`);
    a ValueError naming `name` for another shape. (Where k is one slice, both forms hold the
    same values.)"""
    rows, k = math.prod(xq.shape[:-1]), xq.shape[-1]
    if x_scale.shape == xq.shape[:-1]:
        return 0
    if k % SLICE == 0 and x_scale.shape == (k // SLICE, rows):
        return k // SLICE
    raise ValueError(
        f"{name}: xq {xq.shape}, x_scale {x_scale.shape}; expected x_scale {xq.shape[:-1]} "
        f"(per row) or {(k // SLICE, rows) if k % SLICE == 0 else '[k / 128, rows]'} (per "
        f"slice of {SLICE} columns)"
    )


def check_tiles(
    tiles: Tiles,
    k: int,
    n: int,
    gated: bool = False,
    out_bytes: int = 4,
    row_tiled: bool = False,
    extra: int = 0,
) -> None:
    """Raise a ValueError naming `tiles` unless they take a `k -> n` fp8 product (`gated`: n
    columns a side, two weight tiles a slot): the ring's rules at one byte a value
    (`Tiles.check`; `row_tiled` for kernels whose row tiles may take fewer than 64 rows),
    the output tile (`out_bytes` a value), scales and `extra` bytes in shared memory, and
    block_n at most `MAX_BLOCK_N`."""
    if tiles.block_n > MAX_BLOCK_N:
        raise ValueError(f"{tiles}: block_n must be at most {MAX_BLOCK_N} (WGMMA's widest N)")
    weights = 2 if gated else 1
    scales = (ROW_TILE + weights * tiles.block_n) * 4 + extra
    tiles.check(
        k, n, weights=weights, out_bytes=out_bytes, extra=scales, itemsize=1, row_tiled=row_tiled
    )


def k_major_multiply(untransposed=None):
    """A step's product into an accumulator ref: fp8 x fp8 WGMMA of an x slot [64, block_k]
    and a weight slot [block_n, block_k] read transposed. Mosaic GPU's interpreter has no
    transposed WGMMA operand: given `untransposed`, a [block_k, block_n] scratch ref, the
    slot's tile (or the contraction slice of it that `w_slot` is) is copied into its first
    rows transposed and multiplied from there."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def multiply(acc, x_slot, w_slot):
        if untransposed is None:
            plgpu.wgmma(acc, x_slot, plgpu.transpose_ref(w_slot, (1, 0)))
            return
        into = untransposed.at[pl.ds(0, w_slot.shape[1])]  # a slice of the step: its rows
        into[...] = w_slot[...].T
        plgpu.wgmma(acc, x_slot, into)

    return multiply


def scale_products(products, column_scales, row_scales=None, interpreting=False) -> list:
    """Inside a kernel: fp32 products [64, block_n] (one per weight) times their columns'
    scales, `column_scales` [weights, block_n] fp32 in shared memory (row i for product i),
    and with `row_scales` [1, 64] fp32 in shared memory times their rows' scales."""
    row_scale = None
    if row_scales is not None:
        row_scale = tma_ring.accumulator_rows(row_scales[0], interpreting)
    scaled = []
    for side, product in enumerate(products):
        if row_scale is not None:
            product = product * jax.lax.broadcast_in_dim(row_scale, product.shape, [0])
        column_scale = tma_ring.accumulator_columns(column_scales[side], interpreting)
        scaled.append(product * jax.lax.broadcast_in_dim(column_scale, product.shape, [1]))
    return scaled


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
    n,
    column_tiles,
    gated,
    split_slices,
    out_fp8,
    interpreting,
):
    """One CTA: one (row tile, column tile, slice) of xq [m8, k] @ w_t [n, k]^T, scaled by
    x_scale [1, m8] per row (or, with `split_slices`, [k / SLICE, m8] per row and 128-column
    slice: each CTA reads its own slice's `split_slices`) and w_scale [1, n] per column,
    into out [splits, m, n] fp32; `gated`: w_t [2n, k] (gate rows, then up rows), w_scale
    [1, 2n], into out [m, n] as `silu(gate) * up` (unsplit), with `out_fp8` as e4m3 values
    and their scales out_scale [n / SLICE, m8] (one per row of each 128-column tile)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if out_fp8:
        out_scale_gmem, *refs = refs
    if out_fp8:  # the scratch's last: the output tile's row scales
        *refs, out_scale_smem = refs
    if interpreting:
        *refs, untransposed = refs
    *ring, out_smem, x_scale_smem, w_scale_smem, scale_bars = refs
    cta = jax.lax.axis_index("cta")
    per_row_tile = column_tiles * tiles.splits
    row_tile, rest = cta // per_row_tile, cta % per_row_tile
    split, column_tile = rest // column_tiles, rest % column_tiles
    start = column_tile * tiles.block_n
    cols = pl.ds(start, tiles.block_n)
    offsets = [start, n + start] if gated else [start]
    rows = pl.ds(row_tile * ROW_TILE, ROW_TILE)
    # in flight while the tiles stream; rows past x's end read as zeros
    x_scales = (
        x_scale_gmem.at[pl.ds(split * split_slices, split_slices)]
        if split_slices
        else (x_scale_gmem)
    )
    plgpu.copy_gmem_to_smem(x_scales.at[:, rows], x_scale_smem, scale_bars.at[0])
    for side, offset in enumerate(offsets):
        plgpu.copy_gmem_to_smem(
            w_scale_gmem.at[:, pl.ds(offset, tiles.block_n)],
            w_scale_smem.at[pl.ds(side, 1)],
            scale_bars.at[1 + side],
        )
    slice_scales = None
    if split_slices:  # each slice's product scaled by its rows' scales as it is added
        slice_scales = tma_ring.SliceScales(
            SLICE,
            lambda j: tma_ring.accumulator_rows(
                x_scale_smem[j - split * split_slices], interpreting
            ),
            lambda: plgpu.barrier_wait(scale_bars.at[0]),
            interpreting,
        )

    def finish(*products):
        for bar in range(1 if split_slices else 0, 1 + len(offsets)):
            plgpu.barrier_wait(scale_bars.at[bar])
        row_scales = None if split_slices else x_scale_smem
        scaled = scale_products(products, w_scale_smem, row_scales, interpreting)
        out = swiglu_mosaic.silu_times(*scaled) if gated else scaled[0]
        if out_fp8:  # each row of the tile quantised on its own
            scale = scale_of(jnp.max(jnp.abs(out), axis=1))
            out_scale_smem[...] = scale
            out = e4m3_values(out, jax.lax.broadcast_in_dim(scale, out.shape, [0]))
        out_smem[...] = out.astype(out_smem.dtype)

    tma_ring.stream(
        x_gmem,
        [
            lambda ks, offset=offset: w_gmem.at[pl.ds(offset, tiles.block_n), ks]
            for offset in offsets
        ],
        ring,
        tiles,
        split * steps,
        steps,
        rows,
        finish,
        multiply=k_major_multiply(untransposed if interpreting else None),
        slice_scales=slice_scales,
    )
    out_at = (
        (lambda rows: out_gmem.at[rows, cols])
        if gated
        else (lambda rows: out_gmem.at[split, rows, cols])
    )
    more = []
    if out_fp8:  # the scales of all 64 rows: their buffer's rows are padded to 8
        more.append(
            (out_scale_smem, lambda rows: out_scale_gmem.at[column_tile, rows], tma_ring.aligned(m))
        )
    tma_ring.store_rows(out_smem, out_at, row_tile, m, *more)


def check_operands(name: str, xq, x_scale, w_t, w_scale, dtype) -> None:
    """Raise a ValueError naming `name` unless xq [..., k] and w_t [..., n, k] are e4m3 with
    k a multiple of 128 and n of 64, x_scale [...] and w_scale [..., n] fp32, and the
    product's `dtype` one of `OUT_DTYPES`."""
    if xq.dtype != FP8 or w_t.dtype != FP8:
        raise ValueError(f"{name}: xq {xq.dtype}, w_t {w_t.dtype}; expected both float8_e4m3fn")
    if x_scale.dtype != jnp.float32 or w_scale.dtype != jnp.float32:
        raise ValueError(
            f"{name}: x_scale {x_scale.dtype}, w_scale {w_scale.dtype}; expected both float32"
        )
    if w_t.ndim < 2 or xq.ndim < 1 or xq.shape[-1] != w_t.shape[-1]:
        raise ValueError(
            f"{name}: xq {xq.shape}, w_t {w_t.shape}; expected xq [..., k] and w_t [..., n, k]"
        )
    n, k = w_t.shape[-2:]
    if k % K_TILE or n % tma_ring.TILE:
        raise ValueError(
            f"{name}: w_t {w_t.shape}; expected k a multiple of {K_TILE} and n of {tma_ring.TILE}"
        )
    if jnp.dtype(dtype) not in OUT_DTYPES:
        raise ValueError(f"{name}: dtype {jnp.dtype(dtype)}; expected bfloat16, float16 or float32")
    if x_scale.shape != xq.shape[:-1] or w_scale.shape != w_t.shape[:-1]:
        raise ValueError(
            f"{name}: x_scale {x_scale.shape}, w_scale {w_scale.shape}; expected "
            f"{xq.shape[:-1]} and {w_t.shape[:-1]}"
        )


def _call(
    xq, x_scale, w_t, w_scale, tiles: Tiles, dtype, gated: bool, interpret, out_fp8=False
) -> Array | tuple[Array, Array]:
    """The kernel on xq [m, k], x_scale [m] (or [k / SLICE, m] per slice), w_t
    [weights * n, k], w_scale [weights * n]: out [splits, m, n] fp32, or `gated` [m, n] in
    `dtype`, or with `out_fp8` (e4m3 values [m, n], scales [n / SLICE, m8])."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = xq.shape
    weights = 2 if gated else 1
    n = w_t.shape[0] // weights
    column_tiles = n // tiles.block_n
    slices = x_scale.shape[0] if x_scale.ndim == 2 else 0
    split_slices = slices // tiles.splits
    if slices:  # rows padded to 8 along the scales' last axis
        missing = tma_ring.aligned(m) - m
        row_scale = jnp.pad(x_scale, ((0, 0), (0, missing))) if missing else x_scale
    else:
        row_scale = tma_ring.aligned_rows(x_scale.reshape(m, 1)).reshape(1, -1)
    params = tma_ring.interpret_params(interpret)
    out_dtype = FP8 if out_fp8 else jnp.dtype(dtype) if gated else jnp.dtype(jnp.float32)
    scratch = [
        *tma_ring.ring_scratch(tiles, FP8, weights=weights, k_major=True),
        plgpu.SMEM((ROW_TILE, tiles.block_n), out_dtype),
        plgpu.SMEM((max(split_slices, 1), ROW_TILE), jnp.float32),
        plgpu.SMEM((weights, tiles.block_n), jnp.float32),
        plgpu.Barrier(num_barriers=1 + weights),
    ]
    if params is not None:  # the interpreter's untransposed weight tile (`k_major_multiply`)
        scratch.append(plgpu.SMEM((tiles.block_k, tiles.block_n), FP8))
    if out_fp8:  # the output tile's row scales
        scratch.append(plgpu.SMEM((ROW_TILE,), jnp.float32))
    out_type = jax.ShapeDtypeStruct((m, n) if gated else (tiles.splits, m, n), out_dtype)
    if out_fp8:
        out_type = (out_type, jax.ShapeDtypeStruct((n // SLICE, tma_ring.aligned(m)), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            steps=k // (tiles.splits * tiles.block_k),
            m=m,
            n=n,
            column_tiles=column_tiles,
            gated=gated,
            split_slices=split_slices,
            out_fp8=out_fp8,
            interpreting=params is not None,
        ),
        out_type=out_type,
        grid=(pl.cdiv(m, ROW_TILE) * tiles.splits * column_tiles,),
        grid_names=("cta",),
        scratch_types=scratch,
        interpret=params,
    )
    rows = tma_ring.aligned_rows(xq)
    return kernel(rows, w_t, row_scale, w_scale.reshape(1, weights * n))


def _scale_bytes(slices: int, splits: int, out_fp8: bool) -> int:
    """Shared memory the scales take beyond `check_tiles`' one row-scale tile: a CTA's
    slices' scale tiles past the first, and the output tile's row scales."""
    return (max(slices // splits, 1) - 1 + out_fp8) * ROW_TILE * 4


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

    xq: [..., k] e4m3 rows; x_scale fp32, per row [...] (`quantize_rows`) or per row and
    128-column slice [k / SLICE, rows] (`quantize_slices`, as `swiglu_matmul(...,
    out_fp8=True)` writes them; rows all of xq's); w_t: [n, k] e4m3 (an `Fp8Weight`'s
    values transposed), w_scale [n] fp32; k a multiple of 128, n of 64. Returns `Partials`
    with parts [splits, ..., n] fp32 and `dtype` (the product's dtype once summed). Row
    counts that are not multiples of 8 are padded with zero rows for the kernel (an extra
    copy of xq and x_scale). `tiles`: the program shape (default `tiles_for`, checked by
    `check_tiles`); `interpret`: run in Mosaic GPU's interpreter (default: exactly off
    GPUs, as the CPU tests do).
    """
    name = "fp8_matmul_mosaic.matmul_partials"
    slices = x_slices(name, xq, x_scale)
    row_scale = x_scale[0].reshape(xq.shape[:-1]) if slices else x_scale
    check_operands(name, xq, row_scale, w_t, w_scale, dtype)
    if w_t.ndim != 2:
        raise ValueError(f"{name}: w_t {w_t.shape}; expected [n, k]")
    n, k = w_t.shape
    rows = xq.reshape(-1, k)
    tiles = tiles or tiles_for(rows.shape[0], k, n)
    if slices // tiles.splits > MAX_BLOCK_N:  # a TMA box's dimension
        raise ValueError(
            f"{name}: {slices // tiles.splits} scale slices a CTA (k {k} in {tiles.splits} "
            f"splits); rows scaled per slice take at most {MAX_BLOCK_N} a CTA"
        )
    check_tiles(tiles, k, n, extra=_scale_bytes(slices, tiles.splits, False))
    scale = x_scale if slices else x_scale.reshape(-1)
    parts = _call(rows, scale, w_t, w_scale, tiles, dtype, False, interpret)
    return Partials(parts.reshape((tiles.splits, *xq.shape[:-1], n)), jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("tiles", "dtype", "interpret", "out_fp8"))
def swiglu_matmul(
    xq: Array,
    x_scale: Array,
    w_t: Array,
    w_scale: Array,
    tiles: Tiles | None = None,
    dtype=jnp.bfloat16,
    interpret: bool | None = None,
    out_fp8: bool = False,
) -> Array | QuantizedRows:
    """`silu(gate) * up` of gate = `(xq * x_scale) @ (w_t[0] * w_scale[0])^T` and up the
    same of `w_t[1]`, in one Mosaic GPU kernel (both products by fp8 x fp8 WGMMA into fp32
    accumulators, scaled, then the activation).

    xq: [m, k] e4m3, x_scale [m] fp32; w_t: [2, n, k] e4m3 (the gate/up `Fp8Weight`'s values
    [k, 2, n] transposed), w_scale [2, n] fp32; k a multiple of 128, n of 64. Returns
    [m, n] in `dtype`; with `out_fp8` the fp32 activation quantised per row of each
    128-column tile as `quantize_slices` quantises it: `QuantizedRows` of e4m3 values
    [m, n] and scales [n / SLICE, m], `dtype` the products' (`tiles.block_n` must be
    `SLICE`). `tiles`: the program shape (default `swiglu_tiles_for`; `splits` must be 1);
    `interpret` as `matmul_partials`.
    """
    name = "fp8_matmul_mosaic.swiglu_matmul"
    check_operands(name, xq, x_scale, w_t, w_scale, dtype)
    if xq.ndim != 2 or w_t.ndim != 3 or w_t.shape[0] != 2:
        raise ValueError(f"{name}: xq {xq.shape}, w_t {w_t.shape}; expected [m, k] and [2, n, k]")
    m, (_, n, k) = xq.shape[0], w_t.shape
    tiles = tiles or swiglu_tiles_for(m, k, n)
    if tiles.splits != 1:
        raise ValueError(f"{tiles}: the SwiGLU product takes splits=1")
    if out_fp8 and tiles.block_n != SLICE:
        raise ValueError(f"{name}: an e4m3 output takes {SLICE}-column tiles; got {tiles}")
    out_bytes = 1 if out_fp8 else jnp.dtype(dtype).itemsize
    extra = _scale_bytes(0, 1, out_fp8)
    check_tiles(tiles, k, n, gated=True, out_bytes=out_bytes, extra=extra)
    w_t, w_scale = w_t.reshape(2 * n, k), w_scale.reshape(2 * n)
    out = _call(xq, x_scale, w_t, w_scale, tiles, dtype, True, interpret, out_fp8)
    if not out_fp8:
        return out
    values, scale = out
    return QuantizedRows(values, scale[:, :m], jnp.dtype(dtype))


def matmul(
    x: Array,
    w_t: Array,
    w_scale: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Partials:
    """x [..., k] (bf16 or fp16) times the fp8 weight (w_t [n, k] e4m3, w_scale [n] fp32):
    the rows quantised by `quantize_rows`, then `matmul_partials` in x's dtype."""
    xq, x_scale = quantize_rows(x)
    return matmul_partials(xq, x_scale, w_t, w_scale, tiles, x.dtype, interpret)


def swiglu(
    x: Array,
    w_t: Array,
    w_scale: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Array:
    """x [m, k] (bf16 or fp16) through the gate/up fp8 weight (w_t [2, n, k] e4m3, w_scale
    [2, n] fp32): the rows quantised by `quantize_rows`, then `swiglu_matmul` in x's dtype."""
    xq, x_scale = quantize_rows(x)
    return swiglu_matmul(xq, x_scale, w_t, w_scale, tiles, x.dtype, interpret)
