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
and `down`, the experts' stacked `gate_up` and `down`, and the output head `lm_head`
[model, vocab] (a scale per vocabulary entry). The embedding, norms, router and expert
bias stay in the model's dtype.

Products (`Kernels.fp8`): `dequant` converts the values to the rows' dtype inside XLA's
dot (whose result is in the rows' dtype, as with weights of the model's dtype) and scales
it per output channel in fp32; `scaled` also quantises the rows to e4m3
(one scale per row, over the contraction axis) and runs an fp8 x fp8 dot accumulating in
fp32, scaled by both. Under a mesh a row is quantised where its product runs: where the
contraction is split over devices (the attention output and `down` under tensor
parallelism, the attention output wherever the heads are split), each device's share of a
row takes a scale of its own, and the partial products, each scaled by its own, are
summed; so `scaled` on a mesh rounds the rows otherwise than on one device. Outside XLA:
the parts a kernel choice marks `fp8_mosaic` run the
`scaled` product in `djax.kernels.fp8_matmul_mosaic` (the experts under `moe="fp8_mosaic"`
in `djax.kernels.expert_tiles_mosaic.expert_mlp_fp8`, whose activation takes a scale per
row of each 128 columns, `quantize_slices`, where `scaled` takes one per row), and
`moe="mosaic"` converts the
experts' e4m3 tiles inside `djax.kernels.expert_tiles_mosaic`.

The head's product is XLA's (`einsum`, in fp32: the logits), by the block forward's
`Kernels.fp8`.

Layout: fp8 x fp8 WGMMA reads the values K-major, so where those kernels run
(`Model.k_major`, `kernel_choice.holds_k_major`) a model holds the dense products' and the
experts' values output axes first (`k_major_order`, moved by `to_layout`;
`Fp8Weight.k_major`); checkpoints always hold the layout above.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from djax.config import WEIGHTS, check_weights
from djax.kernels.fp8_matmul_mosaic import E4M3_MAX, FP8, quantize

__all__ = [
    "E4M3_MAX",
    "FP8",
    "WEIGHTS",
    "check_weights",
    "Fp8Weight",
    "quantize",
    "dequantize",
    "quantize_params",
    "to_layout",
    "Layout",
]

Array = jax.Array

