"""LLaDA2.0 (LLaDA2.0-mini, LLaDA2.0-flash): a block-diffusion mixture of experts, and its HF
name map.

Attention is djax's: one fused q/k/v product (GQA), a per-head RMSNorm on q and k before
RoPE, RoPE on the first `rotary_dim` features of each head (partial rotary). The first
`first_k_dense_replace` layers have a SwiGLU MLP; the others a mixture of experts with a
shared expert always added. The router (`route_grouped`) takes fp32 sigmoid scores, chooses
experts on the scores plus `expert_bias` within the best groups, and weights the chosen
experts by their unbiased scores, renormalised and times `routed_scaling_factor`.

Generation is block diffusion (`djax.block_diffusion`): the attention mask is block-causal,
blocks aligned at position 0, which `djax.forward_logits(..., block_length=B)` also gives.

HF layout (torch Linear weights `[out, in]`): `model.word_embeddings`, per layer `i`
`model.layers.{i}.{input,post_attention}_layernorm`,
`...attention.query_key_value` (all query heads, then the key heads, then the value heads),
`...attention.dense` (and its `.bias` under `use_bias`), `...attention.{query,key}_layernorm`;
dense layers `...mlp.{gate,up,down}_proj`; MoE layers `...mlp.gate.weight`,
`...mlp.gate.expert_bias`, `...mlp.experts.{j}.{gate,up,down}_proj`,
`...mlp.shared_experts.{gate,up,down}_proj`; `model.norm`, `lm_head`.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig
from djax.models.layers import TransformerLM
from djax.models.llada_moe import MoEBlock, _mlp_sources, expert_sources
from djax.models.sources import Index, ParamSource, Tensor, TensorStore, copy, transposed

Array = jax.Array


def route_grouped(
    x: Array,
    router: Array,
    expert_bias: Array,
    top_k: int,
    groups: int,
    groups_per_token: int,
    scaling: float,
) -> tuple[Array, Array]:
    """LLaDA2's group-limited sigmoid router, in fp32. x: [n, model]; router: [model,
    experts]; expert_bias: [experts].

    scores = sigmoid(x @ router); each group of experts scores the sum of its two best
    biased scores (scores + expert_bias); the `groups_per_token` best groups stay; the top_k
    biased scores inside them choose the experts; their weights are the unbiased scores,
    divided by their sum (+1e-20) when top_k > 1, times `scaling`.
    Returns (weights [n, top_k] fp32, experts [n, top_k] int32).
    """
    logits = jnp.einsum("nm,me->ne", x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    biased = scores + expert_bias.astype(jnp.float32)
    n, e = biased.shape
    by_group = biased.reshape(n, groups, e // groups)
    group_score = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)  # [n, groups]
    _, kept = jax.lax.top_k(group_score, groups_per_token)
    kept_group = jnp.any(kept[:, :, None] == jnp.arange(groups), axis=1)  # [n, groups]
    eligible = jnp.where(kept_group[:, :, None], by_group, -jnp.inf).reshape(n, e)
    _, experts = jax.lax.top_k(eligible, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if top_k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


class LLaDA2MoEBlock(MoEBlock):
    """LLaDA-MoE's expert paths and shared expert, routed by `route_grouped`."""

    def route(self, x: Array, router: Array, expert_bias: Array | None) -> tuple[Array, Array]:
        cfg = self.config
        return route_grouped(
            x,
            router,
            expert_bias,
            cfg.experts_per_token,
            cfg.expert_groups,
            cfg.groups_per_token,
            cfg.routed_scaling,
        )


class LLaDA2(TransformerLM):
    """LLaDA2: SwiGLU in the first `first_k_dense_replace` layers, experts in the rest."""

    def feed_forward(self, layer: int) -> nn.Module:
        cfg = self.config
        if not cfg.moe_layers[layer]:
            return self.gated_mlp(layer)
        return LLaDA2MoEBlock(
            cfg,
            self.dtype,
            axis_name=self.axis_name,
            shards=self.shards,
            split_experts=self.split_experts,
            weights=self.kernels.weights,
            k_major=self.kernels.k_major,
            name=f"ff_{layer}",
        )


