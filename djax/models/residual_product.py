"""A block layer's attention-output or down product with the residual add in its epilogue,
leaving the RMSNorm after it to the next product, as a Pallas Triton kernel.

Each program owns a `block_m x block_n` tile of the output over the whole contraction (no
split-K slices), so it can finish the tile: `h = residual + x @ w` (rounded as
`residual_norm.add_rms_norm` rounds it), `h * scale` (the norm's learned scale, which
multiplies the contraction dim of the next product and so must come before it), and the
tile's share of each row's sum of squares. The next product multiplies `h * scale` and
scales its accumulator rows by `1 / rms(h)` from the summed shares: the norm's kernel goes
away, and no operand is changed in registers before a product (which stops Triton's load
pipelining, bench/NOTES.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.models import pallas_tiles

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape: a `block_m x block_n` output tile in `block_k` contraction steps;
    Triton's `num_warps` and `num_stages`."""

    block_m: int = 32
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledRows:
    """Rows whose RMSNorm is still to be applied: `scaled` [..., d] is `h * scale` in h's
    dtype, `squares` [tiles, ...] fp32 the per-column-tile sums of `h**2` over d."""

    scaled: Array
    squares: Array

    def inv_rms(self, eps: float) -> Array:
        """`1 / rms(h)` [..., 1] fp32."""
        d = self.scaled.shape[-1]
        return jax.lax.rsqrt(self.squares.sum(axis=0) / d + eps)[..., None]


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
    hf = h.astype(jnp.float32)
    scale = scale_ref[cols].astype(jnp.float32)
    plgpu.store(h_ref.at[rows, cols], h, mask=row_ok[:, None])
    plgpu.store(
        scaled_ref.at[rows, cols],
        (hf * scale[None, :]).astype(scaled_ref.dtype),
        mask=row_ok[:, None],
    )
    plgpu.store(squares_ref.at[column_tile, rows], jnp.sum(hf * hf, axis=1), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def residual_product(
    x: Array,
    w: Array,
    residual: Array,
    scale: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> tuple[Array, ScaledRows]:
    """`h = residual + x @ w` and the next RMSNorm's inputs, in one kernel.

    x: [..., k]; w: [k, n]; residual: [..., n] in x's dtype; scale: [n]. Returns (h,
    `ScaledRows`), h shaped and typed like residual. `tiles`: the program shape (default
    `Tiles()`); `interpret`: run in Pallas's interpreter (default: exactly off GPUs).
    """
    from jax.experimental.pallas import triton as plgpu

    k, n = w.shape
    if x.shape[-1] != k or residual.shape != (*x.shape[:-1], n) or scale.shape != (n,):
        raise ValueError(
            f"residual_product: x {x.shape}, w {w.shape}, residual {residual.shape}, scale "
            f"{scale.shape}; expected x [..., {k}], residual [..., {n}] and scale [{n}]"
        )
    tiles = tiles or Tiles()
    blocks = (tiles.block_m, tiles.block_n, tiles.block_k)
    if not all(map(pallas_tiles.is_block, blocks)) or n % tiles.block_n or k % tiles.block_k:
        raise ValueError(
            f"{tiles}: blocks must be powers of two >= 16, block_n dividing n = {n} and "
            f"block_k dividing k = {k}"
        )
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = jax.ShapeDtypeStruct((m, n), residual.dtype)
    h, scaled, squares = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, steps=k // tiles.block_k),
        out_shape=[out, out, jax.ShapeDtypeStruct((n // tiles.block_n, m), jnp.float32)],
        grid=(pl.cdiv(m, tiles.block_m), n // tiles.block_n),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=pallas_tiles.interpret_mode(interpret),
        name="residual_product",
    )(rows, w, residual.reshape(m, n), scale)
    lead = residual.shape[:-1]
    return h.reshape(residual.shape), ScaledRows(
        scaled.reshape(residual.shape), squares.reshape(-1, *lead)
    )
