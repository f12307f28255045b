"""The residual add and the RMSNorm after it as Pallas Mosaic GPU kernels (Hopper: TMA
copies): `add_scaled`, the column-tiled add that leaves the norm to the next product
(`norm_impl="tiled"`, after `split_k_mosaic.matmul_partials`), and `add_rms_norm`, the add
and the norm of whole rows (`norm_impl="mosaic"`, and the norms not moved into products
under `fused` and `tiled`).

Each CTA owns one row tile of 64 and `COLUMNS` columns. TMA brings in its tiles of x and
of every slice of y (fp32 partial products, or one slice in x's dtype), and the norm's
whole scale (a copy moves a multiple of 128 bytes); the tiles are read in the layout of a
WGMMA accumulator, so a row's share of the sum of squares is one reduction along the
tile's columns. The CTA writes
`h = x + y` (the slices added in fp32 and rounded to x's dtype first, as
`Partials.total()` does; then the add in fp32, rounded), `h * scale` and the tile's sums of
squares of h as stored (`handoff.ScaledRows`). Rows past x's
end are read by TMA as zeros and never stored.

`add_rms_norm` runs one CTA per row. The row comes in by TMA as a [d / 256, 256] block (a TMA box
spans at most 256 values per dim) and is held by the warpgroup in a strided layout, in
which the sum of squares is one reduction over the whole block. With `into_fp8` it also
quantises the normed row for the fp8 product after it (`handoff.QuantizedRows`, the rule
of `fp8_matmul_mosaic.quantize_rows`): the row's max |value| is a second reduction over
the block, the e4m3 block leaves by TMA as the normed block does, and the row's scale, one
fp32 (less than a TMA copy's 16 bytes), is stored by the CTA's threads straight into
global memory. With `keep_rows` as well, the normed block in x's dtype leaves beside them
(a MoE layer's router reads it, its experts the e4m3 rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import fp8_matmul_mosaic, tma_ring
from djax.kernels.handoff import Partials, QuantizedRows, ScaledRows, add_slices
from djax.kernels.residual_product_mosaic import MAX_COLUMN_TILES, scaled_rows_tile
from djax.kernels.tma_ring import ROW_TILE

Array = jax.Array

# Columns per CTA: a 32-bit tile row of 128 bytes, the widest swizzle (128 CTAs at a
# 4096-wide model).
COLUMNS = 32


def _tile_transforms(dtype) -> tuple:
    """The transforms of a [64, COLUMNS] tile of `dtype`, swizzled at its row's bytes, so
    that it loads in the layout of a WGMMA accumulator."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    row_bytes = COLUMNS * jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, COLUMNS)), plgpu.SwizzleTransform(row_bytes))


