"""Head-centric sparse attention for the reuse steps of a cached block (opt-in,
`GenerationConfig.attention_sparsity`).

The rule, per layer and per kv head (query heads that share a kv head share its choice):

- at each refresh (the whole-sequence forward that rewrites the K/V buffers), the head
  scores every key position by the attention mass the current block's queries put on it:
  the sum, over the block's queries and the head's query heads, of their softmax
  probabilities, computed from the refresh's own q and k;
- it keeps, in a row with `count` valid keys, `n_row = min(count, ceil(keep · count) +
  block + recent)` positions: always the block's own positions and the `recent` positions
  before it (by RoPE position), then the best-scoring others; padding keys are never kept;
- the block's reuse steps (cached window forwards) attend only to those positions.

`n_row` depends only on the row's own valid keys (its prompt and answer), never on the
program's padded length or on the other rows of the batch, so a row keeps the same keys
whatever bucket its batch-mates put it in. `keep` is taken as the exact fraction `p/q`
nearest to it with `q ≤ 1000` (`keep_fraction`: 0.1 is 1/10, 0.25 is 1/4), and
`ceil(keep · count)` is the integer `(p · count + q − 1) // q`: no float product rounds it
(ceil(0.1 · 70) is 7).

What is read when. A cached step recomputes only its window's K/V (`CachePolicy.window`:
the block under `dual`, the block and everything after it under `prefix`, the block's
vicinity under `vicinity`); every row outside the window keeps what the refresh wrote. So
right after the refresh that chose them (`compact`), each head's kept rows outside the
window are gathered once into compact buffers [b, slots, kv_heads, d] (`KeptKV`, in the K/V
buffers' layout, `kept_slots`: the keys up to a multiple of 8; with their validity per
head and the head's kept rows inside the window), and every cached step of the block
(`attend_kept`) attends to those compact rows, read in place, and to the window's rows of
its own step in the dense buffers, each head masked to the window rows it kept: nothing is
gathered per step. A refresh later in the block chooses and gathers again.

Memory: the compact buffers hold, per layer, keys and values [b, slots, kv_heads, d] in the
K/V dtype (`slots / seq` of the dense K/V buffers' size besides them), plus masks
[b, kv_heads, slots] and [b, kv_heads, window] bool.

The program's slot count `keys = min(seq, ceil(keep · seq) + block + recent)` (`kept_keys`, the
rule at the largest count a row of `seq` positions can have) is static, so a program
compiles once for its lengths; it bounds every row's `n_row`, and a row's slots past its
`n_row` are invalid (`choose` marks them -1, `compact` masks them). A plan whose `keys`
would cover every position takes the dense path (`plan_sparse` returns None), as does
keep = 1: then every row keeps all its keys under the per-row rule as well (`plan_sparse`
says why).

Kernels. The sparse steps attend as `Kernels.attention` says (`attend_kept`'s `impl`,
resolved once by `kernel_choice` as for dense block forwards): `split_kv` runs the compact
part in djax's split-K/V attention kernel (`flash_attention_mosaic.split_kv_partials`),
which reads the compact buffers through strides as it reads the K/V buffers, each query
head masked by its kv head's validity row, and returns each key slice's output and
log-sum-exp; the window part (a window's rows: the block's under `dual`) runs in XLA's
einsums with its own log-sum-exp, and the parts are merged by them. `xla` runs both parts
in XLA's einsums under one softmax (the reference).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from djax.kernels import flash_attention_mosaic
from djax.kernels.flash_attention_mosaic import MASKED, merge_slices
from djax.kernels.tma_ring import ROW_ALIGN

Array = jax.Array

RECENT = 64  # default `recent`: positions before the block every head keeps
MAX_DENOMINATOR = 1000  # of `keep_fraction`: p · count stays in int32 below ~2M keys
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """A program's sparse attention (static). keep: the fraction of the key positions a
    head keeps by score, in (0, 1); recent: positions before the block always kept; keys:
    the positions each head keeps in all (block and recent ones included)."""

    keep: float
    recent: int
    keys: int


def keep_fraction(keep: float) -> Fraction:
    """`keep` as the exact fraction `p/q` nearest to it with `q ≤ 1000` (0.1 -> 1/10): the
    rule's products are taken in integers, exactly."""
    return Fraction(keep).limit_denominator(MAX_DENOMINATOR)


