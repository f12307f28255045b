"""Flash attention with the keys split across CTAs (flash-decoding) as a Pallas Mosaic GPU
kernel (Hopper: TMA copies, WGMMA): djax's GPU attention for denoising blocks against a long
K/V buffer and for refreshes (`attention_impl="split_kv"`). Semantics are `layers.attend`'s:
bidirectional attention with a key-padding mask (a per-key bias, not a dense `[t, s]`
mask), scores in fp32, probabilities cast to the value dtype before the value product. The
mask is one per batch row, or one per kv head (`[b, kv_heads, s]`: each CTA reads its kv
head's row), as sparse attention's compact kept rows take it
(`djax.models.sparse_attention`).

Each CTA owns one (batch row, query head, tile of 64 queries) and `splits` CTAs share its
keys; within a CTA, each of its `warpgroups` warpgroups owns one key slice. A warpgroup's
query tile is in shared memory (copied once per CTA); it steps through its slice `block_k`
keys at a time, and stops after the last step that holds a valid key of its row (or kv
head), so right-padded rows (the server's layout) read none of their padding steps. TMA
brings each step's key and value tiles (read through strides from the engine's `[batch,
seq, kv_heads, head_dim]` buffers, nothing transposed) and the keys' padding bias into the
warpgroup's own ring of `stages` slots; WGMMA computes the scores
`Q K^T` into a 64-row fp32 accumulator, the bias is added per key, the online softmax runs
in registers (base 2), and WGMMA adds the probabilities (cast to the value dtype) times the
values into the output accumulator. A tile's query rows past the window's end are read by
TMA as zeros and never stored, so a 32-query block needs no padded copy.

A CTA's warpgroups merge their slices in shared memory: they exchange their row maxima and
sums, then each adds its output, weighted by its share of the softmax's total, into one fp32
tile in turn, and the last one stores the sum. CTAs of several `splits` write fp32 partial
outputs [b, splits, t, n, d] and their rows' log-sum-exps [b, splits, n, 64 x query tiles]
(TMA stores whole rows of both), merged afterwards by their log-sum-exps (`merge_slices`).
For an fp8 product after it (`out_fp8`, heads of 128 features), a CTA that holds all of a
head's keys writes its output in e4m3, each row with a scale of its own; split outputs are
quantised so after their merge.

The kernel is lowered with Mosaic GPU's warpgroup semantics (its layouts and shared-memory
transforms inferred), named explicitly so every jax version lowers it the same way.

Rules: q, keys and values of one 16-bit dtype (bf16 or fp16), head dim a multiple of 64
(tiles swizzled at 128 bytes), `block_k` a multiple of 64. Keys past the buffer's end are
read as zeros and masked by the bias, which the wrapper pads to whole slices. TMA reads
the query and key rows in runs of 8: a window or buffer length that is not a multiple of 8
is padded with zero rows for the kernel (an extra copy of q, or of the K/V buffers).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import fp8_matmul_mosaic, tma_ring
from djax.kernels.handoff import QuantizedRows
from djax.kernels.tma_ring import ROW_ALIGN, ROW_TILE, SHARED_MEMORY, SWIZZLE, TILE

Array = jax.Array
LOG2E = math.log2(math.e)
# The additive score bias of a padding key: finite, so a step of padding keys before a row's
# last valid key stays NaN-free (a slice of them alone has a log-sum-exp of ~-1e30 and gets no
# weight in the merge). A query row whose keys are all padding (a dummy row) runs no step and
# gets zeros, not the einsums' uniform average.
MASKED = -1e30
# The fewest CTAs (query tiles x heads) `tiles_for` takes for a window of one key slice.
MIN_CTAS = 96
# The most warpgroups of a CTA, each streaming its own key slice.
MAX_WARPGROUPS = 3
# The most keys of one CTA in a block forward (`tiles_for`): more are cut across CTAs.
KEYS_PER_CTA = 640
# The softmax sum of a slice that ran no key step (wholly past its row's last valid key):
# its output is then 0 / EMPTY_SUM = 0 and its log-sum-exp ~MASKED, weighted 0 by the merges.
# Any slice with a step has a sum of at least 1 (its maximum's own term).
EMPTY_SUM = 1e-30


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape: `splits` CTAs per 64 queries of one head, each of `warpgroups`
    warpgroups streaming one key slice (so `splits x warpgroups` slices) `block_k` keys at
    a time through its own ring of `stages` slots. `block_k` is a multiple of 64, a CTA
    holds at most `MAX_WARPGROUPS` warpgroups."""

    block_k: int = 64
    splits: int = 1
    stages: int = 4
    warpgroups: int = 1

    def shared_bytes(self, head_dim: int, itemsize: int, split_out: bool) -> int:
        """Shared memory of a CTA, each buffer from a 1024-byte boundary: the query tile,
        each warpgroup's ring of key, value and bias slots, the output tile (fp32 where
        `split_out`, else of `itemsize`) and its rows' log-sum-exps; where warpgroups
        merge, their row maxima and sums, and an fp32 tile to add their outputs into, which
        with the output tiles reuses the rings' memory."""
        tile = ROW_TILE * head_dim
        ring = [2 * self.warpgroups * self.stages * self.block_k * head_dim * itemsize]
        ring.append(self.warpgroups * self.stages * self.block_k * 4)
        out = [tile * (4 if split_out else itemsize), ROW_TILE * 4]
        query = _aligned_bytes(tile * itemsize)
        if self.warpgroups == 1:
            return query + _aligned_bytes(*ring, *out)
        stats = _aligned_bytes(*[self.warpgroups * ROW_TILE * 4] * 2)
        return query + max(_aligned_bytes(*ring), _aligned_bytes(*out, tile * 4)) + stats