def _kernel(
    x_gmem,
    y_gmem,
    scale_gmem,
    h_gmem,
    scaled_gmem,
    squares_gmem,
    x_smem,
    y_smem,
    scale_smem,
    bars,
    h_smem,
    scaled_smem,
    squares_smem,
    *,
    m,
    column_tiles,
    interpreting,
):
    """One CTA: one (row tile, column tile) of x [m8, d], y [splits, m8, d] and scale
    [d // COLUMNS, COLUMNS], into h, scaled [m, d] and squares [d // COLUMNS, m8]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    splits = y_gmem.shape[0]
    cta = jax.lax.axis_index("cta")
    row_tile, column_tile = cta // column_tiles, cta % column_tiles
    rows = pl.ds(row_tile * ROW_TILE, ROW_TILE)
    cols = pl.ds(column_tile * COLUMNS, COLUMNS)
    plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(scale_gmem, scale_smem, bars.at[1])  # one copy: >= 128 bytes
    for split in range(splits):
        plgpu.copy_gmem_to_smem(y_gmem.at[split, rows, cols], y_smem.at[split], bars.at[2 + split])
    for barrier in range(2 + splits):
        plgpu.barrier_wait(bars.at[barrier])
    dtype = h_smem.dtype
    # The contract's roundings to h's dtype: y's sum, then x + y; everything after reads
    # the rounded h.
    y = add_slices([y_smem[split].astype(jnp.float32) for split in range(splits)], dtype)
    h, scaled, squares = scaled_rows_tile(
        x_smem[...], y, scale_smem, column_tile, dtype, interpreting
    )
    h_smem[...] = h
    scaled_smem[...] = scaled
    squares_smem[...] = squares
    tma_ring.store_rows(
        h_smem,
        lambda rows: h_gmem.at[rows, cols],
        row_tile,
        m,
        (scaled_smem, lambda rows: scaled_gmem.at[rows, cols], m),
        (squares_smem, lambda rows: squares_gmem.at[column_tile, rows], squares_gmem.shape[1]),
    )


def fits(d: int) -> bool:
    """Whether the kernel takes rows of width `d`: a multiple of `COLUMNS`, at most
    `MAX_COLUMN_TILES` of them (the rows of the scale's one TMA copy)."""
    return d % COLUMNS == 0 and d // COLUMNS <= MAX_COLUMN_TILES


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_scaled(
    x: Array,
    y: Array | Partials,
    scale: Array,
    eps: float,
    interpret: bool | None = None,
) -> tuple[Array, ScaledRows]:
    """`h = x + y` and the inputs of the RMSNorm after it (`ScaledRows`: `h * scale` and
    each 32-column tile's share of the rows' sums of squares), in one Mosaic GPU kernel.

    x: [..., d], bf16 or fp16, d a multiple of 32 up to 8192 (`fits`); y: [..., d] in x's dtype, or
    `Partials` of that shape and dtype (summed and rounded first, as `Partials.total()`
    does); scale: [d] in x's dtype, the norm's learned scale, and `eps` its epsilon.
    Returns (h, ScaledRows), the sums of squares [d / 32, ...]. Row counts that
    are not multiples of 8 are padded with zero rows for the kernel (extra copies of x and
    y, and a slice of the sums of squares). `interpret`: run in Mosaic GPU's interpreter
    (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "residual_norm_mosaic.add_scaled"
    d = x.shape[-1]
    parts = y.parts if isinstance(y, Partials) else y[None]
    if parts.shape[1:] != x.shape or y.dtype != x.dtype or scale.shape != (d,) or not fits(d):
        raise ValueError(
            f"{name}: x {x.shape} {x.dtype}, y {parts.shape[1:]} {y.dtype}, scale "
            f"{scale.shape}; expected y shaped and typed like x, scale [{d}] and {d} a "
            f"multiple of {COLUMNS}, at most {MAX_COLUMN_TILES * COLUMNS}"
        )
    if not tma_ring.takes_dtype(x.dtype) or scale.dtype != x.dtype:
        raise ValueError(
            f"{name}: x {x.dtype}, scale {scale.dtype}; expected both bfloat16 or both float16"
        )
    rows = x.reshape(-1, d)
    m = rows.shape[0]
    m8 = tma_ring.aligned(m)
    splits = parts.shape[0]
    parts = parts.reshape(splits, m, d)
    if m8 != m:
        parts = jnp.pad(parts, ((0, 0), (0, m8 - m), (0, 0)))
    column_tiles = d // COLUMNS
    params = tma_ring.interpret_params(interpret)
    tile = (ROW_TILE, COLUMNS)
    out = jax.ShapeDtypeStruct((m, d), x.dtype)
    kernel = plgpu.kernel(
        functools.partial(_kernel, m=m, column_tiles=column_tiles, interpreting=params is not None),
        out_type=(out, out, jax.ShapeDtypeStruct((column_tiles, m8), jnp.float32)),
        grid=(pl.cdiv(m, ROW_TILE) * column_tiles,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM(tile, x.dtype, transforms=_tile_transforms(x.dtype)),
            plgpu.SMEM((splits, *tile), parts.dtype, transforms=_tile_transforms(parts.dtype)),
            plgpu.SMEM((column_tiles, COLUMNS), x.dtype),  # the scale, by column tile
            plgpu.Barrier(num_barriers=2 + splits),  # x, scale, each slice of y
            plgpu.SMEM(tile, x.dtype),  # h
            plgpu.SMEM(tile, x.dtype),  # h * scale
            plgpu.SMEM((ROW_TILE,), jnp.float32),  # the sums of squares
        ],
        interpret=params,
    )
    h, scaled, squares = kernel(
        tma_ring.aligned_rows(rows), parts, scale.reshape(column_tiles, COLUMNS)
    )
    squares = squares[:, :m] if m8 != m else squares
    lead = x.shape[:-1]
    return h.reshape(x.shape), ScaledRows(scaled.reshape(x.shape), squares.reshape(-1, *lead), eps)


# Values per TMA row of `add_rms_norm`'s row block (the widest box dim).
ROW_BLOCK = 256
# Values a warpgroup's threads load at once, in the strided layout (8 bytes of 16-bit
# values: every dtype of the kernel in one layout).
VECTOR = 4


def row_fits(d: int) -> bool:
    """Whether `add_rms_norm` takes rows of width `d`: whole `ROW_BLOCK`-wide blocks, at
    most 256 of them, spread evenly over a warpgroup's 128 threads in `VECTOR`s."""
    return d % ROW_BLOCK == 0 and d // ROW_BLOCK <= 256 and d % (128 * VECTOR) == 0


def _row_kernel(
    x_gmem, y_gmem, scale_gmem, h_gmem, normed_gmem, *refs, eps, width, into_fp8, keep_rows,
    interpreting,
):  # fmt: skip
    """One CTA per row. x, h [m, d / 256, 256]; y [splits, m, d / 256, 256] (fp32 partial
    products, or x's dtype with one split); scale [d / 256, 256]; normed [m, d / 256, 256]
    in x's dtype, or with `into_fp8` its e4m3 values, and then the next output (before the
    scratch refs) is the rows' fp32 scales [m], and with `keep_rows` the one after it the
    normed rows in x's dtype [m, d / 256, 256] (its scratch block last)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    row_scale_gmem, *refs = refs if into_fp8 else (None, *refs)
    rows_gmem, *refs = refs if keep_rows else (None, *refs)
    x_smem, y_smem, scale_smem, bars, h_smem, normed_smem, *rows_smem = refs
    splits = y_gmem.shape[0]
    row = jax.lax.axis_index("row")
    plgpu.copy_gmem_to_smem(x_gmem.at[row], x_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(scale_gmem, scale_smem, bars.at[1])
    for split in range(splits):
        plgpu.copy_gmem_to_smem(y_gmem.at[split, row], y_smem.at[split], bars.at[2 + split])
    for barrier in range(2 + splits):
        plgpu.barrier_wait(bars.at[barrier])
    layout = plgpu.Layout.WG_STRIDED(x_smem.shape, vec_size=VECTOR)

    def load(ref):
        """The block at `ref` in fp32, every operand in one strided layout (the cast is
        the identity on values; Mosaic GPU's interpreter has no rule for it)."""
        value = ref[...]
        return (value if interpreting else plgpu.layout_cast(value, layout)).astype(jnp.float32)

    dtype = h_smem.dtype
    # Rounded to h's dtype, as `add_scaled`: y's sum, x + y, `h / rms(h)`, then times scale.
    y = add_slices([load(y_smem.at[split]) for split in range(splits)], dtype)
    h = (load(x_smem) + y).astype(dtype)
    hf = h.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(hf * hf) / width + eps)
    normed = ((hf * inv_rms).astype(dtype).astype(jnp.float32) * load(scale_smem)).astype(dtype)
    h_smem[...] = h
    if keep_rows:
        rows_smem[0][...] = normed
    if into_fp8:  # `quantize_rows` of the rounded row: the block is the whole row
        normed = normed.astype(jnp.float32)
        row_scale = fp8_matmul_mosaic.scale_of(jnp.max(jnp.abs(normed)))
        normed_smem[...] = fp8_matmul_mosaic.e4m3_values(normed, row_scale)
        row_scale_gmem[row] = row_scale  # one fp32: every thread stores the same value
    else:
        normed_smem[...] = normed
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_smem, h_gmem.at[row])
    plgpu.copy_smem_to_gmem(normed_smem, normed_gmem.at[row])
    if keep_rows:
        plgpu.copy_smem_to_gmem(rows_smem[0], rows_gmem.at[row])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("eps", "into_fp8", "keep_rows", "interpret"))