@dataclasses.dataclass(frozen=True)
class FusedQKV:
    """A fused `query_key_value` weight `[(heads + 2 kv_heads) * head_dim, model]` (every
    query head, then every key head, then every value head) read as djax's q/k/v
    arrangement [kv_heads, group + 2, head_dim, model]: per kv head its `group` query heads,
    its key head and its value head. A slice reads only the rows of its heads."""

    name: str
    kv_heads: int
    group: int
    head_dim: int
    d_model: int

    @property
    def heads(self) -> np.ndarray:
        """[kv_heads, group + 2]: the stored head (row block) at each raw place."""
        kv, g = self.kv_heads, self.group
        query = np.arange(kv * g).reshape(kv, g)
        return np.concatenate(
            [query, kv * g + np.arange(kv)[:, None], kv * (g + 1) + np.arange(kv)[:, None]],
            axis=1,
        )

    @property
    def stored(self) -> tuple[int, int]:
        return ((self.group + 2) * self.kv_heads * self.head_dim, self.d_model)

    def names(self) -> list[str]:
        return [self.name]

    def raw_shape(self, store: TensorStore) -> tuple[int, ...]:
        """ValueError when the stored tensor is not `[(heads + 2 kv_heads) * head_dim, model]`."""
        actual = tuple(store.view(self.name).shape)
        if actual != self.stored:
            raise ValueError(f"tensor {self.name!r} has shape {actual}; expected {self.stored}")
        return (self.kv_heads, self.group + 2, self.head_dim, self.d_model)

    def read(self, store: TensorStore, index: Index) -> np.ndarray:
        rows = self.heads[index[0], index[1]]  # [kv', slots']
        view = store.view(self.name).reshape(-1, self.head_dim, self.d_model)
        picked = view[rows.reshape(-1)][:, index[2], index[3]]
        return np.asarray(picked).reshape(rows.shape + picked.shape[1:])

    def split(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        """The stored tensor of a raw array (the inverse of `read`)."""
        out = np.empty((self.heads.size, self.head_dim, self.d_model), raw.dtype)
        out[self.heads.reshape(-1)] = raw.reshape(-1, self.head_dim, self.d_model)
        return {self.name: out.reshape(self.stored)}


def hf_sources(config: ModelConfig) -> list[ParamSource]:
    """Where each djax param comes from in an HF LLaDA2 folder; experts are stacked (fused)
    while loading."""
    kv, d, m = config.n_kv_heads, config.head_dim, config.d_model
    group = config.n_heads // kv
    sources = [
        copy(("embed",), "model.word_embeddings.weight"),
        copy(("final_norm", "scale"), "model.norm.weight"),
        transposed(("lm_head",), "lm_head.weight"),
    ]
    for i in range(config.n_layers):
        hf = f"model.layers.{i}"
        att = f"{hf}.attention"
        out = Tensor(f"{att}.dense.weight", (m, kv, group, d), (m, kv * group * d))
        sources += [
            copy((f"attn_norm_{i}", "scale"), f"{hf}.input_layernorm.weight"),
            copy((f"ff_norm_{i}", "scale"), f"{hf}.post_attention_layernorm.weight"),
            ParamSource(
                (f"attn_{i}", "qkv"),
                FusedQKV(f"{att}.query_key_value.weight", kv, group, d, m),
                (3, 0, 1, 2),
            ),
            ParamSource((f"attn_{i}", "attn_out"), out, (1, 2, 3, 0)),
        ]
        if config.attn_out_bias:
            sources.append(copy((f"attn_{i}", "attn_out_bias"), f"{att}.dense.bias"))
        if config.qk_norm:
            sources += [
                copy((f"attn_{i}", "q_norm", "scale"), f"{att}.query_layernorm.weight"),
                copy((f"attn_{i}", "k_norm", "scale"), f"{att}.key_layernorm.weight"),
            ]
        ff = f"ff_{i}"
        if not config.moe_layers[i]:
            sources += _mlp_sources((ff,), f"{hf}.mlp")
            continue
        sources += [
            transposed((ff, "router"), f"{hf}.mlp.gate.weight"),
            copy((ff, "expert_bias"), f"{hf}.mlp.gate.expert_bias"),
            *expert_sources(ff, f"{hf}.mlp.experts", config.n_experts),
        ]
        if config.shared_expert_hidden:
            sources += _mlp_sources((ff, "shared"), f"{hf}.mlp.shared_experts")
    return sources
