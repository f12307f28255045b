"""The residual add and the RMSNorm after it, in one Pallas Triton kernel: djax's GPU path
for the `h = x + y; rms_norm(h)` pairs between the blocks of a decoder layer.

In a block forward XLA runs each pair as two kernels (the add, and the norm, which
recomputes the add), twice per layer. At block rows both are far too small to be limited by
memory: they are launch- and latency-bound, so one kernel that writes `h` and the normed
rows together takes about the time of one.
Each program normalises one row across the whole model dim.

`y` may come as a split-K matmul's fp32 partial products (`handoff.Partials`): the kernel
adds them and rounds to the activation dtype first, as `Partials.total()` would, so XLA's
separate reduction kernel is not needed.

Semantics are `layers.rms_norm`'s: the sum in the activation dtype, the norm in fp32, cast
back, then times the scale in the activation dtype.

`add_scaled` does the add alone, tiled over columns, and leaves the norm to the next
product's kernel (`handoff.ScaledRows`): no program needs a whole row, so it spreads over
many more programs (`norm_impl="tiled"`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling
from djax.kernels.handoff import Partials, ScaledRows, add_slices, store_scaled_rows

Array = jax.Array


def _kernel(x_ref, y_ref, scale_ref, h_ref, normed_ref, *, eps, width):
    """One row. Refs are whole arrays: x, h, normed [m, d]; y [splits, m, d] (fp32 partial
    products, or x's dtype with one split); scale [d]."""
    from jax.experimental.pallas import triton as plgpu

    d = x_ref.shape[1]
    cols = pl.ds(0, width)
    ok = jnp.arange(width) < d
    row = pl.program_id(0)
    x = plgpu.load(x_ref.at[row, cols], mask=ok, other=0.0)
    parts = [
        plgpu.load(y_ref.at[jnp.int32(split), row, cols], mask=ok, other=0.0).astype(jnp.float32)
        for split in range(y_ref.shape[0])
    ]
    y = add_slices(parts, h_ref.dtype)
    h = (x.astype(jnp.float32) + y).astype(h_ref.dtype)
    hf = h.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(hf * hf) / d + eps)
    scale = plgpu.load(scale_ref.at[cols], mask=ok, other=0.0).astype(h.dtype)
    normed = (hf * inv_rms).astype(h.dtype).astype(jnp.float32) * scale.astype(jnp.float32)
    plgpu.store(h_ref.at[row, cols], h, mask=ok)
    plgpu.store(normed_ref.at[row, cols], normed.astype(normed_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def add_rms_norm(
    x: Array,
    y: Array | Partials,
    scale: Array,
    eps: float,
    num_warps: int = 16,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """`h = x + y` and `rms_norm(h, scale, eps)` in one kernel.

    x: [..., d]; y: [..., d] in x's dtype, or `Partials` of that shape and dtype; scale:
    [d]. Returns (h, normed), both shaped and typed like x. `num_warps`: per row (one
    program each). `interpret`: run in Pallas's interpreter
    (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import triton as plgpu

    d = x.shape[-1]
    parts = y.parts if isinstance(y, Partials) else y[None]
    if parts.shape[1:] != x.shape or y.dtype != x.dtype or scale.shape != (d,):
        raise ValueError(
            f"add_rms_norm: x {x.shape} {x.dtype}, y {parts.shape[1:]} {y.dtype}, scale "
            f"{scale.shape}; expected y shaped and typed like x and scale [{d}]"
        )
    rows = x.reshape(-1, d)
    out = jax.ShapeDtypeStruct(rows.shape, x.dtype)
    h, normed = pl.pallas_call(
        functools.partial(_kernel, eps=eps, width=max(16, pl.next_power_of_2(d))),
        out_shape=[out, out],
        grid=(rows.shape[0],),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=tiling.interpret_mode(interpret),
        name="add_rms_norm",
    )(rows, parts.reshape(parts.shape[0], -1, d), scale)
    return h.reshape(x.shape), normed.reshape(x.shape)


def _scaled_kernel(x_ref, y_ref, scale_ref, h_ref, scaled_ref, squares_ref, *, block_m, block_n):
    """One `block_m x block_n` tile. Refs are whole arrays: x, h, scaled [m, d]; y [splits,
    m, d]; scale [d]; squares [d // block_n, m]."""
    from jax.experimental.pallas import triton as plgpu

    m = x_ref.shape[0]
    row_tile, column_tile = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(row_tile * block_m, block_m)
    cols = pl.ds(column_tile * block_n, block_n)
    row_ok = row_tile * block_m + jnp.arange(block_m) < m
    ok = row_ok[:, None]
    x = plgpu.load(x_ref.at[rows, cols], mask=ok, other=0.0)
    parts = [
        plgpu.load(y_ref.at[jnp.int32(split), rows, cols], mask=ok, other=0.0)
        for split in range(y_ref.shape[0])
    ]
    y = add_slices([p.astype(jnp.float32) for p in parts], h_ref.dtype)
    h = (x.astype(jnp.float32) + y).astype(h_ref.dtype)
    scale = scale_ref[cols].astype(jnp.float32)
    outs = (h_ref, scaled_ref, squares_ref)
    store_scaled_rows(h, scale, outs, rows, cols, column_tile, row_ok)


@functools.partial(jax.jit, static_argnames=("eps", "block_n", "num_warps", "interpret"))
def add_scaled(
    x: Array,
    y: Array | Partials,
    scale: Array,
    eps: float,
    block_n: int | None = None,
    num_warps: int = 8,
    interpret: bool | None = None,
) -> tuple[Array, ScaledRows]:
    """`h = x + y` and the inputs of the RMSNorm after it (`ScaledRows`: `h * scale` and
    each column tile's share of the rows' sums of squares), for a consumer kernel that
    applies `1 / rms(h)` to its own product's rows. Unlike `add_rms_norm` no program needs
    a whole row, so the work spreads over `d / block_n` column tiles (128 programs at
    LLaDA-8B's width) instead of one program per row.

    x: [..., d]; y: [..., d] in x's dtype, or `Partials` of that shape and dtype (summed and
    rounded first, as `Partials.total()` does); scale: [d], the norm's learned scale, and
    `eps` its epsilon. Returns (h, ScaledRows), h shaped and typed like x. `block_n`:
    columns per program (default: the largest power of two up to 32 dividing d).
    """
    from jax.experimental.pallas import triton as plgpu

    d = x.shape[-1]
    block_n = block_n or tiling.largest_block(d, 32)
    parts = y.parts if isinstance(y, Partials) else y[None]
    if (
        parts.shape[1:] != x.shape
        or y.dtype != x.dtype
        or scale.shape != (d,)
        or not tiling.is_block(block_n)
        or d % block_n
    ):
        raise ValueError(
            f"add_scaled: x {x.shape} {x.dtype}, y {parts.shape[1:]} {y.dtype}, scale "
            f"{scale.shape}, block_n {block_n}; expected y shaped and typed like x, scale "
            f"[{d}] and block_n a power of two >= 16 dividing {d}"
        )
    rows = x.reshape(-1, d)
    m = rows.shape[0]
    block_m = tiling.row_block(m)
    out = jax.ShapeDtypeStruct((m, d), x.dtype)
    h, scaled, squares = pl.pallas_call(
        functools.partial(_scaled_kernel, block_m=block_m, block_n=block_n),
        out_shape=[out, out, jax.ShapeDtypeStruct((d // block_n, m), jnp.float32)],
        grid=(pl.cdiv(m, block_m), d // block_n),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=tiling.interpret_mode(interpret),
        name="add_scaled",
    )(rows, parts.reshape(parts.shape[0], m, d), scale)
    lead = x.shape[:-1]
    return h.reshape(x.shape), ScaledRows(scaled.reshape(x.shape), squares.reshape(-1, *lead), eps)
