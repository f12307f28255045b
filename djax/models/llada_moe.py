"""LLaDA-MoE (LLaDA-MoE-7B-A1B): OLMoE-style bidirectional mixture of experts, and its
HF name map.

Routing follows the LLaDA-MoE reference: router logits in fp32, softmax over all experts,
optional per-expert bias added to the probabilities, top-k of the (biased) probabilities
as the weights, renormalised only when `norm_topk_prob`, cast to the activation dtype.
Experts are stored stacked: `gate_up` [experts, model, 2, ffn], `down` [experts, ffn, model]
(`Fp8Weight`s under `weights="fp8"`: `djax.models.fp8`). Three expert paths compute the same
function (`Kernels.moe`): `grouped` lays the token-expert pairs out by expert
(`group_layout`, no sort) and runs `jax.lax.ragged_dot`; `mosaic` runs them, each
expert's rows from a multiple of 8, through djax's expert-tile kernels
(`djax.kernels.expert_tiles_mosaic`, 16-bit or fp8 weights), and `fp8_mosaic` runs them
by fp8 x fp8 WGMMA on K-major fp8 weights (`Model.k_major`); `dense` runs every
local expert on every token and weights the outputs (zero weight where not routed). The
expert tiles take the pairs laid out by expert (`experts_grouped`) or, in forwards whose
tokens fit one row tile (`Kernels.expert_rows="tokens"`: a block's), every token through
each expert any token goes to (`experts_by_token`): the same products with nothing to lay
out, gather or scatter around the kernels.

HF layout: `model.embed_tokens`, `model.layers.{i}.self_attn.{q,k,v,o}_proj`,
`...self_attn.{q,k}_norm`, `...{input,post_attention}_layernorm`, `...mlp.gate`,
`...mlp.expert_bias`, `...mlp.experts.{j}.{gate,up,down}_proj`,
`...shared_expert.{gate,up,down}_proj`, dense layers `...mlp.{gate,up,down}_proj`,
`model.norm`, `lm_head`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from djax.config import ModelConfig
from djax.kernels import expert_tiles_mosaic
from djax.kernels.handoff import QuantizedRows, finish
from djax.kernels.tma_ring import ROW_ALIGN
from djax.models import fp8
from djax.models.kernel_choice import XLA_KERNELS, Kernels
from djax.models.layers import GatedMLP, TransformerLM, _sum_over, init_normal
from djax.models.sources import (
    Joined,
    ParamSource,
    Tensor,
    attention_sources,
    copy,
    gate_up,
    transposed,
)

Array = jax.Array
# `group_layout` compares every pair of up to PAIRWISE_MAX items at once (a block's and a
# refresh's pairs at batch 1); more it cuts into chunks of COUNT_CHUNK items.
PAIRWISE_MAX = 4096
COUNT_CHUNK = 512


def route(
    x: Array, router: Array, expert_bias: Array | None, top_k: int, normalise: bool
) -> tuple[Array, Array]:
    """Router in fp32. x: [n, model]; router: [model, experts].

    Returns (weights [n, top_k] fp32, experts [n, top_k] int32).
    """
    logits = jnp.einsum("nm,me->ne", x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.softmax(logits, axis=-1)
    if expert_bias is not None:
        scores = scores + expert_bias.astype(jnp.float32)
    weights, experts = jax.lax.top_k(scores, top_k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_dense(
    x: Array,
    weights: Array,
    experts: Array,
    gate_up: fp8.Weight,
    down: fp8.Weight,
    first_expert: Any,
    fp8_impl: str = "no",
) -> Array:
    """Every local expert on every token, outputs weighted by the routing weights.

    x: [n, model]; weights, experts: [n, top_k]; gate_up: [local_experts, model, 2, ffn];
    down: [local_experts, ffn, model] (`Fp8Weight`s through `fp8_impl`); first_expert:
    global id of local expert 0, or None where every expert is on this device.
    """
    n_local = gate_up.shape[0]
    local, _ = _local_experts(experts, first_expert, n_local)
    onehot = (local[..., None] == jnp.arange(n_local)).astype(x.dtype)  # [n, top_k, e]
    combine = jnp.einsum("nk,nke->ne", weights.astype(x.dtype), onehot)
    h = fp8.einsum("nm,emcf->necf", x, gate_up, fp8_impl)
    act = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    y = fp8.einsum("nef,efm->nem", act, down, fp8_impl)
    return jnp.einsum("nem,ne->nm", y, combine)


def group_layout(key: Array, n_groups: int, align: int = 1) -> tuple[Array, Array, Array]:
    """Rows for items grouped by a small integer key, without sorting them: group `g`'s
    items, in their order, from row `A_g` = the sum of the earlier groups' sizes, each
    rounded up to a multiple of `align` (so every group starts at a multiple of `align`);
    items of key `n_groups` (outside every group) after the last group, in order.

    key: [p] int32 in [0, n_groups]. Returns (position [p]: each item's row; item [rows]:
    the item each row holds, 0 for a padding row; sizes [n_groups]: the groups' sizes
    rounded up to `align`, padding rows included), int32, `rows =
    expert_tiles_mosaic.aligned_rows(p, n_groups, align)`. With `align=1` this is a stable
    sort by key: `item` the order, `position` each item's rank.

    An item's row is its group's start plus the number of earlier items of its key: up to
    `PAIRWISE_MAX` items every pair is compared (p² work in one fused reduction, which XLA
    runs faster at these sizes than a prefix sum along p), more are cut into chunks of
    `COUNT_CHUNK` compared within the chunk, plus the earlier chunks' counts of the key.
    """
    p = key.shape[0]
    chunk = p if p <= PAIRWISE_MAX else COUNT_CHUNK
    n_chunks = -(-p // chunk)
    # Padding takes a key past every real one.
    keys = jnp.pad(key, (0, n_chunks * chunk - p), constant_values=n_groups + 1)
    keys = keys.reshape(n_chunks, chunk)
    at = jnp.arange(chunk)
    same_earlier = (keys[:, None, :] == keys[:, :, None]) & (at[None, :] < at[:, None])
    within = jnp.sum(same_earlier, axis=2, dtype=jnp.int32)  # [chunks, item]
    if n_chunks > 1:  # plus the earlier chunks' items of the same key
        counts = jnp.sum(keys[..., None] == jnp.arange(n_groups + 2), axis=1, dtype=jnp.int32)
        before = jnp.cumsum(counts, axis=0) - counts  # [chunks, key]
        within = within + jnp.take_along_axis(before, keys, axis=1)
    within = within.reshape(-1)[:p]
    onehot = key[:, None] == jnp.arange(n_groups + 1)
    sizes = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    padded = (sizes + align - 1) // align * align
    starts = jnp.cumsum(padded) - padded
    position = starts[key] + within
    rows = expert_tiles_mosaic.aligned_rows(p, n_groups, align)
    item = jnp.zeros(rows, jnp.int32).at[position].set(jnp.arange(p), unique_indices=True)
    # Materialised once: fused into the gathers that take them, XLA may recompute the
    # counts for every gathered value.
    return jax.lax.optimization_barrier((position, item, padded[:n_groups]))


def ragged_mlp(
    x: Array,
    source_rows: Array,
    gate_up: fp8.Weight,
    down: fp8.Weight,
    group_sizes: Array,
    fp8_impl: str = "no",
) -> Array:
    """The experts' SwiGLU MLP on the rows `x[source_rows]` (grouped by expert: group g's
    rows after the earlier groups', `group_layout`), as two grouped matmuls
    (`jax.lax.ragged_dot`) with the activation between them.

    x: [tokens, model]; source_rows: [rows] int32; gate_up: [experts, model, 2, ffn];
    down: [experts, ffn, model] (`Fp8Weight`s through `fp8_impl`); group_sizes: [experts]
    int32. Returns [rows, model]; rows past sum(group_sizes) may hold anything.
    """
    n_local, d_model, _, ffn = gate_up.shape
    shape = (n_local, d_model, 2 * ffn)
    if isinstance(gate_up, fp8.Fp8Weight):
        gate_up = gate_up.reshape(shape, (n_local, 2 * ffn))
    else:
        gate_up = gate_up.reshape(shape)
    h = fp8.ragged_dot(x[source_rows], gate_up, group_sizes, fp8_impl)
    act = jax.nn.silu(h[:, :ffn]) * h[:, ffn:]
    return fp8.ragged_dot(act, down, group_sizes, fp8_impl)


def mosaic_mlp(
    x: Array,
    source_rows: Array | None,
    gate_up: fp8.Weight,
    down: fp8.Weight,
    group_sizes: Array,
    tiles: Any = None,
) -> Array:
    """`ragged_mlp`'s contract, on rows in the kernels' aligned layout (`group_layout` at
    `align=ROW_ALIGN`), through the Mosaic GPU expert-tile kernels
    (`expert_tiles_mosaic.expert_mlp`, at its (gate/up, down) `tiles`, default `tiles_for`),
    `Fp8Weight`s given to them as values and scales (in their own layout: K-major ones,
    as `Model.k_major` holds them, run in `fp8_mosaic_mlp`; a ValueError here).
    `source_rows` None: every token through each expert whose group size is not 0, in
    the every-token layout (`expert_tiles_mosaic.expert_mlp_every_token`: [experts, R,
    model])."""
    if any(isinstance(w, fp8.Fp8Weight) and w.k_major for w in (gate_up, down)):
        raise ValueError(
            "moe='mosaic' takes fp8 expert weights in their own layout; got K-major ones (a "
            "model holding them so, Model.k_major, runs its experts in moe='fp8_mosaic' or 'dense')"
        )
    scales = ()
    if isinstance(gate_up, fp8.Fp8Weight) and isinstance(down, fp8.Fp8Weight):
        gate_up, down, scales = gate_up.values, down.values, (gate_up.scale, down.scale)
    if source_rows is None:
        return expert_tiles_mosaic.expert_mlp_every_token(
            x, group_sizes, gate_up, down, *scales, tiles=tiles
        )
    return expert_tiles_mosaic.expert_mlp(
        x, source_rows, gate_up, down, group_sizes, *scales, tiles=tiles
    )


def fp8_mosaic_mlp(
    x: Array | QuantizedRows,
    source_rows: Array | None,
    gate_up: fp8.Weight,
    down: fp8.Weight,
    group_sizes: Array,
    tiles: Any = None,
) -> Array:
    """`mosaic_mlp`'s contract by fp8 x fp8 WGMMA (`expert_tiles_mosaic.expert_mlp_fp8`, at
    its (gate/up, down) `tiles`, default `fp8_tiles_for`): K-major `Fp8Weight`s (a model
    holding them so, `Model.k_major`), the rows quantised per row (or as the norm quantised
    them, `QuantizedRows`); a ValueError for other weights. `source_rows` None: the
    every-token layout (`expert_tiles_mosaic.expert_mlp_fp8_every_token`), as
    `mosaic_mlp`'s."""
    for w in (gate_up, down):
        if not isinstance(w, fp8.Fp8Weight) or not w.k_major:
            raise ValueError(
                "moe='fp8_mosaic' takes K-major fp8 expert weights (Model.k_major: "
                f"fp8_impl 'mosaic', or 'auto' on Hopper GPUs); got {type(w).__name__} {w.shape}"
                + (" in its own layout" if isinstance(w, fp8.Fp8Weight) else "")
            )
    weights = (gate_up.values, gate_up.scale, down.values, down.scale)
    if source_rows is None:
        return expert_tiles_mosaic.expert_mlp_fp8_every_token(x, group_sizes, *weights, tiles=tiles)
    return expert_tiles_mosaic.expert_mlp_fp8(x, source_rows, *weights, group_sizes, tiles=tiles)