def _aligned_bytes(*sizes: int) -> int:
    """Bytes of buffers of `sizes` bytes, each from a 1024-byte boundary (Mosaic GPU's
    alignment of shared memory buffers)."""
    return sum(-(-size // 1024) * 1024 for size in sizes)


def tiles_for(
    t: int,
    s: int,
    batch_heads: int,
    head_dim: int = 128,
    itemsize: int = 2,
) -> Tiles:
    """The tiling for `t` queries against `s` keys, with `batch_heads` (batch x query heads on
    this device) CTAs per query tile, of head dim `head_dim` and `itemsize`-byte values.
    Windows with at least `MIN_CTAS` query tiles x heads (refreshes, large batches): one
    slice, 64-key steps, 2 stages (at head dim 128, two CTAs of 16-bit outputs fit on an
    SM), one where two do not fit.
    Fewer (blocks): one warpgroup per CTA, 128-key steps through 2 stages, the keys cut
    across CTAs into slices of at most `KEYS_PER_CTA` keys (merged by log-sum-exp after
    the kernel); 64-key steps, then one stage, where the ring would not fit in shared
    memory. Several warpgroups per CTA (`Tiles.warpgroups`) are taken only when asked
    for."""
    ctas = batch_heads * pl.cdiv(t, ROW_TILE)
    if ctas >= MIN_CTAS:
        splits, rings = 1, ((TILE, 2), (TILE, 1))
    else:
        splits, rings = pl.cdiv(s, KEYS_PER_CTA), ((2 * TILE, 2), (TILE, 2), (TILE, 1))
    for block_k, stages in rings:
        tiles = Tiles(block_k=block_k, splits=splits, stages=stages)
        if tiles.shared_bytes(head_dim, itemsize, splits > 1) <= SHARED_MEMORY:
            return tiles
    return tiles  # the smallest ring: `fits` refuses the head dims it does not fit


def fits(head_dim: int, itemsize: int = 2) -> bool:
    """Whether the kernel takes this head dim: a multiple of 64, so the query, key and value
    tiles are whole swizzled rows, whose smallest program (64-key steps, one stage, an fp32
    output tile) fits in shared memory."""
    smallest = Tiles(block_k=TILE, splits=2, stages=1)
    fitting = smallest.shared_bytes(head_dim, itemsize, True) <= SHARED_MEMORY
    return head_dim % TILE == 0 and fitting


def _laid_out(value: Array, interpreting: bool) -> Array:
    """Inside a kernel: `value` [64, n] laid out as an accumulator (the identity on values;
    Mosaic GPU's interpreter takes the value as it is)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return value if interpreting else plgpu.layout_cast(value, plgpu.Layout.WGMMA)


def _aligned(x: Array, axis: int) -> Array:
    """x with zeros appended along `axis` up to a multiple of `ROW_ALIGN` (itself when
    aligned): TMA reads swizzled tiles of rows in runs of 8."""
    missing = -x.shape[axis] % ROW_ALIGN
    if not missing:
        return x
    return jnp.pad(x, [(0, missing if i == axis else 0) for i in range(x.ndim)])


def _scores(q_smem, k_slot, interpreting: bool) -> Array:
    """Inside a kernel: the scores `q k^T` [64, block_k] fp32 of the query tile q_smem
    [64, d] and a key slot k_slot [block_k, d], by WGMMA reading the keys transposed.
    Mosaic GPU's interpreter has no transposed WGMMA operand: there the tiles are read and
    multiplied as arrays."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpreting:
        q, k = q_smem[...], k_slot[...]
        return jnp.dot(q, k.T, preferred_element_type=jnp.float32)

    def scores_of(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_slot.transpose((1, 0)))
        return acc_ref[...]  # read back: the products are done

    return pl.run_scoped(scores_of, plgpu.ACC((ROW_TILE, k_slot.shape[0]), jnp.float32))


def _weighted_values(p: Array, v_slot, interpreting: bool) -> Array:
    """Inside a kernel: `p v` [64, d] fp32 of the probabilities p [64, block_k] (in
    registers, the values' dtype) and a value slot v_slot [block_k, d], by WGMMA. Mosaic GPU's
    interpreter has no WGMMA operand in registers: there the slot is read and multiplied as
    an array. Once it returns, the slot may be refilled."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpreting:
        return jnp.dot(p, v_slot[...], preferred_element_type=jnp.float32)

    def values_of(acc_ref):
        plgpu.wgmma(acc_ref, p, v_slot)
        return acc_ref[...]

    return pl.run_scoped(values_of, plgpu.ACC((ROW_TILE, v_slot.shape[1]), jnp.float32))


def _kernel(
    q_gmem,
    k_gmem,
    v_gmem,
    bias_gmem,
    key_steps_gmem,
    *refs,
    tiles,
    n_heads,
    group,
    q_tiles,
    steps,
    t,
    split_out,
    per_head,
    out_fp8,
    interpreting,
):
    """One CTA: one (batch x head, query tile, split) of q [b, t, n, d] against keys and
    values [b, s, kv, d] with the bias [b, slices x steps x block_k], or with `per_head` each
    kv head's own [b, kv, slices x steps x block_k] (0, or `MASKED` on padding keys, added to
    the scores in base 2), its warpgroups each streaming the slice
    `split x warpgroups + warpgroup` up to the row's (or kv head's) last key step holding a
    valid key (`key_steps` [b] or [b, kv]; a slice wholly past it runs none), into out
    [b, t, n, d] (one split) or, `split_out`, each split's normalised fp32 output
    [b, splits, t, n, d] and its rows' log-sum-exps [b, splits, n, 64 x q_tiles]; with
    `out_fp8` (one split) as e4m3 values [b, t, n, d] and their scales [n, b, t8], each row
    of a head quantised on its own (`fp8_matmul_mosaic.quantize`'s rule)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if split_out:
        out_gmem, lse_gmem, *refs = refs
    elif out_fp8:
        out_gmem, scale_gmem, *refs = refs
    else:
        out_gmem, *refs = refs
    q_smem, (rings, tiles_out), q_bar, k_bars, v_bars, bias_bars, *merge = refs
    k_slots, v_slots, bias_slots = rings
    o_smem, lse_smem, *sum_tile = tiles_out
    merging = tiles.warpgroups > 1
    cta = jax.lax.axis_index("cta")
    wg = jax.lax.axis_index("wg") if merging else 0
    split, rest = cta % tiles.splits, cta // tiles.splits
    q_tile, batch_head = rest % q_tiles, rest // q_tiles
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group
    rows = pl.ds(q_tile * ROW_TILE, ROW_TILE)
    first_key_step = (split * tiles.warpgroups + wg) * steps
    # The steps after the row's last valid key hold padding only, whose probabilities are
    # exactly 0 beside any valid key: they are skipped. A slice wholly past it runs none:
    # its sum stays 0 (read as `EMPTY_SUM`), its maximum MASKED, and the merges give it no
    # weight.
    row_steps = key_steps_gmem[batch, kv_head] if per_head else key_steps_gmem[batch]
    n_steps = jnp.minimum(jnp.maximum(row_steps - first_key_step, 0), steps)
    d = q_smem.shape[-1]

    @pl.when(wg == 0)
    def _query():
        plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head], q_smem, q_bar.at[0])

    def fetch(step, slot):
        keys = pl.ds((first_key_step + step) * tiles.block_k, tiles.block_k)
        ring = wg * tiles.stages + slot  # this warpgroup's slots
        plgpu.copy_gmem_to_smem(k_gmem.at[batch, keys, kv_head], k_slots.at[ring], k_bars.at[ring])
        plgpu.copy_gmem_to_smem(v_gmem.at[batch, keys, kv_head], v_slots.at[ring], v_bars.at[ring])
        bias = bias_gmem.at[batch, kv_head, keys] if per_head else bias_gmem.at[batch, keys]
        plgpu.copy_gmem_to_smem(bias, bias_slots.at[ring], bias_bars.at[ring])

    for first in range(min(tiles.stages, steps)):
        pl.when(first < n_steps)(functools.partial(fetch, first, first))
    plgpu.barrier_wait(q_bar.at[0])
    scale = d**-0.5 * LOG2E  # scores in base 2: exp2 of them is exp of the true ones

    def step(i, carry):
        acc, row_max, row_sum = carry
        slot = jax.lax.rem(i, tiles.stages)
        ring = wg * tiles.stages + slot
        plgpu.barrier_wait(k_bars.at[ring])
        scores = _scores(q_smem, k_slots.at[ring], interpreting)
        plgpu.barrier_wait(bias_bars.at[ring])
        bias = tma_ring.accumulator_columns(bias_slots[ring], interpreting)
        scores = scores * scale + jax.lax.broadcast_in_dim(bias, scores.shape, [1])
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp2(row_max - new_max)
        p = jnp.exp2(scores - jax.lax.broadcast_in_dim(new_max, scores.shape, [0]))
        row_sum = row_sum * correction + p.sum(axis=1)
        plgpu.barrier_wait(v_bars.at[ring])

        pv = _weighted_values(p.astype(v_slots.dtype), v_slots.at[ring], interpreting)
        acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0]) + pv

        @pl.when(i + tiles.stages < n_steps)
        def _refill():
            fetch(i + tiles.stages, slot)

        return acc, new_max, row_sum

    carry = (
        _laid_out(jnp.zeros((ROW_TILE, d), jnp.float32), interpreting),
        tma_ring.accumulator_rows(jnp.full((ROW_TILE,), MASKED, jnp.float32), interpreting),
        tma_ring.accumulator_rows(jnp.zeros((ROW_TILE,), jnp.float32), interpreting),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, n_steps, step, carry)
    if merging:
        acc, row_max, row_sum = _merged(
            acc, row_max, row_sum, wg, tiles, (*merge, *sum_tile), interpreting
        )
    else:
        row_sum = jnp.maximum(row_sum, EMPTY_SUM)
        acc = acc / jax.lax.broadcast_in_dim(row_sum, acc.shape, [0])

    @pl.when(wg == tiles.warpgroups - 1)
    def _store():
        out = acc
        if merging:  # the other warpgroups' shares
            out = _laid_out(sum_tile[0][...], interpreting) + acc
        values_at = lambda rows: out_gmem.at[batch, rows, head]  # noqa: E731
        if out_fp8:  # each row quantised on its own; its scale in the lse tile
            scale = fp8_matmul_mosaic.scale_of(jnp.max(jnp.abs(out), axis=1))
            lse_smem[...] = scale
            out = fp8_matmul_mosaic.e4m3_values(
                out, jax.lax.broadcast_in_dim(scale, out.shape, [0])
            )
            o_smem[...] = out.astype(o_smem.dtype)
            scales_at = lambda rows: scale_gmem.at[head, batch, rows]  # noqa: E731
            t8 = scale_gmem.shape[-1]
            tma_ring.store_rows(o_smem, values_at, q_tile, t, (lse_smem, scales_at, t8))
            return
        o_smem[...] = out.astype(o_smem.dtype)
        if not split_out:
            tma_ring.store_rows(o_smem, values_at, q_tile, t)
            return
        lse_smem[...] = (row_max + jnp.log2(row_sum)) / LOG2E
        tma_ring.store_rows(
            o_smem,
            lambda rows: out_gmem.at[batch, split, rows, head],
            q_tile,
            t,
            (lse_smem, lambda rows: lse_gmem.at[batch, split, head, rows], q_tiles * ROW_TILE),
        )


