"""Flash attention with the keys split across CTAs (flash-decoding) as a Pallas Mosaic GPU
kernel (Hopper: TMA copies, WGMMA): `flash_attention.split_kv_attention`'s contract, off the
Triton backend (`attention_impl="split_kv_mosaic"`).

Each CTA owns one (batch row, query head, tile of 64 queries, key slice). It copies its
query tile into shared memory once, then steps through its slice `block_k` keys at a time:
TMA brings each step's key and value tiles (read through strides from the engine's
`[batch, seq, kv_heads, head_dim]` buffers, nothing transposed) and the keys' padding bias
into a ring of `stages` slots; WGMMA computes the scores `Q K^T` into a 64-row fp32
accumulator, the bias is added per key, the online softmax runs in registers (base 2), and
WGMMA adds the probabilities (cast to the value dtype) times the values into the output
accumulator. A tile's query rows past the window's end are read by TMA as zeros and never
stored, so a 32-query block needs no padded copy. Slices, where there are several, write
fp32 partial outputs and their log-sum-exps, merged afterwards as the Triton kernel's are
(`flash_attention.merge_slices`).

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

from djax.kernels import flash_attention, tma_ring
from djax.kernels.tma_ring import ROW_ALIGN, ROW_TILE, SHARED_MEMORY, TILE

Array = jax.Array
LOG2E = math.log2(math.e)
# The fewest CTAs `tiles_for` aims at by cutting the keys into slices.
MIN_CTAS = 96
# The fewest keys of a slice `tiles_for` cuts (two steps of 64).
MIN_SLICE = 128


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape: a CTA per 64 queries of one head and per key slice (of `splits`),
    stepping `block_k` keys at a time through a ring of `stages` slots. `block_k` is a
    multiple of 64."""

    block_k: int = 64
    splits: int = 1
    stages: int = 4

    def shared_bytes(self, head_dim: int, itemsize: int, out_bytes: int) -> int:
        """Shared memory of a CTA: the query tile, the ring's key, value and bias slots
        and the output tile (`out_bytes` per value) with its log-sum-exps."""
        slot = 2 * self.block_k * head_dim * itemsize + self.block_k * 4
        tile = ROW_TILE * head_dim
        return tile * itemsize + self.stages * slot + tile * out_bytes + ROW_TILE * 4


def tiles_for(t: int, s: int, batch_heads: int) -> Tiles:
    """The tiling for `t` queries against `s` keys, with `batch_heads` (batch x query heads
    on this device) CTAs per query tile: 64-key steps, 4 stages, and the keys cut into the
    fewest slices of at least `MIN_SLICE` keys that give `MIN_CTAS` CTAs (a block of 32
    queries against 384 keys at 32 heads: 3 slices)."""
    ctas = batch_heads * pl.cdiv(t, ROW_TILE)
    splits = max(1, min(pl.cdiv(s, MIN_SLICE), pl.cdiv(MIN_CTAS, ctas)))
    return Tiles(block_k=TILE, splits=splits, stages=4)