SCALE_SUFFIX = "_scale"


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight as fp8 `values` (e4m3) and the fp32 `scale` of each output channel (the
    weight's shape without its contraction axes). `values` has the weight's shape (its
    `leading` axes, the experts' axis of an expert weight, then the contraction axes, then
    the other output axes), or with `k_major` the scale's axes first and the contraction
    axes last (the layout the fp8 Mosaic GPU kernels read). `shape` is the weight's shape
    either way."""

    values: Array
    scale: Array
    k_major: bool = False
    leading: int = 0

    @property
    def contraction(self) -> int:
        """The number of contraction axes."""
        return self.values.ndim - self.scale.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.values.shape
        if not self.k_major:
            return shape
        lead, channels = self.leading, self.scale.ndim
        return shape[:lead] + shape[channels:] + shape[lead:channels]

    def reshape(self, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> Fp8Weight:
        """The weight as `shape` (its `leading` axes, then its contraction axes), the scale
        as `scale_shape` (the same channels); K-major values stay K-major."""
        values_shape = shape
        if self.k_major:
            lead, contraction = self.leading, len(shape) - len(scale_shape)
            values_shape = tuple(scale_shape) + tuple(shape[lead : lead + contraction])
        return Fp8Weight(
            self.values.reshape(values_shape),
            self.scale.reshape(scale_shape),
            self.k_major,
            self.leading,
        )

    def operand(self, subscripts: str) -> str:
        """The einsum subscripts of `values` for a weight written `subscripts` (its own
        layout): the same, or K-major the scale's letters first."""
        if not self.k_major:
            return subscripts
        lead, end = self.leading, self.leading + self.contraction
        return subscripts[:lead] + subscripts[end:] + subscripts[lead:end]


jax.tree_util.register_dataclass(
    Fp8Weight, data_fields=["values", "scale"], meta_fields=["k_major", "leading"]
)

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
    `gate_up` [experts, model, 2, ffn] and `down` [experts, ffn, model] over their second,
    `lm_head` [model, vocab] over model."""
    if name in ("qkv", "lm_head"):
        return (0,)
    if name == "attn_out":
        return (0, 1, 2)
    if name == "gate_up":
        return (1,) if ndim == 4 else (0,)
    if name == "down":
        return (1,) if ndim == 3 else (0,)
    return None


def k_major_order(name: str, ndim: int) -> tuple[int, ...] | None:
    """The axis order that makes the values of the fp8 param `name` of `ndim` axes K-major
    (`Fp8Weight.k_major`: its output axes, then its contraction axes), as the Mosaic GPU
    kernels read them: the dense products' and the experts' (`gate_up` [experts, 2, ffn,
    model], `down` [experts, model, ffn]); None for every other param, the head's
    included (XLA's product reads it as stored)."""
    axes = contraction_axes(name, ndim)
    if axes is None or name == "lm_head":
        return None
    return tuple(i for i in range(ndim) if i not in axes) + axes


def to_layout(params: dict, k_major: bool, shardings: dict | None = None) -> dict:
    """fp8 params (`quantize_params`' layout, or K-major) with the fp8 values
    (`k_major_order`: the dense products' and the experts') K-major (`k_major`) or in
    their own layout; every other param as it is (the same array). The values move in
    one program (`Layout`) into new arrays, placed per `shardings` (a pytree like the
    result, in the new layout: `sharding.param_shardings`) when given; the old ones are
    freed once `params` is dropped. The dict does not record its layout: the caller
    (`djax.load`, `Model.with_options`) knows the layout it holds."""
    return Layout.of(params, k_major, shardings)(params)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The move of a params tree's fp8 values into a layout (`to_layout`'s rule) as one
    jitted program over the moved values alone (keyed by their paths in the tree).
    `compile_ahead` compiles it for the params an abstract tree describes
    (shapes, dtypes, shardings) on a thread, to overlap the read of the params; a call on
    params whose values are not the ones compiled for runs the jitted program."""

    paths: tuple[tuple[str, ...], ...]
    program: Any  # jitted: {path: values} -> {path: values moved}
    compiled: Any = None  # a Future of `program` compiled for `avals`, or None
    avals: Any = None

    @classmethod
    def of(cls, params: dict, k_major: bool, shardings: dict | None = None) -> Layout:
        """The move of `params` (arrays or `jax.ShapeDtypeStruct`s) into `k_major`."""
        moves = tuple(_moves(params, k_major, shardings, ()).items())
        if moves not in _PROGRAMS:  # one jitted program per move: its compiles are kept
            orders = {path: order for path, (order, _) in moves}
            placed = None if shardings is None else {path: s for path, (_, s) in moves}

            def move(values: dict) -> dict:
                return {path: jnp.transpose(v, orders[path]) for path, v in values.items()}

            _PROGRAMS[moves] = jax.jit(move, out_shardings=placed)
        return cls(tuple(path for path, _ in moves), _PROGRAMS[moves])

    def compile_ahead(self, abstract: dict) -> Layout:
        """This move, its program lowered here and compiling on a thread for the params
        `abstract` describes (`jax.ShapeDtypeStruct`s with shardings)."""
        from concurrent.futures import ThreadPoolExecutor

        values = _values(abstract, self.paths)
        lowered = self.program.lower(values)  # here: a lowering holds the GIL, XLA does not
        pool = ThreadPoolExecutor(max_workers=1)
        compiled = pool.submit(lowered.compile)
        pool.shutdown(wait=False)
        return dataclasses.replace(self, compiled=compiled, avals=_avals(values))

    def __call__(self, params: dict) -> dict:
        values = _values(params, self.paths)
        program = self.program
        if self.compiled is not None and _avals(values) == self.avals:
            program = self.compiled.result()
        out = _copy_dicts(params)
        for path, moved in program(values).items():
            _leaf_parent(out, path)[path[-1]] = moved
        return out


_PROGRAMS: dict = {}


def _moves(params: dict, k_major: bool, shardings: dict | None, prefix: tuple) -> dict:
    """{path: (axis order, sharding or None)} of the fp8 values `to_layout` moves."""
    out: dict = {}
    for key, value in params.items():
        placed = None if shardings is None else shardings[key]
        if isinstance(value, dict):
            out.update(_moves(value, k_major, placed, prefix + (key,)))
            continue
        order = k_major_order(key, len(value.shape)) if scale_name(key) in params else None
        if order is None:
            continue
        if not k_major:
            order = tuple(order.index(i) for i in range(len(order)))  # the inverse
        out[prefix + (key,)] = (order, placed)
    return out


def _values(params: dict, paths: tuple) -> dict:
    return {path: _leaf_parent(params, path)[path[-1]] for path in paths}


def _leaf_parent(tree: dict, path: tuple) -> dict:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _copy_dicts(tree: dict) -> dict:
    return {k: _copy_dicts(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _avals(values: dict) -> dict:
    return {path: (v.shape, jnp.dtype(v.dtype), v.sharding) for path, v in values.items()}


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def values_name(name: str) -> str | None:
    """The values' name of a scale's param name, or None where `name` is no scale."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def dequantize(values: Array, scale: Array, axes: tuple[int, ...], dtype: Any) -> Array:
    """`values * scale` in `dtype` (`quantize`'s inverse within e4m3's precision)."""
    return (values.astype(jnp.float32) * jnp.expand_dims(scale, axes)).astype(dtype)


def quantize_params(params: dict, shardings: dict | None = None) -> dict:
    """A params dict with every fp8 weight (`contraction_axes`) quantised: its values under
    its name, its scale under `<name>_scale`; other params as they are. Each weight is
    quantised by its own jitted call (placed per `shardings`, a pytree like the result, when
    given). `params` stays whole with the caller meanwhile, so a load that quantises while
    loading holds the model in its dtype beside its fp8 copy at the end."""
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


def einsum(subscripts: str, x: Array, w: Weight, impl: str = "no", out_dtype: Any = None) -> Array:
    """`jnp.einsum(subscripts, x, w)` in `out_dtype` (default x's dtype; a wider one is
    accumulated in), where `w` may be an `Fp8Weight`.

    The product's rule for an `Fp8Weight`: x's contraction axis is its last; the output
    holds x's other axes first, in order, and ends with the scale's axes, in order (every
    product of the layers is of this form). `impl` is `Kernels.fp8`: `dequant` or `scaled`
    (see the module's docstring).
    """
    if not isinstance(w, Fp8Weight):
        if out_dtype is None:
            return jnp.einsum(subscripts, x, w)
        return jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype)
    out_dtype = out_dtype or x.dtype
    inputs, result = subscripts.split("->")
    x_subscripts, w_subscripts = inputs.split(",")
    subscripts = f"{x_subscripts},{w.operand(w_subscripts)}->{result}"
    if impl == "scaled":
        rows, x_scale = quantize(x, (x.ndim - 1,))
        y = jnp.einsum(subscripts, rows, w.values, preferred_element_type=jnp.float32)
        x_scale = x_scale.reshape(x_scale.shape + (1,) * (y.ndim - x_scale.ndim))
        return (y * x_scale * w.scale).astype(out_dtype)
    if impl != "dequant":
        raise ValueError(f"an Fp8Weight's product takes fp8='dequant' or 'scaled'; got {impl!r}")
    wider = None if out_dtype == x.dtype else out_dtype
    y = jnp.einsum(subscripts, x, w.values.astype(x.dtype), preferred_element_type=wider)
    return (y.astype(jnp.float32) * w.scale).astype(out_dtype)


