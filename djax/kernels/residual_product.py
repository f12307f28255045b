"""A block layer's attention-output or down product with the residual add in its epilogue,
leaving the RMSNorm after it to the next product, as a Pallas Triton kernel.

Each program owns a `block_m x block_n` tile of the output over the whole contraction (no
split-K slices), so it can finish the tile: `h = residual + x @ w` (rounded as
`residual_norm.add_rms_norm` rounds it), `h * scale` (the norm's learned scale, which
multiplies the contraction dim of the next product and so must come before it), and the
tile's share of each row's sum of squares. The next product multiplies `h * scale` and
scales its accumulator rows by `1 / rms(h)` from the summed shares: the norm's kernel goes
away, and no operand is changed in registers before a product (which stops Triton's load
pipelining).

Unsplit, 4096 output columns are 128 programs of 32 columns, each streaming 64-byte runs
of its weight rows: their read rate has a ceiling of its own, below the fastest GPU
memories, so this form pays only where memory is no faster than that ceiling
(`norm_impl="fused"`); elsewhere the split-K product with `residual_norm.add_scaled` after
it (`"tiled"`) is faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling
from djax.kernels.handoff import ScaledRows, store_scaled_rows

Array = jax.Array


Tiles = tiling.ProductTiles


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """32-column tiles (128 programs at a 4096-wide model, one wave on 132 SMs) in up to
    256-wide steps, 4 stages."""
    return Tiles(
        block_m=tiling.row_block(m),
        block_n=tiling.largest_block(n, 32),
        block_k=tiling.largest_block(k, 256),
    )


def fits(k: int, n: int) -> bool:
    """Whether `residual_product` takes a contraction of `k` into `n` columns."""
    return tiling.matmul_fits(k, n)


def _kernel(x_ref, w_ref, res_ref, scale_ref, h_ref, scaled_ref, squares_ref, *, tiles, steps):
    """One output tile. Refs are whole arrays: x [m, k], w [k, n], residual, h, scaled
    [m, n], scale [n]; squares [n // block_n, m]."""
    from jax.experimental.pallas import triton as plgpu

    m = x_ref.shape[0]
    row_tile, column_tile = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(row_tile * tiles.block_m, tiles.block_m)
    cols = pl.ds(column_tile * tiles.block_n, tiles.block_n)
    row_ok = row_tile * tiles.block_m + jnp.arange(tiles.block_m) < m

    def step(i, acc):
        ks = pl.ds(i * tiles.block_k, tiles.block_k)
        x = plgpu.load(x_ref.at[rows, ks], mask=row_ok[:, None], other=0.0)
        return acc + jnp.dot(x, w_ref[ks, cols], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32))
    residual = plgpu.load(res_ref.at[rows, cols], mask=row_ok[:, None], other=0.0)
    y = acc.astype(h_ref.dtype).astype(jnp.float32)
    h = (residual.astype(jnp.float32) + y).astype(h_ref.dtype)
    scale = scale_ref[cols].astype(jnp.float32)
    outs = (h_ref, scaled_ref, squares_ref)
    store_scaled_rows(h, scale, outs, rows, cols, column_tile, row_ok)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def residual_product(
    x: Array,
    w: Array,
    residual: Array,
    scale: Array,
    eps: float,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> tuple[Array, ScaledRows]:
    """`h = residual + x @ w` and the inputs of the RMSNorm after it, in one kernel.

    x: [..., k]; w: [k, n]; residual: [..., n] in x's dtype; scale: [n], the norm's learned
    scale, and `eps` its epsilon. Returns (h,
    `ScaledRows`), h shaped and typed like residual. `tiles`: the program shape (default
    `tiles_for`); `interpret`: run in Pallas's interpreter (default: exactly off GPUs).
    """
    from jax.experimental.pallas import triton as plgpu

    k, n = w.shape
    if (
        x.shape[-1] != k
        or residual.shape != (*x.shape[:-1], n)
        or scale.shape != (n,)
        or not fits(k, n)
    ):
        raise ValueError(
            f"residual_product: x {x.shape}, w {w.shape}, residual {residual.shape}, scale "
            f"{scale.shape}; expected x [..., {k}], residual [..., {n}] and scale [{n}], with k "
            "and n multiples of 16"
        )
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    tiles = tiles or tiles_for(m, k, n)
    tiles.check(k, n)
    out = jax.ShapeDtypeStruct((m, n), residual.dtype)
    h, scaled, squares = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, steps=k // tiles.block_k),
        out_shape=[out, out, jax.ShapeDtypeStruct((n // tiles.block_n, m), jnp.float32)],
        grid=(pl.cdiv(m, tiles.block_m), n // tiles.block_n),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=tiling.interpret_mode(interpret),
        name="residual_product",
    )(rows, w, residual.reshape(m, n), scale)
    lead = residual.shape[:-1]
    return h.reshape(residual.shape), ScaledRows(
        scaled.reshape(residual.shape), squares.reshape(-1, *lead), eps
    )
