"""What djax's kernels hand each other instead of finished arrays: a split-K product's
fp32 partial sums (`Partials`, summed by the kernel that consumes them), rows whose
RMSNorm is still to be applied (`ScaledRows`, normed by the product kernel that reads them)
and normed rows already quantised for an fp8 product (`QuantizedRows`), and the in-kernel
helper that adds a product's slices."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

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
        lead = _lead(self, shape)
        return ScaledRows(
            self.scaled.reshape(shape),
            self.squares.reshape(self.squares.shape[0], *lead),
            self.eps,
        )

    def inv_rms(self) -> Array:
        """`1 / rms(h)` [..., 1] fp32."""
        d = self.scaled.shape[-1]
        return jax.lax.rsqrt(self.squares.sum(axis=0) / d + self.eps)[..., None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """Rows quantised for an fp8 x fp8 product by the kernel that made them (the norm,
    `residual_norm_mosaic.add_rms_norm(..., into_fp8=True)`; the gate/up and attention
    kernels, per slice): `values` [..., d] e4m3 and `scale` fp32, one a row [...] (the
    rows' `fp8_matmul_mosaic.quantize_rows`) or one a row and 128-column slice
    [d / 128, rows], rows all of the leading dims' (`quantize_slices`); `dtype` is the rows'
    own dtype before quantisation, the dtype of the products made of them. `rows`: the rows
    themselves [..., d] in `dtype`, where the kernel also kept them for a consumer that
    reads them unquantised (a MoE layer's router, `keep_rows=True`), else None."""

    values: Array
    scale: Array
    dtype: Any = dataclasses.field(metadata={"static": True})
    rows: Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The rows' shape, [..., d]."""
        return self.values.shape

    @property
    def per_slice(self) -> bool:
        """Whether `scale` is one a row and slice, [d / 128, rows] (with one slice of rows
        [1, t] both forms are the same values)."""
        return self.scale.shape != self.values.shape[:-1]

    def reshape(self, *shape: int) -> QuantizedRows:
        """The same rows as [*shape] (the last dim stays d; scales per slice as they are)."""
        lead = _lead(self, shape)
        rows = None if self.rows is None else self.rows.reshape(shape)
        scale = self.scale if self.per_slice else self.scale.reshape(lead)
        return QuantizedRows(self.values.reshape(shape), scale, self.dtype, rows)


def _lead(rows: ScaledRows | QuantizedRows, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The leading dims of `rows.reshape(*shape)`, whose last dim must stay the rows' d."""
    if shape[-1] != rows.shape[-1]:
        raise ValueError(
            f"{type(rows).__name__}.reshape{shape}: the last dim must stay {rows.shape[-1]}"
        )
    return shape[:-1]
