"""Layers shared by the LLaDA model families: RMSNorm, RoPE, windowed bidirectional
attention over fixed-shape K/V buffers, the SwiGLU MLP, and the decoder-stack skeleton.

Every layer is written for the local shard of its weights: inside `shard_map` a device
sees `kv_heads / shards` kv heads and `ffn / shards` hidden units, and `axis_name` names the
mesh axis over which partial outputs are summed. With `shards=1`, `axis_name=None` it is
the plain model.

The forward contract (`TransformerLM.__call__`) is what the diffusion engine builds on:
it feeds a *window* of `W` consecutive positions starting at `window.start`, writes
their fresh K/V into the `[batch, seq, kv_heads, head_dim]` buffers (only inside
`[window.write_lo, window.write_hi)` when given), lets the window's queries attend to every
valid key of the whole buffer, and returns final hidden states for `hidden_len` positions
starting `hidden_start` positions into the window. With sparse attention
(`djax.models.sparse_attention`) a refresh also returns each layer's chosen keys per kv
head, and a block forward given their compact rows (`sparse_attention.KeptKV`, gathered
once after that refresh) writes its window's K/V into them and attends to those keys only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from djax.config import ModelConfig
from djax.kernels import (
    flash_attention_mosaic,
    fp8_matmul_mosaic,
    residual_norm_mosaic,
    residual_product_mosaic,
    rope_write_mosaic,
    split_k_mosaic,
    swiglu_mosaic,
)
from djax.kernels.handoff import Partials, QuantizedRows, ScaledRows, finish
from djax.models import fp8, sparse_attention
from djax.models.fp8 import Fp8Weight
from djax.models.kernel_choice import XLA_KERNELS, KernelChoice, Kernels
from djax.models.sparse_attention import KeptKV, SparseAttention

Array = jax.Array
LayerKV = tuple[Array, Array]  # (keys, values), each [batch, seq, kv_heads, head_dim]


def project(
    x: Array | QuantizedRows, w: fp8.Weight, impl: str, fp8_impl: str = "no"
) -> Array | Partials:
    """`x [..., k] @ w [k, ...]` -> [..., *w.shape[1:]]: XLA's einsum (`impl="xla"`), or
    the split-K kernel's `Partials` (`"mosaic"`, `split_k_mosaic`). An
    `Fp8Weight` takes XLA's product `fp8_impl` (`Kernels.fp8`), or with `"fp8_mosaic"` (its
    values K-major) the fp8 Mosaic GPU kernel's `Partials`: x's rows quantised first, or
    given as the norm kernel quantised them (`QuantizedRows`, which only `"fp8_mosaic"`
    takes: a ValueError otherwise)."""
    k, out_shape = w.shape[0], w.shape[1:]
    flat = fp8.matrix(w, k, math.prod(out_shape))
    if isinstance(x, QuantizedRows) and impl != "fp8_mosaic":
        raise ValueError(
            f"project: rows quantised by the norm (QuantizedRows) need impl 'fp8_mosaic'; "
            f"got {impl!r}"
        )
    if impl == "fp8_mosaic":  # Mosaic GPU's interpreter off GPUs (for tests)
        rows, (values, scale) = fp8_matmul_mosaic.quantized(x), _k_major(flat)
        y = fp8_matmul_mosaic.matmul_partials(
            rows.values, rows.scale, values, scale, dtype=rows.dtype
        )
        return Partials(y.parts.reshape(y.parts.shape[:-1] + out_shape), y.dtype)
    if isinstance(w, Fp8Weight):
        y = fp8.einsum("...k,kn->...n", x, flat, fp8_impl)
        return y.reshape(x.shape[:-1] + out_shape)
    if impl == "xla":
        return jnp.einsum("...k,kn->...n", x, flat).reshape(x.shape[:-1] + out_shape)
    if impl != "mosaic":
        raise ValueError(f"project: impl {impl!r}; expected 'xla', 'mosaic' or 'fp8_mosaic'")
    y = split_k_mosaic.matmul_partials(x, flat)  # Mosaic GPU's interpreter off GPUs (for tests)
    return Partials(y.parts.reshape(y.parts.shape[:-1] + out_shape), y.dtype)


def _project_rope_and_write(x, w: fp8.Weight, cos, sin, kv, bounds, scales, ops):
    """The q/k/v product inside the RoPE kernel (`rope_write_mosaic`): bf16/fp16 rows and
    weight, or an fp8 weight (K-major) by fp8 x fp8 WGMMA on rows the norm quantised
    (`QuantizedRows`) or quantised here."""
    if not isinstance(w, Fp8Weight):
        if isinstance(x, QuantizedRows):
            raise ValueError(
                "Attention: rows quantised by the norm (QuantizedRows) need an fp8 q/k/v "
                f"weight in the RoPE kernel; got a {w.dtype} weight"
            )
        return rope_write_mosaic.project_rope_and_write(x, w, cos, sin, kv, bounds, scales, ops)
    rows, (values, scale) = fp8_matmul_mosaic.quantized(x), _k_major(w)
    return rope_write_mosaic.project_rope_and_write_fp8(
        rows.values, rows.scale, values, scale, cos, sin, kv, bounds, scales, ops, rows.dtype
    )


def _k_major(w: fp8.Weight) -> tuple[Array, Array]:
    """A K-major `Fp8Weight`'s values and scale, as `fp8_matmul_mosaic` takes them; a
    ValueError for any other weight."""
    if not isinstance(w, Fp8Weight) or not w.k_major:
        raise ValueError(
            "the fp8 Mosaic GPU products take K-major fp8 weights (Model.k_major: "
            f"fp8_impl 'mosaic', or 'auto' on Hopper GPUs); got {type(w).__name__} {w.shape}"
            + ("" if not isinstance(w, Fp8Weight) else " in its own layout")
        )
    return w.values, w.scale


@dataclasses.dataclass(frozen=True)
class Product:
    """A block layer's attention-output product `x [..., k] @ w [k, n]`, left for the
    residual norm after it to run with the residual add in the product's Mosaic GPU kernels,
    in its epilogue (`fused`) or right after it (`tiled`; `Kernels.norm_into_mlp`)."""

    x: Array
    w: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.x.shape[:-1], self.w.shape[1])


def init_normal(stddev: float = 0.02):
    return nn.initializers.normal(stddev)


@dataclasses.dataclass(frozen=True)
class Window:
    """Where a forward's input sits in the sequence and which of its K/V it writes.

    `start` is the sequence position of the first input token (a traced scalar is fine).
    Fresh K/V are written for window positions in `[write_lo, write_hi)`; positions outside
    that range keep the buffer's cached K/V. `write_lo=None` writes the whole window.
    """

    start: Any = 0
    write_lo: Any = None
    write_hi: Any = None


jax.tree_util.register_dataclass(
    Window, data_fields=["start", "write_lo", "write_hi"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class AttentionGroup:
    """One group of a mixed forward (`TransformerLM.forward_groups`): `b` windows of `t`
    rows whose products run with the other groups' rows while they attend on their own.

    positions: [b, t] RoPE positions; key_valid: [b, seq] or [b, t, seq] (each row's own
    keys); window: where the rows sit in the group's K/V buffers (ignored without them);
    attention: how the group attends (`attend`'s impl).
    """

    positions: Array
    key_valid: Array
    window: Window = Window()
    attention: str = "xla"

    @property
    def rows(self) -> int:
        return self.positions.shape[0] * self.positions.shape[1]


jax.tree_util.register_dataclass(
    AttentionGroup,
    data_fields=["positions", "key_valid", "window"],
    meta_fields=["attention"],
)


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm over the last axis, normalised in fp32, cast back, then times `scale`."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype)


def rope_tables(positions: Array, theta: float, rotary_dim: int) -> tuple[Array, Array]:
    """cos and sin of RoPE's angles in fp32: positions [batch, seq] (int) ->
    two [batch, seq, rotary_dim / 2]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, positions: Array, theta: float, rotary_dim: int) -> Array:
    """Rotate-half RoPE in fp32 on the first `rotary_dim` features.

    x: [batch, seq, ..., head_dim]; positions: [batch, seq] (int).
    """
    cos, sin = rope_tables(positions, theta, rotary_dim)
    extra_axes = x.ndim - 3
    cos, sin = (a.reshape(a.shape[:2] + (1,) * extra_axes + a.shape[-1:]) for a in (cos, sin))
    half = rotary_dim // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:rotary_dim].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos + -x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1)