def experts_grouped(
    x: Array | QuantizedRows,
    weights: Array,
    experts: Array,
    gate_up: Array,
    down: Array,
    first_expert: Any,
    mlp: Callable[[Array, Array, Array, Array, Array], Array] = ragged_mlp,
    align: int = 1,
) -> Array:
    """Token-expert pairs laid out by local expert (`group_layout`, each expert's rows from
    a multiple of `align`), the experts' MLP run on them by `mlp` (`ragged_mlp`'s arguments
    and result: the tokens, the token of each row, the weights and the groups' sizes), and
    the outputs weighted back per token.

    Same arguments and result as `experts_dense` (x as `QuantizedRows` where `mlp` takes
    them, `fp8_mosaic_mlp`); pairs routed to experts on other devices go past every group
    and get zero weight. `align`: the row alignment `mlp` needs (`ROW_ALIGN` for the
    expert-tile kernels; 1, a plain sort by expert, for `ragged_mlp`).
    """
    n, top_k = experts.shape
    n_local, d_model = gate_up.shape[:2]
    local, is_local = _local_experts(experts, first_expert, n_local)
    key = (local if is_local is None else jnp.where(is_local, local, n_local)).reshape(-1)
    position, pair, group_sizes = group_layout(key, n_local, align)
    # The way back is a gather through `position`: XLA's scatter-adds (a bincount, an
    # `.at[token].add`) are slower.
    y = mlp(x, pair // top_k, gate_up, down, group_sizes)[position].reshape(n, top_k, d_model)
    return _weighted_sum(y, weights, is_local, x.dtype)  # rows past the groups: anything


def _local_experts(experts: Array, first_expert: Any, n_local: int) -> tuple[Array, Array | None]:
    """Each pair's local expert (`experts - first_expert`) and whether it is on this device
    (`0 <= local < n_local`), both [n, top_k]; with `first_expert` None (every expert on
    this device) the experts as they are and None: no pair to test."""
    if first_expert is None:
        return experts, None
    local = experts - first_expert
    return local, (local >= 0) & (local < n_local)


def _weighted_sum(y: Array, weights: Array, is_local: Array | None, dtype: Any) -> Array:
    """Each token's pairs' outputs y [n, top_k, model] times their routing weights [n,
    top_k], summed in fp32, as `dtype`; pairs not `is_local` (where it is not None) count
    zero, whatever y holds for them."""
    if is_local is not None:
        y = jnp.where(is_local[..., None], y, 0)
        weights = jnp.where(is_local, weights, 0.0)
    pair_weight = weights.astype(dtype)
    out = jnp.einsum("nk,nkm->nm", pair_weight, y, preferred_element_type=jnp.float32)
    return out.astype(dtype)


def experts_by_token(
    x: Array | QuantizedRows,
    weights: Array,
    experts: Array,
    gate_up: Array,
    down: Array,
    first_expert: Any,
    mlp: Callable[..., Array] = mosaic_mlp,
) -> Array:
    """`experts_grouped`'s result with no layout of the pairs: each local expert that any
    token goes to runs every token (`mlp` with `source_rows` None and each expert's count
    of pairs as its group size: `mosaic_mlp`, `fp8_mosaic_mlp`), and each pair's output is
    read back at (its expert, its token). For forwards whose tokens fit one row tile of
    the kernels (a block's): the tile's products cost what the expert's pairs alone cost.

    Same arguments and result as `experts_grouped`; pairs routed to experts on other
    devices get zero weight.
    """
    n = experts.shape[0]
    n_local, d_model = gate_up.shape[0], x.shape[-1]
    local, is_local = _local_experts(experts, first_expert, n_local)
    counts = jnp.sum(local.reshape(-1, 1) == jnp.arange(n_local), axis=0, dtype=jnp.int32)
    y = mlp(x, None, gate_up, down, counts)  # [n_local, R, model]
    held = local if is_local is None else jnp.where(is_local, local, 0)
    row = held * y.shape[1] + jnp.arange(n)[:, None]
    y = y.reshape(-1, d_model)[row]  # [n, top_k, model]
    return _weighted_sum(y, weights, is_local, x.dtype)


class MoEBlock(nn.Module):
    """Routed experts (+ optional shared expert) for one layer.

    Under expert parallelism each device holds `experts / n` whole experts; under tensor
    parallelism of the experts each holds every expert's `ffn / n` slice. Either way the
    local result is a partial sum, completed by `psum` over `axis_name`.
    """

    config: ModelConfig
    dtype: Any
    axis_name: str | None = None
    shards: int = 1
    split_experts: bool = False
    weights: str = "dtype"
    k_major: bool = False  # fp8 values K-major, experts' and shared (`KernelChoice.k_major`)

    @nn.compact
    def __call__(self, x: Array | QuantizedRows, kernels: Kernels = XLA_KERNELS) -> Array:
        """x: [b, t, model] normed rows -> [b, t, model]; `kernels.moe` chooses the expert
        path, `kernels.mlp` and `kernels.down` the shared expert's. x may come quantised
        by the norm with its rows kept (`QuantizedRows` with `rows`) where the experts run
        `fp8_mosaic`: the router reads the rows, the experts (and a shared expert whose
        gate/up path is `fp8_mosaic`) the e4m3 values."""
        quantised = x if isinstance(x, QuantizedRows) else None
        if quantised is not None and (quantised.rows is None or kernels.moe != "fp8_mosaic"):
            raise ValueError(
                "MoEBlock: rows quantised by the norm (QuantizedRows) need their rows kept "
                f"(keep_rows) and moe 'fp8_mosaic'; got moe {kernels.moe!r}"
            )
        x = x if quantised is None else quantised.rows
        cfg = self.config
        e, m, f = cfg.n_experts, cfg.d_model, cfg.expert_hidden
        local_e = e // self.shards if self.split_experts else e
        local_f = f if self.split_experts else f // self.shards
        router = self.param("router", init_normal(), (m, e), self.dtype)
        bias = (
            self.param("expert_bias", nn.initializers.zeros, (e,), jnp.float32)
            if cfg.router_expert_bias
            else None
        )
        shape = (local_e, m, 2, local_f)
        gate_up = fp8.param(
            self, "gate_up", init_normal(), shape, self.dtype, self.weights, self.k_major
        )
        shape = (local_e, local_f, m)
        down = fp8.param(self, "down", init_normal(), shape, self.dtype, self.weights, self.k_major)
        b, t, _ = x.shape
        flat = x.reshape(b * t, m)
        with jax.named_scope("router"):
            weights, experts = self.route(flat, router, bias)
        tokens = flat if quantised is None else quantised.reshape(b * t, m)
        first = None if local_e == e else jax.lax.axis_index(self.axis_name) * local_e
        ragged = functools.partial(ragged_mlp, fp8_impl=kernels.fp8)
        tiled = {"mosaic": mosaic_mlp, "fp8_mosaic": fp8_mosaic_mlp}
        if kernels.moe in tiled and kernels.expert_rows == "tokens":
            run = functools.partial(experts_by_token, mlp=tiled[kernels.moe])
        elif kernels.moe in tiled:
            run = functools.partial(experts_grouped, mlp=tiled[kernels.moe], align=ROW_ALIGN)
        else:
            run = {
                "dense": functools.partial(experts_dense, fp8_impl=kernels.fp8),
                "grouped": functools.partial(experts_grouped, mlp=ragged),
            }[kernels.moe]
        with jax.named_scope(f"experts_{kernels.moe}"):
            y = run(tokens, weights, experts, gate_up, down, first).reshape(b, t, m)
        y = _sum_over(y, self.axis_name)
        if cfg.shared_expert_hidden:
            shared = GatedMLP(
                cfg.shared_expert_hidden,
                self.dtype,
                axis_name=self.axis_name,
                shards=self.shards,
                weights=self.weights,
                k_major=self.k_major,
                name="shared",
            )
            taken = quantised if quantised is not None and kernels.mlp == "fp8_mosaic" else x
            y = y + finish(shared(taken, kernels))
        return y

    def route(self, x: Array, router: Array, expert_bias: Array | None) -> tuple[Array, Array]:
        """The routing weights and experts of tokens x [n, model] (`route`'s result); a
        family with another router overrides this."""
        cfg = self.config
        return route(x, router, expert_bias, cfg.experts_per_token, cfg.norm_topk_prob)


class LLaDAMoE(TransformerLM):
    """LLaDA-MoE: MoE feed-forward in the layers `config.moe_layers` marks, SwiGLU elsewhere."""

    def feed_forward(self, layer: int) -> nn.Module:
        cfg = self.config
        name = f"ff_{layer}"
        if cfg.moe_layers[layer]:
            return MoEBlock(
                cfg,
                self.dtype,
                axis_name=self.axis_name,
                shards=self.shards,
                split_experts=self.split_experts,
                weights=self.kernels.weights,
                k_major=self.kernels.k_major,
                name=name,
            )
        return self.gated_mlp(layer)


def expert_sources(ff: str, prefix: str, n_experts: int) -> list[ParamSource]:
    """A MoE layer's fused expert weights from HF's per-expert SwiGLU tensors
    `{prefix}.{j}.{gate,up,down}_proj.weight`: `gate_up` [experts, model, 2, ffn] and
    `down` [experts, ffn, model] of param `ff`."""
    experts = [f"{prefix}.{j}" for j in range(n_experts)]
    return [
        ParamSource(
            (ff, "gate_up"),
            _stacked_experts([(f"{x}.gate_proj.weight", f"{x}.up_proj.weight") for x in experts]),
            (0, 3, 1, 2),
        ),
        ParamSource(
            (ff, "down"),
            _stacked_experts([(f"{x}.down_proj.weight",) for x in experts]),
            (0, 2, 1),
        ),
    ]


def _stacked_experts(names: list[tuple[str, ...]]) -> Joined:
    """Per-expert tensors stacked on a new leading expert axis."""
    parts = tuple(
        Tensor(n[0]) if len(n) == 1 else Joined(tuple(Tensor(x) for x in n), axis=0, stack=True)
        for n in names
    )
    return Joined(parts, axis=0, stack=True)


def _mlp_sources(prefix: tuple[str, ...], hf: str) -> list[ParamSource]:
    return [
        gate_up((*prefix, "gate_up"), f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
        transposed((*prefix, "down"), f"{hf}.down_proj.weight"),
    ]


def hf_sources(config: ModelConfig) -> list[ParamSource]:
    """Where each djax param comes from in an HF LLaDA-MoE folder."""
    sources = [
        copy(("embed",), "model.embed_tokens.weight"),
        copy(("final_norm", "scale"), "model.norm.weight"),
        transposed(("lm_head",), "lm_head.weight"),
    ]
    for i in range(config.n_layers):
        hf = f"model.layers.{i}"
        att = f"{hf}.self_attn"
        sources += [
            copy((f"attn_norm_{i}", "scale"), f"{hf}.input_layernorm.weight"),
            copy((f"ff_norm_{i}", "scale"), f"{hf}.post_attention_layernorm.weight"),
            *attention_sources(
                config,
                f"attn_{i}",
                q=f"{att}.q_proj.weight",
                k=f"{att}.k_proj.weight",
                v=f"{att}.v_proj.weight",
                out=f"{att}.o_proj.weight",
            ),
        ]
        if config.qk_norm:
            sources += [
                copy((f"attn_{i}", "q_norm", "scale"), f"{att}.q_norm.weight"),
                copy((f"attn_{i}", "k_norm", "scale"), f"{att}.k_norm.weight"),
            ]
        ff = f"ff_{i}"
        if not config.moe_layers[i]:
            sources += _mlp_sources((ff,), f"{hf}.mlp")
            continue
        sources += [
            transposed((ff, "router"), f"{hf}.mlp.gate.weight"),
            *expert_sources(ff, f"{hf}.mlp.experts", config.n_experts),
        ]
        if config.router_expert_bias:
            sources.append(copy((ff, "expert_bias"), f"{hf}.mlp.expert_bias"))
        if config.shared_expert_hidden:
            sources += _mlp_sources((ff, "shared"), f"{hf}.shared_expert")
    return sources
