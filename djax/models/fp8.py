"""fp8 weights: every projection and expert weight stored as float8_e4m3fn values with an
fp32 scale per output channel, and the products that take them.

A weight `w` whose contraction axes are `axes` is stored as `values = w / scale` in e4m3
(rounded to nearest) and `scale = max |w| over axes / E4M3_MAX` (1 where that max is 0), so
every value lies in [-E4M3_MAX, E4M3_MAX] and `values * scale` is `w` within e4m3's
precision (a relative error of at most 2^-4 per element, half a unit in its 3-bit
mantissa, above e4m3's smallest normal). The params dict holds the values under the
weight's own name and the scale beside it under `<name>_scale`; the layers read the two as
one `Fp8Weight`.

Which weights: the attention's `qkv` and `attn_out`, the dense and shared MLPs' `gate_up`
and `down`, and the experts' stacked `gate_up` and `down`. The embedding, norms, router,
expert bias and the output head stay in the model's dtype.

Products (`Kernels.fp8`): `dequant` converts the values to the rows' dtype inside XLA's
dot (whose result is in the rows' dtype, as with weights of the model's dtype) and scales
it per output channel in fp32; `scaled` also quantises the rows to e4m3
(one scale per row, over the contraction axis) and runs an fp8 x fp8 dot accumulating in
fp32, scaled by both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from djax.config import WEIGHTS, check_weights

__all__ = ["WEIGHTS", "check_weights", "Fp8Weight", "quantize", "dequantize", "quantize_params"]

Array = jax.Array

FP8 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8).max)  # 448
SCALE_SUFFIX = "_scale"


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight as fp8 `values` (e4m3, the weight's shape) and the fp32 `scale` of each
    output channel (the shape of `values` without its contraction axes)."""

    values: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def reshape(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> Fp8Weight:
        """The values as `shape`, the scale as `scale_shape` (the same channels)."""
        return Fp8Weight(self.values.reshape(shape), self.scale.reshape(scale_shape))


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["values", "scale"], meta_fields=[])

Weight = Array | Fp8Weight


def matrix(w: Weight, k: int, n: int) -> Weight:
    """`w` as a [k, n] matrix (its contraction axes first, flattened to k); an
    `Fp8Weight`'s scale as [n]."""
    return w.reshape((k, n), (n,)) if isinstance(w, Fp8Weight) else w.reshape(k, n)


def contraction_axes(name: str, ndim: int) -> tuple[int, ...] | None:
    """The contraction axes of the param `name` (its leaf key) of `ndim` axes where it is
    stored in fp8, else None: `qkv` [model, kv_heads, group + 2, head_dim] over model,
    `attn_out` [kv_heads, group, head_dim, model] over all but model, `gate_up`
    [model, 2, hidden] and `down` [hidden, model] over their first axis, the experts'
    `gate_up` [experts, model, 2, ffn] and `down` [experts, ffn, model] over their second."""
    if name == "qkv":
        return (0,)
    if name == "attn_out":
        return (0, 1, 2)
    if name == "gate_up":
        return (1,) if ndim == 4 else (0,)
    if name == "down":
        return (1,) if ndim == 3 else (0,)
    return None


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def values_name(name: str) -> str | None:
    """The values' name of a scale's param name, or None where `name` is no scale."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def quantize(w: Array, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """`w` -> (e4m3 values of w's shape, fp32 scale of w's shape without `axes`)."""
    wf = w.astype(jnp.float32)
    peak = jnp.max(jnp.abs(wf), axis=axes, keepdims=True)
    scale = jnp.where(peak > 0, peak / E4M3_MAX, 1.0)
    values = jnp.clip(wf / scale, -E4M3_MAX, E4M3_MAX).astype(FP8)
    return values, jnp.squeeze(scale, axes)


def dequantize(values: Array, scale: Array, axes: tuple[int, ...], dtype: Any) -> Array:
    """`values * scale` in `dtype` (`quantize`'s inverse within e4m3's precision)."""
    return (values.astype(jnp.float32) * jnp.expand_dims(scale, axes)).astype(dtype)


def quantize_params(params: dict, shardings: dict | None = None) -> dict:
    """A params dict with every fp8 weight (`contraction_axes`) quantised: its values under
    its name, its scale under `<name>_scale`; other params as they are. Each weight is
    quantised by its own jitted call (placed per `shardings`, a pytree like the result, when
    given), so at most one weight is held twice."""
    out: dict = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = quantize_params(value, None if shardings is None else shardings[key])
            continue
        axes = contraction_axes(key, value.ndim)
        if axes is None:
            out[key] = value
            continue
        placed = None if shardings is None else (shardings[key], shardings[scale_name(key)])
        out[key], out[scale_name(key)] = _quantizer(axes, placed)(value)
    return out


def without_scales(tree: dict) -> dict:
    """A pytree like the params with the scales (`<name>_scale`) left out: the layout of
    the same model's params in its dtype."""
    return {
        key: without_scales(value) if isinstance(value, dict) else value
        for key, value in tree.items()
        if values_name(key) is None
    }