def write_window(buffer: Array | None, fresh: Array, window: Window) -> Array:
    """Put a window's fresh K or V into the buffer.

    buffer: [rows, seq, kv_heads, head_dim] or None (the window is the whole sequence);
    fresh: [batch, W, kv_heads, head_dim], written into the buffer's first `batch` rows
    (rows ≥ batch: a pool whose leading slots step).
    """
    if buffer is None:
        return fresh
    index = (0, window.start, 0, 0)
    if window.write_lo is not None:
        positions = window.start + jnp.arange(fresh.shape[1])
        keep = (positions >= window.write_lo) & (positions < window.write_hi)
        cached = jax.lax.dynamic_slice(buffer, index, fresh.shape)
        fresh = jnp.where(keep[None, :, None, None], fresh, cached)
    return jax.lax.dynamic_update_slice(buffer, fresh.astype(buffer.dtype), index)


def rope_and_write_xla(
    qkv: Array,
    positions: Array,
    buffers: LayerKV | None,
    window: Window,
    scales: tuple[Array, Array] | None,
    ops: rope_write_mosaic.HeadOps,
    theta: float,
    rotary_dim: int,
) -> tuple[Array, Array, Array]:
    """XLA's path of `rope_write_mosaic.rope_and_write`: qkv [b, t, kv_heads, group + 2, d] ->
    q [b, t, kv_heads, group, d] after the q/k norm (with `scales`), clip and RoPE, and the
    buffers (or fresh [b, t, kv_heads, d] arrays) with the window's keys and values."""
    group = qkv.shape[3] - 2
    q, k, v = qkv[..., :group, :], qkv[..., group, :], qkv[..., group + 1, :]
    if ops.qk_norm:
        q, k = rms_norm(q, scales[0], ops.eps), rms_norm(k, scales[1], ops.eps)
    if ops.clip is not None:  # after the q/k norm, as the LLaDA-MoE reference does
        q, k, v = (jnp.clip(a, -ops.clip, ops.clip) for a in (q, k, v))
    q = apply_rope(q, positions, theta, rotary_dim)
    k = apply_rope(k, positions, theta, rotary_dim)
    keys = write_window(None if buffers is None else buffers[0], k, window)
    values = write_window(None if buffers is None else buffers[1], v, window)
    return q, keys, values