def row_keys(keep: float, recent: int, count: int, block_len: int) -> int:
    """The keys a row with `count` valid keys keeps: `min(count, ceil(keep · count) + block
    + recent)`, `keep` taken as `keep_fraction` (ceil(0.1 · 70) is 7)."""
    f = keep_fraction(keep)
    return min(count, -(-f.numerator * count // f.denominator) + block_len + recent)


def kept_keys(keep: float, recent: int, seq_len: int, block_len: int) -> int:
    """A program's slots per head: `row_keys` at `seq_len`, the largest count a row of the
    program can have. Every row's own count is at most `seq_len`, and `row_keys` never
    decreases with the count, so this bounds every row's."""
    return row_keys(keep, recent, seq_len, block_len)


def plan_sparse(keep: float, recent: int, seq_len: int, block_len: int) -> SparseAttention | None:
    """The sparse attention of a program over `seq_len` positions in blocks of
    `block_len`, or None for the dense path: keep = 1, or every position would be kept.

    The dense path is exact for every row, not only the longest: with `keep ≤ 1`, the
    positions a row drops, `count − ceil(keep · count) − block − recent`, never decrease as
    `count` grows (one more key adds 0 or 1 to `ceil(keep · count)`), so if a row of
    `seq_len` keys drops none, no shorter row drops any."""
    if keep >= 1:
        return None
    if keep_fraction(keep).numerator * seq_len > INT32_MAX:
        raise ValueError(
            f"attention_sparsity={keep} over {seq_len} positions: its kept-key count "
            f"overflows int32; expected a sequence below {INT32_MAX // MAX_DENOMINATOR}"
        )
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
    scores = jnp.where(key_valid[:, None, None, None, :], scores * scale, MASKED)
    return jnp.sum(jax.nn.softmax(scores, axis=-1), axis=(2, 3))


def choose(
    rule: SparseAttention,
    q_block: Array,
    keys: Array,
    key_valid: Array,
    positions: Array,
    block_row: Any,
) -> Array:
    """Each kv head's kept key positions [b, kv_heads, rule.keys] int32: a row's `n_row`
    kept positions ascending after its `rule.keys − n_row` dropped slots, which hold -1.

    q_block: the block's queries [b, B, kv_heads, group, d]; keys [b, s, kv_heads, d] and
    key_valid [b, s] of the whole sequence; positions [b, s] their RoPE positions; block_row:
    the sequence row of the block's first query (may be traced). Always kept: valid keys
    whose position is in `[p0 − recent, p0 + B)`, p0 the block's first position; then the
    best-scoring other valid keys up to the row's `n_row = min(count, ceil(keep · count) +
    B + recent)`, count its valid keys (`row_keys`, computed here in int32)."""
    block_len = q_block.shape[1]
    mass = key_mass(q_block, keys, key_valid)
    p0 = jax.lax.dynamic_slice_in_dim(positions, block_row, 1, axis=1)  # [b, 1]
    forced = key_valid & (positions >= p0 - rule.recent) & (positions < p0 + block_len)
    score = jnp.where(key_valid[:, None, :], mass, -jnp.inf)
    score = jnp.where(forced[:, None, :], jnp.inf, score)
    _, index = jax.lax.top_k(score, rule.keys)  # by score: the forced ones first
    fraction = keep_fraction(rule.keep)
    count = jnp.sum(key_valid, axis=1, dtype=jnp.int32)  # [b]
    by_score = (fraction.numerator * count + fraction.denominator - 1) // fraction.denominator
    n_row = jnp.minimum(count, by_score + block_len + rule.recent)
    rank = jnp.arange(rule.keys, dtype=jnp.int32)
    index = jnp.where(rank < n_row[:, None, None], index.astype(jnp.int32), -1)
    return jnp.sort(index, axis=-1)


class KeptKV(NamedTuple):
    """One layer's kept keys for a block's cached steps (`compact`). keys, values
    [b, slots, kv_heads, d] (the K/V buffers' layout): slot i of head h holds the head's
    i-th kept row outside the window, in ascending position (a slot whose row lies inside the
    window, is padding or was dropped is invalid; `kept_slots` of them); valid
    [b, kv_heads, slots] bool; in_window [b, kv_heads, width] bool: window row r is kept by
    the head."""

    keys: Array
    values: Array
    valid: Array
    in_window: Array


def kept_slots(n: int) -> int:
    """The slots of compact buffers for `n` kept keys per head: `n` up to a multiple of
    `ROW_ALIGN` (8), the rows the split-K/V kernel's TMA reads at a time, so its steps read
    the buffers as they are (a buffer of another length would be copied, padded, at every
    step). The slots past `n` are invalid."""
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def no_kept(buffer: Array, n: int, width: int) -> KeptKV:
    """A zeroed `KeptKV` of `n` kept keys (`kept_slots(n)` slots) and a `width`-row window
    for a layer whose K/V buffers are like `buffer` [b, s, kv_heads, d] (a program's carry
    before its first refresh)."""
    b, _, kv_heads, d = buffer.shape
    slots = kept_slots(n)
    return KeptKV(
        keys=jnp.zeros((b, slots, kv_heads, d), buffer.dtype),
        values=jnp.zeros((b, slots, kv_heads, d), buffer.dtype),
        valid=jnp.zeros((b, kv_heads, slots), bool),
        in_window=jnp.zeros((b, kv_heads, width), bool),
    )


def compact(
    chosen: Array, keys: Array, values: Array, key_valid: Array, start: Any, width: int
) -> KeptKV:
    """The kept rows of one layer, gathered once for a block's cached steps whose window is
    `[start, start + width)` (`start` ≥ 0, may be traced). chosen [b, kv_heads, n]
    (`choose`; a -1 slot is dropped: invalid, outside the window), keys and values
    [b, s, kv_heads, d] (the buffers as the refresh wrote them), key_valid [b, s] bool.
    Returns `kept_slots(n)` slots per head, the last ones invalid."""
    b, kv_heads, n = chosen.shape
    chosen = jnp.pad(chosen, ((0, 0), (0, 0), (0, kept_slots(n) - n)), constant_values=-1)
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kv_heads)[None, :, None]
    kept = chosen >= 0
    row = jnp.maximum(chosen, 0)  # a dropped slot reads row 0, masked below
    inside = kept & (chosen >= start) & (chosen < start + width)
    window_row = jnp.where(inside, chosen - start, width)  # `width`: dropped below
    in_window = jnp.zeros((b, kv_heads, width), bool)
    in_window = in_window.at[rows, heads, window_row].set(True, mode="drop")
    slot_rows = row.transpose(0, 2, 1)  # [b, slots, kv_heads]
    slot_heads = jnp.arange(kv_heads)[None, None, :]
    return KeptKV(
        keys=keys[rows, slot_rows, slot_heads],
        values=values[rows, slot_rows, slot_heads],
        valid=kept & key_valid[rows, row] & ~inside,
        in_window=in_window,
    )


def attend_kept(
    q: Array,
    keys: Array,
    values: Array,
    key_valid: Array,
    kept: KeptKV,
    start: Any,
    impl: str = "xla",
) -> Array:
    """Attention of a cached step's q [b, t, kv_heads, group, d] to each kv head's kept
    keys: the compact rows of `kept` and the rows of the window `[start, start + width)`
    (width = `kept.in_window`'s last axis) of keys, values [b, s, kv_heads, d] (the buffers
    with this step's window written) that the head kept; key_valid [b, s]. Returns
    [b, t, kv_heads, group, d].

    `impl` (`Kernels.attention`): `xla`, one softmax over both parts in XLA's einsums: the
    scores of each part stay apart (no concatenated copy of either the keys or the scores),
    share one maximum, and the output is the sum of the two parts' unnormalized products
    divided once by their summed weights. `split_kv`: the compact rows in the split-K/V
    kernel (`flash_attention_mosaic.split_kv_partials`, each head masked by its own
    validity), the window's rows in XLA, each part normalised with its log-sum-exp, the
    parts merged by them as the kernel's key slices are (`merge_slices`)."""
    if impl == "split_kv":
        return _attend_kept_split_kv(q, keys, values, key_valid, kept, start)
    if impl != "xla":
        raise ValueError(f"attend_kept: impl {impl!r}; expected 'xla' or 'split_kv'")
    d = q.shape[-1]
    window_keys, window_values, window_valid = _window(keys, values, key_valid, kept, start)
    scale = d**-0.5
    kept_scores = jnp.einsum("btkgd,bnkd->bkgtn", q, kept.keys, preferred_element_type=jnp.float32)
    kept_scores = jnp.where(kept.valid[:, :, None, None, :], kept_scores * scale, MASKED)
    window_scores = jnp.einsum(
        "btkgd,bwkd->bkgtw", q, window_keys, preferred_element_type=jnp.float32
    )
    window_scores = jnp.where(window_valid[:, :, None, None, :], window_scores * scale, MASKED)
    top = jnp.maximum(jnp.max(kept_scores, axis=-1), jnp.max(window_scores, axis=-1))[..., None]
    kept_weights = jnp.exp(kept_scores - top)
    window_weights = jnp.exp(window_scores - top)
    total = jnp.sum(kept_weights, axis=-1) + jnp.sum(window_weights, axis=-1)  # [b, kv, g, t]
    out = jnp.einsum(
        "bkgtn,bnkd->btkgd",
        kept_weights.astype(values.dtype),
        kept.values,
        preferred_element_type=jnp.float32,
    ) + jnp.einsum(
        "bkgtw,bwkd->btkgd",
        window_weights.astype(values.dtype),
        window_values,
        preferred_element_type=jnp.float32,
    )
    return (out / total.transpose(0, 3, 1, 2)[..., None]).astype(values.dtype)


def _window(keys: Array, values: Array, key_valid: Array, kept: KeptKV, start: Any):
    """The window's keys and values [b, width, kv_heads, d] from the buffers, and which of
    its rows each head attends to [b, kv_heads, width]: valid ones it kept."""
    width = kept.in_window.shape[-1]
    window_keys = jax.lax.dynamic_slice_in_dim(keys, start, width, axis=1)
    window_values = jax.lax.dynamic_slice_in_dim(values, start, width, axis=1)
    window_valid = jax.lax.dynamic_slice_in_dim(key_valid, start, width, axis=1)
    return window_keys, window_values, window_valid[:, None, :] & kept.in_window


def _attend_kept_split_kv(
    q: Array, keys: Array, values: Array, key_valid: Array, kept: KeptKV, start: Any
) -> Array:
    """`attend_kept`'s `split_kv` path (Mosaic GPU's interpreter off GPUs, for tests). A
    head with no valid compact row gets a log-sum-exp near `MASKED` there, so no weight:
    its output is its window part's."""
    b, t, kv_heads, group, d = q.shape
    heads = q.reshape(b, t, kv_heads * group, d)
    partial, lse = flash_attention_mosaic.split_kv_partials(
        heads, kept.keys, kept.values, kept.valid
    )
    window_out, window_lse = _window_part(q, *_window(keys, values, key_valid, kept, start))
    partial = jnp.concatenate([partial, window_out.reshape(b, 1, *heads.shape[1:])], axis=1)
    lse = jnp.concatenate([lse, window_lse.reshape(b, 1, t, kv_heads * group)], axis=1)
    return merge_slices(partial, lse, values.dtype).reshape(q.shape)


def _window_part(
    q: Array, window_keys: Array, window_values: Array, window_valid: Array
) -> tuple[Array, Array]:
    """Attention of q [b, t, kv_heads, group, d] to the window's rows each head attends to
    (`_window`): the normalised fp32 output [b, t, kv_heads, group, d] and its rows'
    log-sum-exps [b, t, kv_heads, group] (natural log), the probabilities cast to the values'
    dtype before their product, as the kernel casts them."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("btkgd,bwkd->btkgw", q, window_keys, preferred_element_type=jnp.float32)
    scores = jnp.where(window_valid[:, None, :, None, :], scores * scale, MASKED)
    top = jnp.max(scores, axis=-1)
    weights = jnp.exp(scores - top[..., None])
    total = jnp.sum(weights, axis=-1)
    out = jnp.einsum(
        "btkgw,bwkd->btkgd",
        weights.astype(window_values.dtype),
        window_values,
        preferred_element_type=jnp.float32,
    )
    return out / total[..., None], top + jnp.log(total)
