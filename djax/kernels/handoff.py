"""What djax's kernels hand each other instead of finished arrays: a split-K product's
fp32 partial sums (`Partials`, summed by the kernel that consumes them) and rows whose
RMSNorm is still to be applied (`ScaledRows`, normed by the product kernel that reads them),
with the in-kernel helpers that produce and consume them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Partials:
    """Partial products of a split-K matmul: `parts` [splits, ..., n] fp32, whose sum,
    rounded to `dtype`, is the product."""

    parts: Array
    dtype: Any = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The product's shape."""
        return self.parts.shape[1:]

    def total(self) -> Array:
        """The product: [..., n] in `dtype`."""
        return self.parts.sum(axis=0).astype(self.dtype)


def add_slices(slices: list[Array], dtype) -> Array:
    """Inside a consumer kernel: loaded fp32 slices of a product added and rounded to
    `dtype` as `Partials.total()` does, then back in fp32 for the kernel's own math."""
    return sum(slices[1:], slices[0]).astype(dtype).astype(jnp.float32)


def finish(y: Array | Partials) -> Array:
    """A product that may still be in partials, summed."""
    return y.total() if isinstance(y, Partials) else y


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledRows:
    """Rows whose RMSNorm (with `eps`) is still to be applied: `scaled` [..., d] is
    `h * scale` in h's dtype, `squares` [tiles, ...] fp32 the per-column-tile sums of `h**2`
    over d, h as stored (rounded to its dtype, then squared and summed in fp32)."""

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