def attend(
    q: Array,
    keys: Array,
    values: Array,
    key_valid: Array,
    impl: str = "xla",
    into_fp8: bool = False,
) -> Array | QuantizedRows:
    """Grouped-query attention with a key mask: bidirectional over the valid keys.

    q: [batch, t, kv_heads, group, head_dim]; keys, values: [rows, s, kv_heads, head_dim],
    rows ≥ batch, the first `batch` q's (a pool's leading slots: the kernel reads them in
    place, XLA's and cuDNN's paths take them sliced); key_valid: [batch, s] bool (the same
    keys for every query), or [batch, t, s] (each query's own keys, as block-causal
    attention needs: XLA's or cuDNN's path). Returns [batch, t, kv_heads, group, head_dim],
    or with `into_fp8` (`Kernels.attention_into_fp8`, head_dim 128) the output as the fp8
    output product takes it: `QuantizedRows` of e4m3 values [batch, t, heads · head_dim]
    and a scale per row and head [heads, batch · t] (`fp8_matmul_mosaic.quantize_heads`).
    """
    if impl == "split_kv" and key_valid.ndim == 2:  # an interpreter off GPUs (for tests)
        b, t, k, g, d = q.shape
        heads = q.reshape(b, t, k * g, d)
        run = flash_attention_mosaic.split_kv_attention
        out = run(heads, keys, values, key_valid, out_fp8=into_fp8)
        return out if into_fp8 else out.reshape(q.shape)
    out = _attend_xla(q, keys, values, key_valid, impl)
    return fp8_matmul_mosaic.quantize_heads(out) if into_fp8 else out


def _attend_xla(q: Array, keys: Array, values: Array, key_valid: Array, impl: str) -> Array:
    """`attend`'s XLA and cuDNN paths."""
    keys, values = keys[: q.shape[0]], values[: q.shape[0]]
    if impl == "cudnn":
        return _attend_cudnn(q, keys, values, key_valid)
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys, preferred_element_type=jnp.float32)
    mask = key_valid[:, None, None, None, :] if key_valid.ndim == 2 else key_valid[:, None, None]
    scores = jnp.where(mask, scores * scale, flash_attention_mosaic.MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, values)


def _attend_cudnn(q: Array, keys: Array, values: Array, key_valid: Array) -> Array:
    b, t, k, g, d = q.shape
    per_query = key_valid if key_valid.ndim == 3 else key_valid[:, None, :]
    mask = jnp.broadcast_to(per_query[:, None], (b, 1, t, keys.shape[1]))
    out = jax.nn.dot_product_attention(
        q.reshape(b, t, k * g, d), keys, values, mask=mask, implementation="cudnn"
    )
    return out.reshape(b, t, k, g, d)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (param `scale` [width]). `norm(x)` normalises x;
    `norm(y, residual=x, impl=...)` adds first and returns `(x + y, norm(x + y))`, the pair
    between a decoder layer's blocks, in XLA (`impl="xla"`) or in one kernel (`"mosaic"`,
    `residual_norm_mosaic.add_rms_norm`).
    `y` may be a split-K product's `Partials`, or a `Product` still to run: then the add
    runs in the product's kernel (`impl="fused"`, `residual_product_mosaic`) or in a tiled
    kernel after the split-K product (`"tiled"`, `residual_norm_mosaic.add_scaled`), and the
    norm is returned as `ScaledRows` for the next product's kernel to apply. `into_fp8`
    (with `"mosaic"` only, `Kernels.norm_into_fp8`): the norm is returned quantised for the
    fp8 product after it, `QuantizedRows`, with `keep_rows` holding the rows too (for a MoE
    layer, whose router reads them)."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(
        self,
        x: Array | Partials | Product,
        residual: Array | None = None,
        impl: str = "xla",
        into_fp8: bool = False,
        keep_rows: bool = False,
    ) -> Array | tuple[Array, Array | ScaledRows | QuantizedRows]:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if into_fp8 and (impl != "mosaic" or residual is None or isinstance(x, Product)):
            raise ValueError(
                f"RMSNorm: into_fp8 needs a residual add in impl 'mosaic'; got impl {impl!r}"
                + (", no residual" if residual is None else "")
            )
        if isinstance(x, Product):
            if impl == "fused":
                return residual_product_mosaic.residual_product(x.x, x.w, residual, scale, self.eps)
            if impl != "tiled":
                raise ValueError(f"RMSNorm: a Product needs impl 'fused' or 'tiled'; got {impl!r}")
            y = split_k_mosaic.matmul_partials(x.x, x.w)
            return residual_norm_mosaic.add_scaled(residual, y, scale, self.eps)
        if residual is None:
            return rms_norm(finish(x), scale, self.eps)
        if impl == "mosaic":
            return residual_norm_mosaic.add_rms_norm(
                residual, x, scale, self.eps, into_fp8, keep_rows
            )
        h = residual + finish(x)
        return h, rms_norm(h, scale, self.eps)


