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
`ceil(keep · count)` is computed in integers, exactly: no float product rounds it
(ceil(0.1 · 70) is 7), and no int32 product overflows (`choose` never forms `p · count`).

What is read when. A cached step recomputes only its window's K/V (`CachePolicy.window`:
the block under `dual`, the block and everything after it under `prefix`, the block's
vicinity under `vicinity`), inside the policy's write range; every other row keeps what the
refresh wrote. So right after the refresh that chose them (`compact`), each head's kept rows
outside the window are gathered once into compact buffers [b, slots, kv_heads, d]
(`KeptKV`, in the K/V buffers' layout), whose last `width` slots hold the window's rows
(the refresh's, at first), with each slot's validity per head: a kept valid row outside the
window, or a window row the head kept that is a valid key (`kept_slots`: the kept keys
other than the block's, which every window holds, then the window's rows, up to a multiple
of 8). Every cached step of the block writes its
window's fresh K/V into those window slots in place, in the policy's write range
(`window_slots`: the step's K/V write goes there instead of into the K/V buffers, which
keep the refresh's rows for the gather alone), and attends to the valid slots (`attend_kept`):
nothing is gathered per step. The window's position is fixed within a block, so which of
its rows a head attends to is too. A refresh later in the block chooses and gathers again.

Memory: the compact buffers hold, per layer, keys and values [b, slots, kv_heads, d] in the
K/V dtype (`slots / seq` of the dense K/V buffers' size besides them; `slots` counts the
window's `width` rows besides the kept keys outside the block), plus a mask
[b, kv_heads, slots] bool.

The program's slot count `keys = min(seq, ceil(keep · seq) + block + recent)` (`kept_keys`, the
rule at the largest count a row of `seq` positions can have) is static, so a program
compiles once for its lengths; it bounds every row's `n_row`, and a row's slots past its
`n_row` are invalid (`choose` marks them -1, `compact` masks them). A plan whose `keys`
would cover every position takes the dense path (`plan_sparse` returns None), as does
keep = 1: then every row keeps all its keys under the per-row rule as well (`plan_sparse`
says why).

Kernels. The sparse steps attend as `Kernels.attention` says (`attend_kept`'s `impl`,
resolved once by `kernel_choice` as for dense block forwards): `split_kv` runs one call of
djax's split-K/V attention kernel (`flash_attention_mosaic.split_kv_attention`) over the
compact buffers, read in place through strides as it reads the K/V buffers, each query head
masked by its kv head's validity row; `xla` runs one softmax over the same slots in XLA's
einsums (the reference). The set of keys a head attends to is the same either way.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from djax.kernels import flash_attention_mosaic, fp8_matmul_mosaic
from djax.kernels.flash_attention_mosaic import MASKED
from djax.kernels.handoff import QuantizedRows
from djax.kernels.tma_ring import ROW_ALIGN

Array = jax.Array

RECENT = 64  # default `recent`: positions before the block every head keeps
MAX_DENOMINATOR = 1000  # of `keep_fraction`


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
    p, q = fraction.numerator, fraction.denominator
    # ceil(p · count / q) with no product past count or p · q (<= 10**6): exact in int32
    # for every count a position array holds (p · count itself overflows from ~2M keys)
    by_score = count // q * p + ((count % q) * p + q - 1) // q
    n_row = jnp.minimum(count, by_score + block_len + rule.recent)
    rank = jnp.arange(rule.keys, dtype=jnp.int32)
    index = jnp.where(rank < n_row[:, None, None], index.astype(jnp.int32), -1)
    return jnp.sort(index, axis=-1)


class KeptKV(NamedTuple):
    """One layer's kept keys for a block's cached steps (`compact`). keys, values
    [b, slots, kv_heads, d] (the K/V buffers' layout), `slots = kept_slots(n, block_len,
    width)`: the last `width` slots hold the window's rows `[start, start + width)` in order (the
    refresh's, until a cached step writes its own into them: `window_slots`); the slots
    before them hold each head's kept rows outside the window in ascending position, with
    invalid slots before and after them. valid [b, kv_heads, slots] bool: which slots each
    head attends to (a kept valid row outside the window; a window row the head kept that
    is a valid key)."""

    keys: Array
    values: Array
    valid: Array


def kept_slots(n: int, block_len: int, width: int) -> int:
    """The slots of compact buffers for `n` kept keys per head, `block_len` of them the
    block's own positions (which every head keeps and every window holds), and a
    `width`-row window: the `n − block_len` kept rows that may lie outside the window, then
    the window's `width`, up to a multiple of `ROW_ALIGN` (8), the rows the split-K/V
    kernel's TMA reads at a time, so its steps read the buffers as they are (a buffer of
    another length would be copied, padded, at every step). The slots between the kept rows
    and the window's are invalid."""
    return -(-(n - block_len + width) // ROW_ALIGN) * ROW_ALIGN


def window_slots(window: Any, slots: int, width: int) -> Any:
    """`window` (a `layers.Window` of `width` rows: start, write range) moved to the compact
    buffers' last `width` slots of `slots`: a cached step writes its window's K/V there, in
    the same write range, instead of into the K/V buffers (which only `compact` reads)."""
    offset = slots - width
    shift = offset - window.start
    return dataclasses.replace(
        window,
        start=offset,
        write_lo=None if window.write_lo is None else window.write_lo + shift,
        write_hi=None if window.write_hi is None else window.write_hi + shift,
    )


def no_kept(buffer: Array, n: int, block_len: int, width: int) -> KeptKV:
    """A zeroed `KeptKV` of `n` kept keys, blocks of `block_len` and a `width`-row window
    (`kept_slots(n, block_len, width)` slots) for a layer whose K/V buffers are like `buffer`
    [b, s, kv_heads, d] (a program's carry before its first refresh)."""
    b, _, kv_heads, d = buffer.shape
    slots = kept_slots(n, block_len, width)
    return KeptKV(
        keys=jnp.zeros((b, slots, kv_heads, d), buffer.dtype),
        values=jnp.zeros((b, slots, kv_heads, d), buffer.dtype),
        valid=jnp.zeros((b, kv_heads, slots), bool),
    )


def compact(
    chosen: Array,
    keys: Array,
    values: Array,
    key_valid: Array,
    start: Any,
    block_len: int,
    width: int,
) -> KeptKV:
    """The kept rows of one layer, gathered once for a block's cached steps whose window is
    `[start, start + width)` (`start` ≥ 0, may be traced; the window lies inside the
    buffers and holds the block). chosen [b, kv_heads, n] (`choose`; a -1 slot is dropped),
    which keeps, as `choose` does, every one of the block's `block_len` positions, so at
    most `n − block_len` of a head's rows lie outside the window (more would not fit);
    keys and values [b, s, kv_heads, d] (the buffers as the refresh wrote them), key_valid
    [b, s] bool. Returns `kept_slots(n, block_len, width)` slots per head: the kept rows
    outside the window in ascending position (invalid slots before them where fewer than
    `n − block_len` lie outside, and after them up to the count), then the window's `width`
    rows, which each head attends to where it kept them and they are valid keys."""
    b, kv_heads, n = chosen.shape
    outside_slots = kept_slots(n, block_len, width) - width
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(kv_heads)[None, :, None]
    inside = (chosen >= start) & (chosen < start + width)
    window_row = jnp.where(inside, chosen - start, width)  # `width`: dropped below
    in_window = jnp.zeros((b, kv_heads, width), bool)
    in_window = in_window.at[rows, heads, window_row].set(True, mode="drop")
    window_valid = jax.lax.dynamic_slice_in_dim(key_valid, start, width, axis=1)
    # the rows outside the window, ascending after the dropped ones: the last n − block_len
    outside = jnp.sort(jnp.where(inside, -1, chosen), axis=-1)[..., block_len:]
    outside = jnp.pad(
        outside, ((0, 0), (0, 0), (0, outside_slots - outside.shape[-1])), constant_values=-1
    )
    kept = outside >= 0
    row = jnp.maximum(outside, 0)  # a dropped slot reads row 0, masked below
    slot_rows = row.transpose(0, 2, 1)  # [b, slots, kv_heads]
    slot_heads = jnp.arange(kv_heads)[None, None, :]

    def rows_of(buffer):
        window = jax.lax.dynamic_slice_in_dim(buffer, start, width, axis=1)
        return jnp.concatenate([buffer[rows, slot_rows, slot_heads], window], axis=1)

    return KeptKV(
        keys=rows_of(keys),
        values=rows_of(values),
        valid=jnp.concatenate(
            [kept & key_valid[rows, row], in_window & window_valid[:, None, :]], axis=-1
        ),
    )


def attend_kept(
    q: Array, kept: KeptKV, impl: str = "xla", into_fp8: bool = False
) -> Array | QuantizedRows:
    """Attention of a cached step's q [b, t, kv_heads, group, d] to each kv head's kept
    keys: the slots of `kept` it marks valid (its compact rows and its kept rows of the
    window, which the step has written into `kept`'s window slots, `window_slots`). Returns
    [b, t, kv_heads, group, d].

    `impl` (`Kernels.attention`): `xla`, one softmax over the slots in XLA's einsums (the
    reference); `split_kv`, the split-K/V kernel over the slots
    (`flash_attention_mosaic.split_kv_attention`, each query head masked by its kv head's
    validity row): one kernel call, its key slices merged as in a dense block forward.
    `into_fp8`: the output as `layers.attend` gives it then
    (`fp8_matmul_mosaic.quantize_heads`)."""
    b, t, kv_heads, group, d = q.shape
    if impl == "split_kv":  # Mosaic GPU's interpreter off GPUs (for tests)
        heads = q.reshape(b, t, kv_heads * group, d)
        out = flash_attention_mosaic.split_kv_attention(
            heads, kept.keys, kept.values, kept.valid, out_fp8=into_fp8
        )
        return out if into_fp8 else out.reshape(q.shape)
    if impl != "xla":
        raise ValueError(f"attend_kept: impl {impl!r}; expected 'xla' or 'split_kv'")
    scores = jnp.einsum("btkgd,bskd->bkgts", q, kept.keys, preferred_element_type=jnp.float32)
    scores = jnp.where(kept.valid[:, :, None, None, :], scores * d**-0.5, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(kept.values.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, kept.values)
    return fp8_matmul_mosaic.quantize_heads(out) if into_fp8 else out