def _merged(acc, row_max, row_sum, wg, tiles, refs, interpreting):
    """Inside a kernel, in each warpgroup: from this warpgroup's unnormalised output acc
    [64, d] and its rows' base-2 maximum and sum, (its share of the CTA's normalised output,
    the base-2 maximum and sum over all the CTA's slices). The warpgroups write their maxima
    and sums to shared memory; then all but the last add their shares in turn into the fp32
    sum tile (swizzled, as WGMMA's accumulator layout reads it without bank conflicts), for
    the last to add its own to. refs: the maxima and sums [warpgroups, 64], the warpgroups'
    barrier and the sum tile [64, d]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    max_smem, sum_smem, done, sum_tile = refs
    max_smem[wg] = row_max
    sum_smem[wg] = row_sum

    def all_arrived():
        plgpu.barrier_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])

    all_arrived()  # every slice's statistics are written, and every ring is done
    maxima = [tma_ring.accumulator_rows(max_smem[j], interpreting) for j in range(tiles.warpgroups)]
    sums = [tma_ring.accumulator_rows(sum_smem[j], interpreting) for j in range(tiles.warpgroups)]
    total_max = functools.reduce(jnp.maximum, maxima)
    total = sum(s * jnp.exp2(m - total_max) for m, s in zip(maxima, sums, strict=True))
    total = jnp.maximum(total, EMPTY_SUM)  # every slice of the CTA past the row's keys
    weight = jnp.exp2(row_max - total_max) / total
    share = acc * jax.lax.broadcast_in_dim(weight, acc.shape, [0])
    for j in range(tiles.warpgroups - 1):

        @pl.when(wg == j)
        def _add(j=j):
            if j:
                sum_tile[...] = _laid_out(sum_tile[...], interpreting) + share
            else:
                sum_tile[...] = share

        all_arrived()
    return share, total_max, total


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "out_fp8"))
def split_kv_attention(
    q: Array,
    keys: Array,
    values: Array,
    key_valid: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
    out_fp8: bool = False,
) -> Array | QuantizedRows:
    """Bidirectional grouped-query attention with a key-padding mask, in Mosaic GPU.

    q: [batch, t, heads, head_dim]; keys, values: [rows, s, kv_heads, head_dim] with rows ≥
    batch, of which the first `batch` are q's (the rest are not read: a pool's leading
    slots attend in place), all bf16 or all fp16, head_dim a multiple of 64; key_valid:
    [batch, s] bool, or [batch, kv_heads, s] (each kv head's own keys). Returns
    [batch, t, heads, head_dim] in q's dtype.
    `tiles`: the program shape (default `tiles_for(t, s, batch * heads, ...)`; more splits
    than key slices need are clamped, and a CTA's last warpgroups may get slices wholly
    past the keys, masked); `interpret`: run in Mosaic GPU's interpreter (default: exactly
    off GPUs, as the CPU tests do). `out_fp8` (head_dim `fp8_matmul_mosaic.SLICE`): the
    output as an fp8 product takes it, `QuantizedRows` of e4m3 values [batch, t, heads ·
    head_dim] and scales [heads, batch · t] (each row of each head quantised on its own,
    `fp8_matmul_mosaic.quantize_slices`' rule), written by the kernel where one CTA holds
    a head's keys, quantised after the merge where they are cut into slices.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, t, n, d = q.shape
    s, kv_heads = keys.shape[1], keys.shape[2]
    name = "flash_attention_mosaic.split_kv_attention"
    if (
        keys.shape[0] < b
        or keys.shape[1:] != (s, kv_heads, d)
        or values.shape != keys.shape
        or key_valid.shape not in ((b, s), (b, kv_heads, s))
        or not fits(d)
        or n % kv_heads
    ):
        raise ValueError(
            f"{name}: q {q.shape}, keys {keys.shape}, values {values.shape}, key_valid "
            f"{key_valid.shape}; expected keys and values [≥ {b}, s, kv_heads, {d}], key_valid "
            f"[{b}, s] or [{b}, kv_heads, s], a head dim that is a multiple of {TILE} and "
            "heads a multiple of kv heads"
        )
    if out_fp8 and d != fp8_matmul_mosaic.SLICE:
        raise ValueError(
            f"{name}: an e4m3 output takes heads of {fp8_matmul_mosaic.SLICE} features (a "
            f"scale per head and row); got head_dim {d}"
        )
    if not tma_ring.takes_dtype(q.dtype) or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise ValueError(
            f"{name}: q {q.dtype}, keys {keys.dtype}, values {values.dtype}; expected all "
            "bfloat16 or all float16"
        )
    tiles = tiles or tiles_for(t, s, b * n, d, q.dtype.itemsize)
    if (
        tiles.block_k % TILE
        or tiles.splits < 1
        or tiles.stages < 1
        or not 1 <= tiles.warpgroups <= MAX_WARPGROUPS
    ):
        raise ValueError(
            f"{tiles}: block_k must be a multiple of {TILE}, splits and stages at least 1, "
            f"warpgroups 1 to {MAX_WARPGROUPS}"
        )
    wgs = tiles.warpgroups
    steps = pl.cdiv(pl.cdiv(s, tiles.block_k), tiles.splits * wgs)
    splits = pl.cdiv(pl.cdiv(s, tiles.block_k), steps * wgs)  # every CTA holds keys
    tiles = dataclasses.replace(tiles, splits=splits, stages=min(tiles.stages, steps))
    split_out = splits > 1
    used = tiles.shared_bytes(d, q.dtype.itemsize, split_out)
    if used > SHARED_MEMORY:
        raise ValueError(f"{tiles}: {used} bytes of shared memory; at most {SHARED_MEMORY}")
    q_tiles = pl.cdiv(t, ROW_TILE)
    padded = splits * wgs * steps * tiles.block_k
    bias = jnp.where(key_valid, 0.0, MASKED).astype(jnp.float32)
    bias = jnp.pad(bias, [(0, 0)] * (bias.ndim - 1) + [(0, padded - s)], constant_values=MASKED)
    # each row's (or kv head's) key steps up to its last valid key
    last = jnp.max(jnp.where(key_valid, jnp.arange(1, s + 1, dtype=jnp.int32), 0), axis=-1)
    key_steps = (last + tiles.block_k - 1) // tiles.block_k
    kernel_fp8 = out_fp8 and not split_out
    out_dtype = jnp.float32 if split_out else fp8_matmul_mosaic.FP8 if kernel_fp8 else q.dtype
    t8 = tma_ring.aligned(t)
    if split_out:  # each split's output and its rows' log-sum-exps (TMA stores whole rows)
        out_type = (
            jax.ShapeDtypeStruct((b, splits, t, n, d), jnp.float32),
            jax.ShapeDtypeStruct((b, splits, n, q_tiles * ROW_TILE), jnp.float32),
        )
    elif kernel_fp8:  # e4m3 values and a scale per row of each head (rows padded to 8)
        out_type = (
            jax.ShapeDtypeStruct((b, t, n, d), out_dtype),
            jax.ShapeDtypeStruct((n, b, t8), jnp.float32),
        )
    else:
        out_type = jax.ShapeDtypeStruct((b, t, n, d), q.dtype)
    params = tma_ring.interpret_params(interpret)
    swizzled = tma_ring.swizzled()
    slots = (wgs * tiles.stages, tiles.block_k, d)
    rings = (
        plgpu.SMEM(slots, q.dtype, transforms=swizzled),
        plgpu.SMEM(slots, q.dtype, transforms=swizzled),
        plgpu.SMEM((wgs * tiles.stages, tiles.block_k), jnp.float32),
    )
    tiles_out = [
        plgpu.SMEM((ROW_TILE, d), out_dtype),
        plgpu.SMEM((ROW_TILE,), jnp.float32),
    ]
    merge, threads = [], {}
    if wgs > 1:  # row maxima and sums, the warpgroups' barrier, the sum tile
        merge = [
            plgpu.SMEM((wgs, ROW_TILE), jnp.float32),
            plgpu.SMEM((wgs, ROW_TILE), jnp.float32),
            # num_barriers named: the ref is [1] (indexed `.at[0]`) in every jax version
            plgpu.Barrier(num_arrivals=wgs, num_barriers=1),
        ]
        fp32_swizzled = (plgpu.TilingTransform((8, SWIZZLE // 4)), plgpu.SwizzleTransform(SWIZZLE))
        tiles_out.append(plgpu.SMEM((ROW_TILE, d), jnp.float32, transforms=fp32_swizzled))
        threads = {"num_threads": wgs, "thread_name": "wg"}
    memory = (rings, tuple(tiles_out))
    if wgs > 1 and params is None:  # the output tiles reuse the rings, done when they are used
        memory = plgpu.RefUnion(*memory)
    scratch = [
        plgpu.SMEM((ROW_TILE, d), q.dtype, transforms=swizzled),
        memory,
        plgpu.Barrier(num_barriers=1),
        *(plgpu.Barrier(num_barriers=wgs * tiles.stages) for _ in range(3)),
        *merge,
    ]
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            n_heads=n,
            group=n // kv_heads,
            q_tiles=q_tiles,
            steps=steps,
            t=t,
            split_out=split_out,
            per_head=key_valid.ndim == 3,
            out_fp8=kernel_fp8,
            interpreting=params is not None,
        ),
        out_type=out_type,
        grid=(b * n * q_tiles * splits,),
        grid_names=("cta",),
        scratch_types=scratch,
        # jax 0.11's default, named so jax 0.10's CUDA lowering runs the same layout inference
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=params,
        **threads,
    )
    if s % ROW_ALIGN:  # padded, so copied: q's rows alone, not a whole pool's
        keys, values = keys[:b], values[:b]
    inputs = (_aligned(q, 1), _aligned(keys, 1), _aligned(values, 1), bias, key_steps)
    if kernel_fp8:
        values, scale = kernel(*inputs)
        scale = scale if t8 == t else scale[..., :t]
        return QuantizedRows(values.reshape(b, t, n * d), scale.reshape(n, b * t), q.dtype)
    if not split_out:
        return kernel(*inputs)
    partial, lse = kernel(*inputs)
    lse = lse[..., :t].transpose(0, 1, 3, 2)
    if not out_fp8:
        return merge_slices(partial, lse, q.dtype)
    rows = fp8_matmul_mosaic.quantize_heads(merge_slices(partial, lse, jnp.float32))
    return dataclasses.replace(rows, dtype=q.dtype)


def merge_slices(partial: Array, lse: Array, dtype) -> Array:
    """The attention output from its key slices' normalised fp32 outputs partial
    [b, splits, t, n, d] and log-sum-exps lse [b, splits, t, n], each weighted by its share
    of the softmax's total, in `dtype`."""
    weights = jax.nn.softmax(lse, axis=1)  # [b, splits, t, n]
    return jnp.einsum("bjtn,bjtnd->btnd", weights, partial).astype(dtype)