class NormScale(nn.Module):
    """An RMSNorm's learned scale (param `scale` [width]), for norms applied inside
    another kernel (the q/k norms)."""

    dtype: Any

    @nn.compact
    def __call__(self, width: int) -> Array:
        return self.param("scale", nn.initializers.ones, (width,), self.dtype)


class Attention(nn.Module):
    """Self-attention of a window against the whole K/V buffer.

    Weights: `qkv` [model, kv_heads, group + 2, head_dim] (per kv head: its `group` query
    heads, then its key, then its value — one matmul, split by kv heads under tensor
    parallelism), `attn_out` [kv_heads, group, head_dim, model] (both `Fp8Weight`s under
    `weights="fp8"`) and, with `config.attn_out_bias`, `attn_out_bias` [model]. With
    `config.qk_norm`, `q_norm`/`k_norm` scales [head_dim] shared by all heads are applied
    before RoPE.
    """

    config: ModelConfig
    dtype: Any
    axis_name: str | None = None
    shards: int = 1
    weights: str = "dtype"
    k_major: bool = False  # fp8 values K-major (`KernelChoice.k_major`)

    @nn.compact
    def __call__(
        self,
        x: Array,
        positions: Array,
        key_valid: Array,
        kv: LayerKV | None,
        window: Window,
        query_rows: tuple[Any, int] | None = None,
        kernels: Kernels = XLA_KERNELS,
        out_impl: str = "xla",
        defer_output: bool = False,
        sparse: tuple[SparseAttention, Any, int] | None = None,
        kept_kv: KeptKV | None = None,
        groups: tuple[AttentionGroup, ...] | None = None,
    ) -> tuple[Array | Partials | Product, LayerKV, Array | KeptKV | None]:
        """x: [b, W, model] normed window rows (`QuantizedRows` where the q/k/v product is
        an fp8 kernel's: `fp8_mosaic`, or `rope` with an fp8 weight) -> the attention output [b, W,
        model] (or `Partials`, or with `defer_output` the output `Product` still to run) and
        the layer's K/V with the window's written (as given, with `kept_kv`).
        `query_rows=(start, n)`: attend and project only window rows `[start, start + n)`
        (every row's K/V is still written); the output is then [b, n, model]. `kernels`
        chooses the q/k/v, RoPE and attention paths, `out_impl` the output product's
        (`xla`, `mosaic` or `fp8_mosaic`).
        `sparse=(rule, row, B)` (a refresh): also choose each kv head's keys by `rule` from
        the block's queries, window rows `[row, row + B)` (`sparse_attention.choose`),
        returned third (else None). `kept_kv` (a block forward): write the window's K/V into
        its window slots instead of `kv` (`sparse_attention.window_slots`), attend to each kv
        head's kept keys only, its compact rows and its kept rows of this window
        (`sparse_attention.attend_kept`), and return the updated `KeptKV` third.

        `groups` (a mixed forward): x is [1, T, model], the rows of every group one after the
        other; `kv` holds each group's buffers (or None); the q/k/v and output products run
        on all T rows, RoPE and the K/V write per group in XLA, attention per group as the
        group says. Returns the output [1, T, model] and each group's K/V."""
        cfg = self.config
        if isinstance(x, QuantizedRows) and kernels.qkv not in ("fp8_mosaic", "rope"):
            raise ValueError(
                "Attention: rows quantised by the norm (QuantizedRows) need qkv 'fp8_mosaic' "
                f"or 'rope' (with an fp8 weight); got {kernels.qkv!r}"
            )
        group = cfg.n_heads // cfg.n_kv_heads
        kv_heads = cfg.n_kv_heads // self.shards
        qkv_kernel = fp8.param(
            self,
            "qkv",
            init_normal(),
            (cfg.d_model, kv_heads, group + 2, cfg.head_dim),
            self.dtype,
            self.weights,
            self.k_major,
        )
        out_kernel = fp8.param(
            self,
            "attn_out",
            init_normal(),
            (kv_heads, group, cfg.head_dim, cfg.d_model),
            self.dtype,
            self.weights,
            self.k_major,
        )
        out_bias = None
        if cfg.attn_out_bias:
            out_bias = self.param(
                "attn_out_bias", nn.initializers.zeros, (cfg.d_model,), self.dtype
            )
        scales = None
        if cfg.qk_norm:
            scales = tuple(
                NormScale(self.dtype, name=name)(cfg.head_dim) for name in ("q_norm", "k_norm")
            )
        ops = rope_write_mosaic.HeadOps(cfg.qk_norm, cfg.rms_norm_eps, cfg.clip_qkv)
        layer_kv = kv
        if kept_kv is not None:  # the window's K/V go to the compact buffers' window slots
            kv = (kept_kv.keys, kept_kv.values)
            window = sparse_attention.window_slots(window, kept_kv.keys.shape[1], x.shape[1])
        if groups is not None:
            out, group_kv = self._attend_groups(x, qkv_kernel, kv, groups, scales, ops, kernels)
            return self._output(out, out_kernel, out_bias, out_impl, kernels), group_kv, None
        if kernels.rope == "mosaic":  # Mosaic GPU's interpreter off GPUs (for tests)
            cos, sin, bounds = self._rope_inputs(positions, window, x.shape[1])
        if kernels.rope == "mosaic" and kernels.qkv == "rope":
            q, keys, values = _project_rope_and_write(
                x, qkv_kernel, cos, sin, kv, bounds, scales, ops
            )
        elif kernels.rope == "mosaic":
            qkv = project(x, qkv_kernel, kernels.qkv, kernels.fp8)  # [b, t, kv, group + 2, d]
            if isinstance(qkv, Partials) and qkv.parts.shape[0] > rope_write_mosaic.MAX_SPLITS:
                qkv = qkv.total()
            q, keys, values = rope_write_mosaic.rope_and_write(
                qkv, cos, sin, kv, bounds, scales, ops
            )
        else:
            qkv = finish(project(x, qkv_kernel, kernels.qkv, kernels.fp8))
            q, keys, values = rope_and_write_xla(
                qkv, positions, kv, window, scales, ops, cfg.rope_theta, cfg.rope_dim
            )
        new_chosen = None
        if sparse is not None:
            rule, row, block_len = sparse
            q_block = jax.lax.dynamic_slice_in_dim(q, row, block_len, axis=1)
            new_chosen = sparse_attention.choose(rule, q_block, keys, key_valid, positions, row)
        if query_rows is not None:
            q = jax.lax.dynamic_slice_in_dim(q, query_rows[0], query_rows[1], axis=1)
            if key_valid.ndim == 3:  # each query row's own keys
                key_valid = jax.lax.dynamic_slice_in_dim(
                    key_valid, query_rows[0], query_rows[1], axis=1
                )
        into_fp8 = kernels.attention_into_fp8
        if kept_kv is not None:
            kept_kv = kept_kv._replace(keys=keys, values=values)
            out = sparse_attention.attend_kept(q, kept_kv, kernels.attention, into_fp8)
        else:
            layer_kv = (keys, values)
            out = attend(q, keys, values, key_valid, kernels.attention, into_fp8)
        if not into_fp8:
            out = out.reshape(*out.shape[:2], -1)
        y = self._output(out, out_kernel, out_bias, out_impl, kernels, defer_output)
        return y, layer_kv, new_chosen if kept_kv is None else kept_kv

    def _attend_groups(self, x, qkv_kernel, kv, groups, scales, ops, kernels):
        """A mixed forward's attention: the q/k/v product over every group's rows of x [1,
        T, model], then per group RoPE, the K/V write and attention in its own shape.
        Returns the attention output [1, T, heads · head_dim] and each group's K/V."""
        cfg = self.config
        qkv = finish(project(x, qkv_kernel, kernels.qkv, kernels.fp8))[0]
        outs, group_kv, first = [], [], 0
        for group, buffers in zip(groups, kv, strict=True):
            b, t = group.positions.shape
            part = qkv[first : first + b * t].reshape(b, t, *qkv.shape[1:])
            first += b * t
            q, keys, values = rope_and_write_xla(
                part, group.positions, buffers, group.window, scales, ops, cfg.rope_theta,
                cfg.rope_dim,
            )  # fmt: skip
            group_kv.append((keys, values))
            out = attend(q, keys, values, group.key_valid, group.attention)
            outs.append(out.reshape(1, b * t, -1))
        return jnp.concatenate(outs, axis=1), tuple(group_kv)

    def _output(self, out, out_kernel, out_bias, out_impl, kernels, defer=False):
        """The output product of the attention output [b, t, heads · head_dim] (summed over
        the mesh axis, its bias added once after the sum), or with `defer` the `Product`
        still to run."""
        out_kernel = fp8.matrix(out_kernel, out.shape[-1], self.config.d_model)
        if defer:
            return Product(out, out_kernel)
        y = _sum_over(project(out, out_kernel, out_impl, kernels.fp8), self.axis_name)
        if out_bias is not None:  # added once, after the sum over shards
            y = finish(y) + out_bias
        return y

    def _rope_inputs(self, positions, window, t):
        """The RoPE kernel's cos/sin tables and their `bounds` (window start, write_lo,
        write_hi) for a `t`-row window."""
        cfg = self.config
        cos, sin = rope_tables(positions, cfg.rope_theta, cfg.rope_dim)
        lo = window.start if window.write_lo is None else window.write_lo
        hi = window.start + t if window.write_hi is None else window.write_hi
        return cos, sin, jnp.array([window.start, lo, hi], jnp.int32)