def fits(head_dim: int) -> bool:
    """Whether the kernel takes this head dim: a multiple of 64, so the query, key and value
    tiles are whole swizzled rows."""
    return head_dim % TILE == 0


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
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_slot, (1, 0)))
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
    *refs,
    tiles,
    n_heads,
    group,
    q_tiles,
    steps,
    t,
    split_out,
    interpreting,
):
    """One CTA: one (batch x head, query tile, key slice) of q [b, t, n, d] against keys and
    values [b, s, kv, d] with the bias [b, splits x steps x block_k] (0, or `MASKED` on
    padding keys, added to the scores in base 2), into out [b, t, n, d] (one slice) or the
    fp32 partial outputs [b, splits, t, n, d] and log-sum-exps [b, splits, n, 64 x q_tiles]
    (`split_out`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if split_out:
        out_gmem, lse_gmem, *scratch = refs
    else:
        (out_gmem, *scratch), lse_gmem = refs, None
    q_smem, k_slots, v_slots, bias_slots, o_smem, lse_smem = scratch[:6]
    q_bar, k_bars, v_bars, bias_bars = scratch[6:]
    cta = jax.lax.axis_index("cta")
    split, rest = cta % tiles.splits, cta // tiles.splits
    q_tile, batch_head = rest % q_tiles, rest // q_tiles
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group
    rows = pl.ds(q_tile * ROW_TILE, ROW_TILE)
    d = q_smem.shape[-1]
    plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head], q_smem, q_bar.at[0])

    def fetch(step, slot):
        keys = pl.ds((split * steps + step) * tiles.block_k, tiles.block_k)
        plgpu.copy_gmem_to_smem(k_gmem.at[batch, keys, kv_head], k_slots.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[batch, keys, kv_head], v_slots.at[slot], v_bars.at[slot])
        plgpu.copy_gmem_to_smem(bias_gmem.at[batch, keys], bias_slots.at[slot], bias_bars.at[slot])

    for step in range(min(tiles.stages, steps)):
        fetch(step, step)
    plgpu.barrier_wait(q_bar.at[0])
    scale = d**-0.5 * LOG2E  # scores in base 2: exp2 of them is exp of the true ones

    def step(i, carry):
        acc, row_max, row_sum = carry
        slot = jax.lax.rem(i, tiles.stages)
        plgpu.barrier_wait(k_bars.at[slot])
        scores = _scores(q_smem, k_slots.at[slot], interpreting)
        plgpu.barrier_wait(bias_bars.at[slot])
        bias = tma_ring.accumulator_columns(bias_slots[slot], interpreting)
        scores = scores * scale + jax.lax.broadcast_in_dim(bias, scores.shape, [1])
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp2(row_max - new_max)
        p = jnp.exp2(scores - jax.lax.broadcast_in_dim(new_max, scores.shape, [0]))
        row_sum = row_sum * correction + p.sum(axis=1)
        plgpu.barrier_wait(v_bars.at[slot])

        pv = _weighted_values(p.astype(v_slots.dtype), v_slots.at[slot], interpreting)
        acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0]) + pv

        @pl.when(i + tiles.stages < steps)
        def _refill():
            fetch(i + tiles.stages, slot)

        return acc, new_max, row_sum

    carry = (
        _laid_out(jnp.zeros((ROW_TILE, d), jnp.float32), interpreting),
        tma_ring.accumulator_rows(
            jnp.full((ROW_TILE,), flash_attention.MASKED, jnp.float32), interpreting
        ),
        tma_ring.accumulator_rows(jnp.zeros((ROW_TILE,), jnp.float32), interpreting),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, steps, step, carry)
    o_smem[...] = (acc / jax.lax.broadcast_in_dim(row_sum, acc.shape, [0])).astype(o_smem.dtype)
    if lse_gmem is None:
        tma_ring.store_rows(o_smem, lambda rows: out_gmem.at[batch, rows, head], q_tile, t)
        return
    lse_smem[...] = (row_max + jnp.log2(row_sum)) / LOG2E
    tma_ring.store_rows(
        o_smem,
        lambda rows: out_gmem.at[batch, split, rows, head],
        q_tile,
        t,
        (lse_smem, lambda rows: lse_gmem.at[batch, split, head, rows], q_tiles * ROW_TILE),
    )


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def split_kv_attention(
    q: Array,
    keys: Array,
    values: Array,
    key_valid: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Array:
    """Bidirectional grouped-query attention with a key-padding mask, in Mosaic GPU.

    q: [batch, t, heads, head_dim]; keys, values: [batch, s, kv_heads, head_dim], all bf16
    or all fp16, head_dim a multiple of 64; key_valid: [batch, s] bool. Returns
    [batch, t, heads, head_dim] in q's dtype (as `flash_attention.split_kv_attention`).
    `tiles`: the program shape (default `tiles_for(t, s, batch * heads)`; more slices than
    `block_k` steps are clamped); `interpret`: run in Mosaic GPU's interpreter (default:
    exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, t, n, d = q.shape
    s, kv_heads = keys.shape[1], keys.shape[2]
    name = "flash_attention_mosaic.split_kv_attention"
    if (
        keys.shape != (b, s, kv_heads, d)
        or values.shape != keys.shape
        or key_valid.shape != (b, s)
        or not fits(d)
        or n % kv_heads
    ):
        raise ValueError(
            f"{name}: q {q.shape}, keys {keys.shape}, values {values.shape}, key_valid "
            f"{key_valid.shape}; expected keys and values [{b}, s, kv_heads, {d}], key_valid "
            f"[{b}, s], a head dim that is a multiple of {TILE} and heads a multiple of kv heads"
        )
    if not tma_ring.takes_dtype(q.dtype) or keys.dtype != q.dtype or values.dtype != q.dtype:
        raise ValueError(
            f"{name}: q {q.dtype}, keys {keys.dtype}, values {values.dtype}; expected all "
            "bfloat16 or all float16"
        )
    tiles = tiles or tiles_for(t, s, b * n)
    if tiles.block_k % TILE or tiles.splits < 1 or tiles.stages < 1:
        raise ValueError(
            f"{tiles}: block_k must be a multiple of {TILE}, splits and stages at least 1"
        )
    steps = pl.cdiv(pl.cdiv(s, tiles.block_k), tiles.splits)
    splits = pl.cdiv(pl.cdiv(s, tiles.block_k), steps)  # every slice holds keys
    tiles = dataclasses.replace(tiles, splits=splits, stages=min(tiles.stages, steps))
    split_out = splits > 1
    out_dtype = jnp.float32 if split_out else q.dtype
    used = tiles.shared_bytes(d, q.dtype.itemsize, jnp.dtype(out_dtype).itemsize)
    if used > SHARED_MEMORY:
        raise ValueError(f"{tiles}: {used} bytes of shared memory; at most {SHARED_MEMORY}")
    q_tiles = pl.cdiv(t, ROW_TILE)
    padded = splits * steps * tiles.block_k
    bias = jnp.where(key_valid, 0.0, flash_attention.MASKED).astype(jnp.float32)
    bias = jnp.pad(bias, ((0, 0), (0, padded - s)), constant_values=flash_attention.MASKED)
    if split_out:
        out_type = (
            jax.ShapeDtypeStruct((b, splits, t, n, d), jnp.float32),
            jax.ShapeDtypeStruct((b, splits, n, q_tiles * ROW_TILE), jnp.float32),
        )
    else:
        out_type = jax.ShapeDtypeStruct((b, t, n, d), q.dtype)
    params = tma_ring.interpret_params(interpret)
    swizzled = tma_ring.swizzled()
    slots = (tiles.stages, tiles.block_k, d)
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
            interpreting=params is not None,
        ),
        out_type=out_type,
        grid=(b * n * q_tiles * splits,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((ROW_TILE, d), q.dtype, transforms=swizzled),
            plgpu.SMEM(slots, q.dtype, transforms=swizzled),
            plgpu.SMEM(slots, q.dtype, transforms=swizzled),
            plgpu.SMEM((tiles.stages, tiles.block_k), jnp.float32),
            plgpu.SMEM((ROW_TILE, d), out_dtype),
            plgpu.SMEM((ROW_TILE,), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            *(plgpu.Barrier(num_barriers=tiles.stages) for _ in range(3)),
        ],
        interpret=params,
    )
    inputs = (_aligned(q, 1), _aligned(keys, 1), _aligned(values, 1), bias)
    if not split_out:
        return kernel(*inputs)
    partial, lse = kernel(*inputs)
    return flash_attention.merge_slices(partial, lse[..., :t].transpose(0, 1, 3, 2), q.dtype)
