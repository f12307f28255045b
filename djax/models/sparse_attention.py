"""Head-centric sparse attention for the reuse steps of a cached block (opt-in,
`GenerationConfig.attention_sparsity`).

The rule, per layer and per kv head (query heads that share a kv head share its choice):

- at each refresh (the whole-sequence forward that rewrites the K/V buffers), the head
  scores every key position by the attention mass the current block's queries put on it:
  the sum, over the block's queries and the head's query heads, of their softmax
  probabilities, computed from the refresh's own q and k;
- it keeps `keys` positions: always the block's own positions and the `recent` positions
  before it (by RoPE position), then the best-scoring others; padding keys are never kept
  (where `keys` exceeds a row's real keys, the extra slots hold masked keys);
- the block's reuse steps (cached window forwards) attend only to those positions: each
  head gathers its K/V rows from the dense buffers, which keep their layout.

`keys = min(seq, ceil(keep · seq) + block + recent)` is static, so a program compiles once
for its lengths. A plan whose `keys` would cover every position takes the dense path
(`plan_sparse` returns None), as does keep = 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from djax.kernels import flash_attention

Array = jax.Array

RECENT = 64  # default `recent`: positions before the block every head keeps


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """A program's sparse attention (static). keep: the fraction of the key positions a
    head keeps by score, in (0, 1); recent: positions before the block always kept; keys:
    the positions each head keeps in all (block and recent ones included)."""

    keep: float
    recent: int
    keys: int


def kept_keys(keep: float, recent: int, seq_len: int, block_len: int) -> int:
    """`min(seq, ceil(keep · seq) + block + recent)` (the product rounded to 1e-9 first, so
    0.1 · 70 is 7, not 8)."""
    return min(seq_len, math.ceil(round(keep * seq_len, 9)) + block_len + recent)


def plan_sparse(keep: float, recent: int, seq_len: int, block_len: int) -> SparseAttention | None:
    """The sparse attention of a program over `seq_len` positions in blocks of
    `block_len`, or None for the dense path: keep = 1, or every position would be kept."""
    if keep >= 1:
        return None
    keys = kept_keys(keep, recent, seq_len, block_len)
    if keys >= seq_len:
        return None
    return SparseAttention(keep, recent, keys)


def key_mass(q_block: Array, keys: Array, key_valid: Array) -> Array:
    """The attention mass each kv head's block queries put on each key: q_block
    [b, B, kv_heads, group, d], keys [b, s, kv_heads, d], key_valid [b, s] -> [b, kv_heads, s]
    fp32, the softmax probabilities (over the valid keys) summed over the B queries and the
    group's query heads."""
    scale = q_block.shape[-1] ** -0.5
    scores = jnp.einsum("btkgd,bskd->bkgts", q_block, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(key_valid[:, None, None, None, :], scores * scale, flash_attention.MASKED)
    return jnp.sum(jax.nn.softmax(scores, axis=-1), axis=(2, 3))


def choose(
    rule: SparseAttention,
    q_block: Array,
    keys: Array,
    key_valid: Array,
    positions: Array,
    block_row: Any,
) -> Array:
    """Each kv head's kept key positions [b, kv_heads, rule.keys] int32, ascending.

    q_block: the block's queries [b, B, kv_heads, group, d]; keys [b, s, kv_heads, d] and
    key_valid [b, s] of the whole sequence; positions [b, s] their RoPE positions; block_row:
    the sequence row of the block's first query (may be traced). Always kept: valid keys
    whose position is in `[p0 − recent, p0 + B)`, p0 the block's first position."""
    block_len = q_block.shape[1]
    mass = key_mass(q_block, keys, key_valid)
    p0 = jax.lax.dynamic_slice_in_dim(positions, block_row, 1, axis=1)  # [b, 1]
    forced = key_valid & (positions >= p0 - rule.recent) & (positions < p0 + block_len)
    score = jnp.where(key_valid[:, None, :], mass, -jnp.inf)
    score = jnp.where(forced[:, None, :], jnp.inf, score)
    _, index = jax.lax.top_k(score, rule.keys)
    return jnp.sort(index, axis=-1).astype(jnp.int32)


def gather_rows(buffer: Array, index: Array) -> Array:
    """buffer [b, s, kv_heads, d], index [b, kv_heads, n] -> each head's rows
    [b, kv_heads, n, d]."""
    b, kv_heads = index.shape[:2]
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kv_heads)[None, :, None]
    return buffer[rows, index, heads]


def attend_chosen(
    q: Array, keys: Array, values: Array, key_valid: Array, chosen: Array, impl: str = "xla"
) -> Array:
    """Attention of q [b, t, kv_heads, group, d] to each kv head's chosen keys only:
    keys, values [b, s, kv_heads, d] (the dense buffers), key_valid [b, s], chosen
    [b, kv_heads, n] (`choose`). Returns [b, t, kv_heads, group, d]. `impl="split_kv"` runs
    the split-K/V kernel on the gathered rows (one sequence per row and head); any other
    value, XLA's einsums."""
    b, t, kv_heads, group, d = q.shape
    k_rows, v_rows = gather_rows(keys, chosen), gather_rows(values, chosen)  # [b, kv, n, d]
    valid = jnp.take_along_axis(
        jnp.broadcast_to(key_valid[:, None, :], (b, kv_heads, key_valid.shape[1])), chosen, axis=2
    )
    n = chosen.shape[2]
    if impl == "split_kv":  # Pallas's interpreter off GPUs (for tests)
        heads_q = q.transpose(0, 2, 1, 3, 4).reshape(b * kv_heads, t, group, d)
        out = flash_attention.split_kv_attention(
            heads_q,
            k_rows.reshape(b * kv_heads, n, 1, d),
            v_rows.reshape(b * kv_heads, n, 1, d),
            valid.reshape(b * kv_heads, n),
        )
        return out.reshape(b, kv_heads, t, group, d).transpose(0, 2, 1, 3, 4)
    scale = d**-0.5
    scores = jnp.einsum("btkgd,bknd->bkgtn", q, k_rows, preferred_element_type=jnp.float32)
    scores = jnp.where(valid[:, :, None, None, :], scores * scale, flash_attention.MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("bkgtn,bknd->btkgd", probs, v_rows)