def swiglu_xla(x: Array, gate_up: fp8.Weight, fp8_impl: str = "no") -> Array:
    """XLA's SwiGLU gate/up path: x [..., model], gate_up [model, 2, hidden] ->
    silu(x @ gate) * (x @ up) [..., hidden] (an `Fp8Weight` through `fp8_impl`)."""
    h = fp8.einsum("...m,mcf->...cf", x, gate_up, fp8_impl)
    return jax.nn.silu(h[..., 0, :]) * h[..., 1, :]


class GatedMLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate and up fused as [model, 2, hidden];
    the call's `kernels` choose how the gate/up path (`mlp`) and the down product (`down`)
    run. Both are `Fp8Weight`s under `weights="fp8"`."""

    hidden: int
    dtype: Any
    axis_name: str | None = None
    shards: int = 1
    weights: str = "dtype"
    k_major: bool = False  # fp8 values K-major (`KernelChoice.k_major`)

    @nn.compact
    def __call__(
        self, x: Array | ScaledRows | QuantizedRows, kernels: Kernels = XLA_KERNELS
    ) -> Array | Partials:
        """x: [b, t, model] normed rows (`ScaledRows` only where the gate/up product takes
        djax's kernel, `QuantizedRows` only where it is `fp8_mosaic`) -> [b, t, model] (or
        `Partials`)."""
        if isinstance(x, QuantizedRows) and kernels.mlp != "fp8_mosaic":
            raise ValueError(
                "GatedMLP: rows quantised by the norm (QuantizedRows) need mlp 'fp8_mosaic'; "
                f"got {kernels.mlp!r}"
            )
        (b, t, d_model), hidden = x.shape, self.hidden // self.shards
        weights, k_major = self.weights, self.k_major
        gate_up = fp8.param(
            self, "gate_up", init_normal(), (d_model, 2, hidden), self.dtype, weights, k_major
        )
        down = fp8.param(
            self, "down", init_normal(), (hidden, d_model), self.dtype, weights, k_major
        )
        if kernels.mlp == "fp8_mosaic":  # Mosaic GPU's interpreter off GPUs (for tests)
            rows = fp8_matmul_mosaic.quantized(x.reshape(b * t, d_model))
            values, scale = _k_major(gate_up)
            # the down product in the fp8 kernel too: the activation leaves the gate/up
            # kernel as e4m3 with a scale per row and 128-column slice, which it takes
            out_fp8 = kernels.down == "fp8_mosaic"
            act = fp8_matmul_mosaic.swiglu_matmul(
                rows.values, rows.scale, values, scale, dtype=rows.dtype, out_fp8=out_fp8
            )
            if out_fp8:
                act = QuantizedRows(act.values.reshape(b, t, hidden), act.scale, act.dtype)
            else:
                act = act.reshape(b, t, hidden)
        elif kernels.mlp == "mosaic":  # Mosaic GPU's interpreter off GPUs (for tests)
            rows = x.reshape(b * t, d_model)
            act = swiglu_mosaic.swiglu_matmul(rows, gate_up).reshape(b, t, hidden)
        elif isinstance(x, ScaledRows):
            raise ValueError("GatedMLP: ScaledRows need the gate/up product in djax's kernel")
        else:
            act = swiglu_xla(x, gate_up, kernels.fp8)
        return _sum_over(project(act, down, kernels.down, kernels.fp8), self.axis_name)


def _vocab_slice(head: fp8.Weight, start: Any, width: int) -> fp8.Weight:
    """The head's [model, width] columns from `start` (traced or not): an fp8 head's
    values and scales alike."""
    if isinstance(head, Fp8Weight):
        values = jax.lax.dynamic_slice_in_dim(head.values, start, width, axis=1)
        scale = jax.lax.dynamic_slice_in_dim(head.scale, start, width, axis=0)
        return Fp8Weight(values, scale)
    return jax.lax.dynamic_slice_in_dim(head, start, width, axis=1)


def _sum_over(x: Array | Partials, axis_name: str | None) -> Array | Partials:
    """A product summed over the mesh axis `axis_name` (its partials summed first)."""
    return x if axis_name is None else jax.lax.psum(finish(x), axis_name)


class TransformerLM(nn.Module):
    """Embedding, pre-norm decoder layers (unrolled: one set of weights per layer), final
    norm and output head. Subclasses choose each layer's feed-forward (`feed_forward`).
    `kernels` is the resolved kernel choice (`kernel_choice.resolve`; XLA's paths by
    default) the forwards follow; its `weights` is the weight format the params hold
    (`djax.models.fp8`).

    Param tree: `embed.embedding` [vocab, model], `layers_{i}.{attn_norm, attn, ff_norm,
    ff}`, `final_norm.scale`, `lm_head.kernel` [model, vocab].
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    axis_name: str | None = None
    kernels: KernelChoice = KernelChoice()
    shards: int = 1  # size of the model-parallel mesh axis `axis_name`
    split_experts: bool = False  # MoE: experts split by expert (True) or by hidden unit

    def feed_forward(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def gated_mlp(self, layer: int) -> GatedMLP:
        """Layer `layer`'s dense SwiGLU feed-forward of `config.mlp_hidden`."""
        return GatedMLP(
            self.config.mlp_hidden,
            self.dtype,
            axis_name=self.axis_name,
            shards=self.shards,
            weights=self.kernels.weights,
            k_major=self.kernels.k_major,
            name=f"ff_{layer}",
        )

    def setup(self):
        cfg = self.config
        self.embedding = self.param(
            "embed", init_normal(), (cfg.vocab_size, cfg.d_model), self.dtype
        )
        eps = cfg.rms_norm_eps
        self.attn_norms = [
            RMSNorm(eps, self.dtype, name=f"attn_norm_{i}") for i in range(cfg.n_layers)
        ]
        self.attns = [
            Attention(
                cfg,
                self.dtype,
                axis_name=self.axis_name,
                shards=self.shards,
                weights=self.kernels.weights,
                k_major=self.kernels.k_major,
                name=f"attn_{i}",
            )
            for i in range(cfg.n_layers)
        ]
        self.ff_norms = [RMSNorm(eps, self.dtype, name=f"ff_norm_{i}") for i in range(cfg.n_layers)]
        self.ffs = [self.feed_forward(i) for i in range(cfg.n_layers)]
        self.final_norm = RMSNorm(eps, self.dtype, name="final_norm")
        self.lm_head = fp8.param(
            self,
            "lm_head",
            init_normal(),
            (cfg.d_model, cfg.vocab_size // self.shards),
            self.dtype,
            self.kernels.weights,
        )

    def __call__(
        self,
        x: Array,
        positions: Array,
        key_valid: Array,
        kv: tuple[LayerKV, ...] | None = None,
        window: Window = Window(),
        hidden_start: Any = 0,
        hidden_len: int | None = None,
        block_forward: bool = False,
        sparse: SparseAttention | None = None,
        kept_kv: tuple[KeptKV, ...] | None = None,
    ) -> tuple[Array, tuple[LayerKV, ...]] | tuple[Array, tuple[LayerKV, ...], Any]:
        """Run the decoder stack on a window.

        x: [batch, W, model] input embeddings; positions: [batch, W] RoPE positions;
        key_valid: [batch, seq] which buffer positions are real keys (or [batch, W, seq],
        each window row's own keys); kv: per layer
        (keys, values) [batch, seq, kv_heads, head_dim], or None when the window is the
        whole sequence. Returns final-norm hidden states [batch, hidden_len, model] from
        `hidden_start` (relative to the window) and the updated per-layer K/V. Only the
        last layer's K/V need every row, so its queries, attention output and feed-forward
        run on those `hidden_len` rows alone (a refresh's block). `block_forward`: the
        forward takes `kernels.block`'s paths, else `kernels.refresh`'s.

        Sparse attention (`djax.models.sparse_attention`): a refresh given `sparse` (the
        whole sequence fed, the block at rows `[hidden_start, hidden_start + hidden_len)`)
        also returns, third, every layer's chosen keys [n_layers, batch, kv_heads,
        sparse.keys] int32 (-1: a slot the row drops); a block forward given every layer's
        compact kept rows `kept_kv` (`sparse_attention.compact` of that choice, for this
        forward's window) writes the window's K/V into their window slots (the K/V buffers
        are returned as given), attends to those keys only, and returns, third, every
        layer's updated `KeptKV`.
        """
        forward = self.kernels.block if block_forward else self.kernels.refresh
        choosing = None if sparse is None else (sparse, hidden_start, hidden_len)
        new_kv, new_sparse = [], []
        n_layers = self.config.n_layers
        trim = hidden_len is not None and hidden_len != x.shape[1]
        normed = self.attn_norms[0](x)
        for i in range(n_layers):
            last_trimmed = trim and i == n_layers - 1
            layer = forward.layers
            kept = forward.last if last_trimmed else layer  # the rows after attention
            dense_ff = isinstance(self.ffs[i], GatedMLP)
            into_mlp = kept.norm_into_mlp if dense_ff else "no"
            with jax.named_scope(f"layer_{i}"):
                with jax.named_scope("attention"):
                    attn_out, layer_kv, layer_sparse = self.attns[i](
                        normed,
                        positions,
                        key_valid,
                        None if kv is None else kv[i],
                        window,
                        (hidden_start, hidden_len) if last_trimmed else None,
                        kernels=layer,
                        out_impl=kept.out,
                        defer_output=into_mlp != "no",
                        sparse=choosing,
                        kept_kv=None if kept_kv is None else kept_kv[i],
                    )
                new_sparse.append(layer_sparse)
                if last_trimmed:
                    x = jax.lax.dynamic_slice_in_dim(x, hidden_start, hidden_len, axis=1)
                impl = kept.norm if into_mlp == "no" else into_mlp
                # `norm_into_fp8`: the norms before a dense MLP's gate/up product or a MoE
                # layer's fp8 x fp8 experts (the kept rows', kept unquantised too for the
                # router) and the next layer's q/k/v product hand them e4m3 rows
                experts_fp8 = not dense_ff and kept.moe == "fp8_mosaic"
                ff_fp8 = kept.norm_into_fp8 and (dense_ff or experts_fp8)
                h, normed = self.ff_norms[i](
                    attn_out,
                    residual=x,
                    impl=impl,
                    into_fp8=ff_fp8,
                    keep_rows=ff_fp8 and not dense_ff,
                )
                with jax.named_scope("mlp"):
                    mlp_out = self.ffs[i](normed, kept)
                next_attention = i + 1 < n_layers
                next_norm = self.attn_norms[i + 1] if next_attention else self.final_norm
                x, normed = next_norm(
                    mlp_out,
                    residual=h,
                    impl=kept.norm,
                    into_fp8=layer.norm_into_fp8 and next_attention,
                )
                new_kv.append(layer_kv)
        if sparse is not None:
            return normed, tuple(new_kv), jnp.stack(new_sparse)
        if kept_kv is not None:
            return normed, tuple(new_kv), tuple(new_sparse)
        return normed, tuple(new_kv)

    def forward_groups(
        self,
        x: Array,
        groups: tuple[AttentionGroup, ...],
        kv: tuple[tuple[LayerKV | None, ...], ...],
    ) -> tuple[Array, tuple[tuple[LayerKV, ...], ...]]:
        """A mixed forward: groups of windows of different shapes whose rows share every
        product (q/k/v, output, feed-forward, experts) while each group attends in its own
        shape (`Attention`'s `groups`).

        x: [1, T, model] input embeddings, each group's b·t rows in turn (T their sum); kv:
        per layer, each group's buffers [rows ≥ b, seq, kv_heads, head_dim] (the window's
        K/V are written into their first b rows, which the group attends to) or None (the
        group is a whole sequence: its K/V are returned fresh). Returns the final-norm
        hidden states [1, T, model] and per layer each group's K/V. The forward takes
        `kernels.refresh`'s products; RoPE and the K/V writes run in XLA, each group's
        attention as the group says.
        """
        total = sum(g.rows for g in groups)
        if x.shape[:2] != (1, total):
            raise ValueError(f"x has shape {x.shape}; expected (1, {total}, model)")
        layer = dataclasses.replace(self.kernels.refresh.layers, rope="xla", norm_into_mlp="no")
        if layer.qkv == "rope":
            layer = dataclasses.replace(layer, qkv="mosaic")
        n_layers = self.config.n_layers
        normed = self.attn_norms[0](x)
        new_kv = []
        for i in range(n_layers):
            with jax.named_scope(f"layer_{i}"):
                attn_out, layer_kv, _ = self.attns[i](
                    normed,
                    None,
                    None,
                    kv[i],
                    Window(),
                    kernels=layer,
                    out_impl=layer.out,
                    groups=groups,
                )
                h, normed = self.ff_norms[i](attn_out, residual=x, impl=layer.norm)
                mlp_out = self.ffs[i](normed, layer)
                next_norm = self.attn_norms[i + 1] if i + 1 < n_layers else self.final_norm
                x, normed = next_norm(mlp_out, residual=h, impl=layer.norm)
                new_kv.append(layer_kv)
        return normed, tuple(new_kv)

    def embed(self, token_ids: Array) -> Array:
        """token_ids: [batch, t] -> embeddings [batch, t, model] in the compute dtype."""
        return jnp.take(self.embedding, token_ids, axis=0).astype(self.dtype)

    def embed_distribution(self, probs: Array) -> Array:
        """Expected embedding under a distribution over the (local) vocabulary.

        probs: [batch, t, vocab_local] -> [batch, t, model]; summed over the mesh axis when
        the vocabulary is split.
        """
        table = self.embedding
        if probs.shape[-1] != table.shape[0]:
            shard = jax.lax.axis_index(self.axis_name)
            table = jax.lax.dynamic_slice_in_dim(
                table, shard * probs.shape[-1], probs.shape[-1], axis=0
            )
        out = jnp.einsum("btv,vm->btm", probs.astype(self.dtype), table)
        return out if probs.shape[-1] == self.embedding.shape[0] else _sum_over(out, self.axis_name)

    def logits(self, hidden: Array, start: Any = 0, width: int | None = None) -> Array:
        """hidden: [batch, t, model] -> fp32 logits [batch, t, width] of the local vocabulary
        ids [start, start + width) (`start` may be traced), all of them by default. An fp8
        head (`weights="fp8"`) runs the block forward's fp8 product (`Kernels.fp8`)."""
        head = self.lm_head
        if width is not None:
            head = _vocab_slice(head, start, width)
        with jax.named_scope("head"):
            impl = self.kernels.block.last.fp8
            return fp8.einsum("btm,mv->btv", hidden, head, impl, out_dtype=jnp.float32)