def ragged_dot(x: Array, w: Weight, group_sizes: Array, impl: str = "no") -> Array:
    """`jax.lax.ragged_dot(x [p, k], w [groups, k, n], group_sizes)` -> [p, n] in x's dtype,
    where `w` may be an `Fp8Weight` (scale [groups, n]: each row takes its group's scales;
    rows past sum(group_sizes) take the last group's)."""
    if not isinstance(w, Fp8Weight):
        return jax.lax.ragged_dot(x, w, group_sizes)
    if w.k_major:
        raise ValueError(
            "ragged_dot: takes expert weights in their own layout; got a K-major weight (a "
            "model holding them so, Model.k_major, runs its experts in moe='fp8_mosaic' or "
            "'dense')"
        )
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


def param(
    module: Any,
    name: str,
    init: Any,
    shape: tuple[int, ...],
    dtype: Any,
    weights: str,
    k_major: bool = False,
):
    """The Flax param `name` of `module` (the weight's `shape`): an array of `dtype`
    (weights `dtype`), or under `fp8` an `Fp8Weight` of the params `name` (e4m3 values;
    with `k_major`, K-major, `k_major_order`) and `<name>_scale`
    (fp32).

    Under `fp8`, `init` is not used: the values start at 0 and the scales at 1 (random fp8
    params are `quantize_params` of random ones, `djax.models.init_params`)."""
    if weights != "fp8":
        return module.param(name, init, shape, dtype)
    axes = contraction_axes(name, len(shape))
    out_shape = tuple(n for i, n in enumerate(shape) if i not in axes)
    order = k_major_order(name, len(shape)) if k_major else None
    values_shape = shape if order is None else tuple(shape[i] for i in order)
    values = module.param(name, jax.nn.initializers.zeros, values_shape, FP8)
    scale = module.param(scale_name(name), jax.nn.initializers.ones, out_shape, jnp.float32)
    if order is None:
        return Fp8Weight(values, scale)
    return Fp8Weight(values, scale, True, leading=axes[0])
