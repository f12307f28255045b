"""Model families, chosen by `ModelConfig.family`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from djax.config import DENSE, LLADA2, MOE, ModelConfig
from djax.models import fp8, llada, llada2, llada_moe
from djax.models.kernel_choice import KernelChoice
from djax.models.layers import TransformerLM, Window
from djax.models.sources import ParamSource

__all__ = ["build_module", "hf_sources", "abstract_params", "init_params", "Window"]

_FAMILIES = {
    DENSE: (llada.LLaDA, llada.hf_sources),
    MOE: (llada_moe.LLaDAMoE, llada_moe.hf_sources),
    LLADA2: (llada2.LLaDA2, llada2.hf_sources),
}


def build_module(
    config: ModelConfig,
    dtype: Any = jnp.float32,
    axis_name: str | None = None,
    kernels: KernelChoice | None = None,
    shards: int = 1,
    split_experts: bool = False,
) -> TransformerLM:
    """The Flax module of a config's family, following the resolved `kernels`
    (`kernel_choice.resolve`; XLA's paths by default) and holding params of its weight
    format (`kernels.weights`); `axis_name`, `shards` and `split_experts` describe its share
    of a mesh (`djax.sharding`)."""
    module_cls, _ = _FAMILIES[config.family]
    return module_cls(
        config,
        dtype=dtype,
        axis_name=axis_name,
        kernels=kernels or KernelChoice(),
        shards=shards,
        split_experts=split_experts,
    )


def hf_sources(config: ModelConfig) -> list[ParamSource]:
    """Where each param comes from in the family's HF folder layout."""
    return _FAMILIES[config.family][1](config)


def _init(config: ModelConfig, dtype: Any, key: jax.Array, weights: str = "dtype") -> dict:
    module = build_module(config, dtype, kernels=KernelChoice.xla(weights))
    x = jnp.zeros((1, 1, config.d_model), dtype)
    positions = jnp.zeros((1, 1), jnp.int32)
    return module.init(key, x, positions, jnp.ones((1, 1), bool))["params"]


def abstract_params(config: ModelConfig, dtype: Any, weights: str = "dtype") -> dict:
    """The params pytree as `jax.ShapeDtypeStruct`s (no memory), for weights of the format
    `weights` (`djax.models.fp8.WEIGHTS`). Each (config, dtype, weights) traces the model's
    init once per process (a load asks for the same tree more than once); every call
    returns a tree of its own."""
    tree = _abstract_params(config, jnp.dtype(dtype), fp8.check_weights(weights))
    return jax.tree.map(lambda leaf: leaf, tree)


@functools.lru_cache(maxsize=8)
def _abstract_params(config: ModelConfig, dtype: Any, weights: str) -> dict:
    """Traced for one layer of each kind (`_layer_kinds`), then repeated: a layer's params
    are named `<part>_<layer>` and their shapes depend on its kind alone, so the whole
    model's init need not be traced (~30 ms a layer)."""
    kinds = _layer_kinds(config)
    order = list(dict.fromkeys(kinds))  # each kind once, as the layers first meet it
    short = config.replace(n_layers=len(order))
    if config.moe_layers:
        short = short.replace(moe_layers=tuple(order))
    traced = jax.eval_shape(lambda: _init(short, dtype, jax.random.key(0), weights))
    params = {}
    for name, value in traced.items():
        part, sep, layer = name.rpartition("_")
        if not (sep and layer.isdigit()):
            params[name] = value
            continue
        for i, kind in enumerate(kinds):
            if order.index(kind) == int(layer):
                params[f"{part}_{i}"] = value
    return dict(sorted(params.items()))


def _layer_kinds(config: ModelConfig) -> tuple[bool, ...]:
    """What sets a layer's param shapes: whether it is a MoE layer (`moe_layers`, where
    a family mixes them), else nothing (every layer alike)."""
    return config.moe_layers or (False,) * config.n_layers


def init_params(
    config: ModelConfig, dtype: Any, seed: int = 0, shardings: Any = None, weights: str = "dtype"
) -> dict:
    """Random params (normal, std 0.02; norms at 1), built directly on the device(s); under
    `weights="fp8"` those of `dtype`, quantised (`fp8.quantize_params`)."""
    if fp8.check_weights(weights) == "fp8":
        placed = None if shardings is None else fp8.without_scales(shardings)
        return fp8.quantize_params(init_params(config, dtype, seed, placed), shardings)
    fn = jax.jit(lambda key: _init(config, dtype, key), out_shardings=shardings)
    return fn(jax.random.key(seed))