_QUANTIZERS: dict = {}


def _quantizer(axes: tuple[int, ...], shardings: Any) -> Any:
    key = (axes, shardings)
    if key not in _QUANTIZERS:
        _QUANTIZERS[key] = jax.jit(lambda w: quantize(w, axes), out_shardings=shardings)
    return _QUANTIZERS[key]


def scale_spec(values_spec: PartitionSpec, axes: tuple[int, ...], ndim: int) -> PartitionSpec:
    """The `PartitionSpec` of a scale: its values' spec (of `ndim` axes) without the
    contraction `axes`, so each device holds the scales of the output channels it holds."""
    full = tuple(values_spec) + (None,) * (ndim - len(values_spec))
    return PartitionSpec(*(s for i, s in enumerate(full) if i not in axes))


def einsum(subscripts: str, x: Array, w: Weight, impl: str = "no") -> Array:
    """`jnp.einsum(subscripts, x, w)` in x's dtype, where `w` may be an `Fp8Weight`.

    The product's rule for an `Fp8Weight`: x's contraction axis is its last; the output
    holds x's other axes first, in order, and ends with the scale's axes, in order (every
    product of the layers is of this form). `impl` is `Kernels.fp8`: `dequant` or `scaled`
    (see the module's docstring).
    """
    if not isinstance(w, Fp8Weight):
        return jnp.einsum(subscripts, x, w)
    if impl == "scaled":
        rows, x_scale = quantize(x, (x.ndim - 1,))
        y = jnp.einsum(subscripts, rows, w.values, preferred_element_type=jnp.float32)
        x_scale = x_scale.reshape(x_scale.shape + (1,) * (y.ndim - x_scale.ndim))
        return (y * x_scale * w.scale).astype(x.dtype)
    if impl != "dequant":
        raise ValueError(f"an Fp8Weight's product takes fp8='dequant' or 'scaled'; got {impl!r}")
    y = jnp.einsum(subscripts, x, w.values.astype(x.dtype))
    return (y.astype(jnp.float32) * w.scale).astype(x.dtype)


def ragged_dot(x: Array, w: Weight, group_sizes: Array, impl: str = "no") -> Array:
    """`jax.lax.ragged_dot(x [p, k], w [groups, k, n], group_sizes)` -> [p, n] in x's dtype,
    where `w` may be an `Fp8Weight` (scale [groups, n]: each row takes its group's scales;
    rows past sum(group_sizes) take the last group's)."""
    if not isinstance(w, Fp8Weight):
        return jax.lax.ragged_dot(x, w, group_sizes)
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")
    scale = w.scale[jnp.minimum(row_group, w.scale.shape[0] - 1)]  # [p, n]
    if impl == "scaled":
        rows, x_scale = quantize(x, (1,))
        y = jax.lax.ragged_dot(rows, w.values, group_sizes, preferred_element_type=jnp.float32)
        return (y * x_scale[:, None] * scale).astype(x.dtype)
    if impl != "dequant":
        raise ValueError(f"an Fp8Weight's product takes fp8='dequant' or 'scaled'; got {impl!r}")
    y = jax.lax.ragged_dot(x, w.values.astype(x.dtype), group_sizes)
    return (y.astype(jnp.float32) * scale).astype(x.dtype)


def param(module: Any, name: str, init: Any, shape: tuple[int, ...], dtype: Any, weights: str):
    """The Flax param `name` of `module`: an array of `dtype` (weights `dtype`), or under
    `fp8` an `Fp8Weight` of the params `name` (e4m3 values) and `<name>_scale` (fp32).

    Under `fp8`, `init` is not used: the values start at 0 and the scales at 1 (random fp8
    params are `quantize_params` of random ones, `djax.models.init_params`)."""
    if weights != "fp8":
        return module.param(name, init, shape, dtype)
    axes = contraction_axes(name, len(shape))
    out_shape = tuple(n for i, n in enumerate(shape) if i not in axes)
    values = module.param(name, jax.nn.initializers.zeros, shape, FP8)
    scale = module.param(scale_name(name), jax.nn.initializers.ones, out_shape, jnp.float32)
    return Fp8Weight(values, scale)
