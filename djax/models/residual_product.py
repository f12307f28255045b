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

Unsplit, 4096 output columns are 128 programs of 32 columns, each streaming 64-byte runs
of its weight rows. That reaches ~3.0 TB/s of kernel time on an H200: on an H100 (3.0 TB/s)
the LLaDA-8B output and down products with their residual add take 14.9 and 37.0 µs where
the split-K kernel and the norm kernel take 17.5 and 39.5; on an H200 (4.36 TB/s) 13.6 and
33.5 against 14.0 and 29.6 (bench.split_k --residual). A split-K form whose last slice per
tile finished the tile (an atomic count) took 13.3 and 29.2 on the H200 and did not speed
up the generation (code at 518c1f6).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.models import pallas_tiles

Array = jax.Array


Tiles = pallas_tiles.ProductTiles


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """32-column tiles (128 programs at a 4096-wide model, one wave on 132 SMs) in up to
    256-wide steps, 4 stages (bench.split_k --residual, H100: LLaDA-8B's output product
    14.95 µs and down 36.82 against 17.51 and 39.38 for the split-K kernel and the norm)."""
    return Tiles(
        block_m=pallas_tiles.row_block(m),
        block_n=pallas_tiles.largest_block(n, 32),
        block_k=pallas_tiles.largest_block(k, 256),
    )


def fits(k: int, n: int) -> bool:
    """Whether `residual_product` takes a contraction of `k` into `n` columns."""
    return pallas_tiles.matmul_fits(k, n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledRows:
    """Rows whose RMSNorm (with `eps`) is still to be applied: `scaled` [..., d] is
    `h * scale` in h's dtype, `squares` [tiles, ...] fp32 the per-column-tile sums of `h**2`
    over d."""

    scaled: Array
    squares: Array
    eps: float = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The rows' shape, [..., d]."""
        return self.scaled.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.scaled.dtype

    def reshape(self, *shape: int) -> ScaledRows:
        """The same rows as [*shape] (the last dim stays d)."""
        if shape[-1] != self.scaled.shape[-1]:
            raise ValueError(f"ScaledRows.reshape{shape}: the last dim must stay {self.shape[-1]}")
        lead = shape[:-1]
        return ScaledRows(
            self.scaled.reshape(shape),
            self.squares.reshape(self.squares.shape[0], *lead),
            self.eps,
        )

    def inv_rms(self) -> Array:
        """`1 / rms(h)` [..., 1] fp32."""
        d = self.scaled.shape[-1]
        return jax.lax.rsqrt(self.squares.sum(axis=0) / d + self.eps)[..., None]


def load_inv_rms(squares_ref, index: tuple, ok: Array, width: int, eps: float) -> Array:
    """Inside a consumer kernel: `1 / rms(h)` [rows, 1] fp32 of the rows at `index` (the
    indexers after the tile axis of `squares_ref` [tiles, ...], selecting a run of rows of
    which `ok` [rows] are real) from their per-tile sums of squares over `width` columns."""
    from jax.experimental.pallas import triton as plgpu

    tiles = squares_ref.shape[0]
    span = pl.next_power_of_2(tiles)
    tile_ok = jnp.arange(span) < tiles
    squares = plgpu.load(
        squares_ref.at[(pl.ds(0, span), *index)],
        mask=tile_ok[:, None] & ok[None, :],
        other=0.0,
    )
    return jax.lax.rsqrt(jnp.sum(squares, axis=0) / width + eps)[:, None]


def store_scaled_rows(h, scale, outs, rows, cols, column_tile, row_ok: Array) -> None:
    """Inside a kernel: an `h` tile [block_m, block_n] (in h's dtype) into `outs` = (h,
    scaled [m, n], squares [n // block_n, m]) refs at `rows` x `cols`: h itself, `h * scale`
    (scale [block_n] fp32) and the tile's share of each row's sum of squares, for rows
    where `row_ok` [block_m]."""
    from jax.experimental.pallas import triton as plgpu

    h_ref, scaled_ref, squares_ref = outs
    hf = h.astype(jnp.float32)
    plgpu.store(h_ref.at[rows, cols], h, mask=row_ok[:, None])
    plgpu.store(
        scaled_ref.at[rows, cols],
        (hf * scale[None, :]).astype(scaled_ref.dtype),
        mask=row_ok[:, None],
    )
    plgpu.store(squares_ref.at[column_tile, rows], jnp.sum(hf * hf, axis=1), mask=row_ok)


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
        interpret=pallas_tiles.interpret_mode(interpret),
        name="residual_product",
    )(rows, w, residual.reshape(m, n), scale)
    lead = residual.shape[:-1]
    return h.reshape(residual.shape), ScaledRows(
        scaled.reshape(residual.shape), squares.reshape(-1, *lead), eps
    )