def add_rms_norm(
    x: Array,
    y: Array | Partials,
    scale: Array,
    eps: float,
    into_fp8: bool = False,
    keep_rows: bool = False,
    interpret: bool | None = None,
) -> tuple[Array, Array | QuantizedRows]:
    """`h = x + y` and `rms_norm(h, scale, eps)` (`layers.rms_norm`'s rounding) in one
    Mosaic GPU kernel.

    x: [..., d], bf16 or fp16, d a multiple of 512 up to 65536 (`row_fits`); y: [..., d] in
    x's dtype, or `Partials` of that shape and dtype (summed and rounded first); scale: [d]
    in x's dtype. Returns (h, normed), both shaped and typed like x; `into_fp8`: normed as
    the next fp8 product takes it, `QuantizedRows` (values [..., d] e4m3, scale [...] fp32:
    `fp8_matmul_mosaic.quantize_rows` of the normed rows as rounded to x's dtype; the same
    scales, and on a GPU values that may differ by one e4m3 step where the kernel's
    approximate division and XLA's exact one round a value at a midpoint apart);
    `keep_rows` (with `into_fp8`): the `QuantizedRows` also hold the normed rows in x's
    dtype (`rows`), as the kernel writes them without `into_fp8`. `interpret`: run in
    Mosaic GPU's interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "residual_norm_mosaic.add_rms_norm"
    if keep_rows and not into_fp8:
        raise ValueError(f"{name}: keep_rows keeps rows beside their e4m3 values; give into_fp8")
    d = x.shape[-1]
    parts = y.parts if isinstance(y, Partials) else y[None]
    if parts.shape[1:] != x.shape or y.dtype != x.dtype or scale.shape != (d,):
        raise ValueError(
            f"{name}: x {x.shape} {x.dtype}, y {parts.shape[1:]} {y.dtype}, scale "
            f"{scale.shape}; expected y shaped and typed like x and scale [{d}]"
        )
    if not row_fits(d):
        raise ValueError(f"{name}: rows of {d}; expected a multiple of 512 up to 65536")
    if not tma_ring.takes_dtype(x.dtype) or scale.dtype != x.dtype:
        raise ValueError(
            f"{name}: x {x.dtype}, scale {scale.dtype}; expected both bfloat16 or both float16"
        )
    splits = parts.shape[0]
    block = (d // ROW_BLOCK, ROW_BLOCK)
    rows = x.reshape(-1, *block)
    m = rows.shape[0]
    normed_dtype = fp8_matmul_mosaic.FP8 if into_fp8 else x.dtype
    out_type = [
        jax.ShapeDtypeStruct(rows.shape, x.dtype),
        jax.ShapeDtypeStruct(rows.shape, normed_dtype),
    ]
    if into_fp8:
        out_type.append(jax.ShapeDtypeStruct((m,), jnp.float32))  # the rows' scales
    if keep_rows:
        out_type.append(jax.ShapeDtypeStruct(rows.shape, x.dtype))  # the normed rows
    params = tma_ring.interpret_params(interpret)
    kernel = plgpu.kernel(
        functools.partial(
            _row_kernel,
            eps=eps,
            width=d,
            into_fp8=into_fp8,
            keep_rows=keep_rows,
            interpreting=params is not None,
        ),
        out_type=tuple(out_type),
        grid=(m,),
        grid_names=("row",),
        scratch_types=[
            plgpu.SMEM(block, x.dtype),  # x's row
            plgpu.SMEM((splits, *block), parts.dtype),  # y's slices of the row
            plgpu.SMEM(block, x.dtype),  # the scale
            plgpu.Barrier(num_barriers=2 + splits),  # x, scale, each slice of y
            plgpu.SMEM(block, x.dtype),  # h
            plgpu.SMEM(block, normed_dtype),  # normed, or its e4m3 values
            *([plgpu.SMEM(block, x.dtype)] if keep_rows else []),  # the normed rows kept
        ],
        interpret=params,
    )
    h, normed, *more = kernel(rows, parts.reshape(splits, m, *block), scale.reshape(block))
    lead = x.shape[:-1]
    if into_fp8:
        kept = more[1].reshape(x.shape) if keep_rows else None
        return h.reshape(x.shape), QuantizedRows(
            normed.reshape(x.shape), more[0].reshape(lead), x.dtype, kept
        )
    return h.reshape(x.shape), normed.reshape(x.shape)
