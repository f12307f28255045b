"""Flash attention with the keys split across programs (flash-decoding), as a Pallas Triton
kernel: djax's GPU attention for denoising blocks against a long K/V buffer, and (with
larger query tiles) for refreshes.

A denoising block forward has few queries (32) and a few hundred keys: with one program per
head, as fused attention runs it, there is too little parallelism to hide memory latency.
Here each program takes one query head, one tile of queries and one slice of the
keys; slices, where there are several, are merged afterwards by their log-sum-exp. K/V are
read in the engine's `[batch, seq, kv_heads, head_dim]` buffer layout through strides, so
nothing is transposed. The padding mask is a per-key bias, not a dense `[t, s]` mask.

Semantics are `layers.attend`'s: bidirectional attention with a key-padding mask, scores in
fp32, probabilities cast to the value dtype before the value product.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling

Array = jax.Array
# The additive score bias of a padding key: finite, so a slice of only padding keys stays
# NaN-free (its log-sum-exp is ~-1e30 and it gets no weight in the merge). A query row whose
# keys are all padding (a dummy row) gets an average over slices, not the einsums' uniform one.
MASKED = -1e30
# Keys per slice in a block forward (`tiles_for`): up to this many, one program per query tile
# reads them all and nothing is merged.
KEYS_PER_SLICE = 640


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape: `block_q` queries x `block_k` keys per step, the keys cut into
    `splits` slices (one program each), Triton's `num_warps` and `num_stages`. The defaults
    are only a starting point for sweeps; the engine takes `tiles_for`."""

    block_q: int = 32
    block_k: int = 64
    splits: int = 6
    num_warps: int = 4
    num_stages: int = 3


def tiles_for(t: int, s: int, batch_heads: int) -> Tiles:
    """The tiling for `t` queries against `s` keys, with `batch_heads` (batch x query heads
    on this device) programs per query tile. A block of up to 64 queries takes 16-query
    tiles and one key slice per `KEYS_PER_SLICE` keys (so a few hundred keys need no merge).
    Longer windows (refreshes, prefix-cache windows) take 64-query tiles over all keys while
    that makes at least 64 programs, and are tiled as blocks are with fewer."""
    if t <= 64 or batch_heads * pl.cdiv(t, 64) < 64:
        return Tiles(block_q=16, block_k=64, splits=pl.cdiv(s, KEYS_PER_SLICE), num_stages=3)
    return Tiles(block_q=64, block_k=64, splits=1, num_stages=2)


def fits(head_dim: int) -> bool:
    """Whether the kernel takes this head dim: Triton tiles are powers of two and at least 16
    wide (a query window of any length is tiled and masked)."""
    return tiling.is_block(head_dim)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    out_ref,
    lse_ref,
    *,
    tiles,
    n_heads,
    group,
    split_len,
    program=None,
):
    """One (batch x head, query tile, key slice) program. Refs are whole arrays:
    q [b, t, n, d], k/v [b, s, kv, d], bias [b, s]; out [b, splits, t, n, d] (fp32 when split,
    else the final [b, t, n, d]), lse [b, splits, t, n] or None. `program`: the program's
    (batch x head, query tile, key slice) where a kernel holding other work as well numbers
    its programs itself (default: this grid's ids)."""
    from jax.experimental.pallas import triton as plgpu

    batch_head, q_tile, split = program or (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    batch, head = batch_head // n_heads, batch_head % n_heads
    kv_head = head // group
    t, s, d = q_ref.shape[1], k_ref.shape[1], q_ref.shape[3]
    queries = q_tile * tiles.block_q + jnp.arange(tiles.block_q)
    q_ok = queries < t
    q = plgpu.load(
        q_ref.at[batch, pl.ds(q_tile * tiles.block_q, tiles.block_q), head, :],
        mask=q_ok[:, None],
        other=0.0,
    )
    scale = d**-0.5

    def step(i, carry):
        acc, row_max, row_sum = carry
        start = split * split_len + i * tiles.block_k
        key_ok = start + jnp.arange(tiles.block_k) < s
        keys = plgpu.load(
            k_ref.at[batch, pl.ds(start, tiles.block_k), kv_head, :],
            mask=key_ok[:, None],
            other=0.0,
        )
        bias = plgpu.load(
            bias_ref.at[batch, pl.ds(start, tiles.block_k)], mask=key_ok, other=MASKED
        )
        scores = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * scale + bias[None, :]
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        p = jnp.exp(scores - new_max[:, None])
        correction = jnp.exp(row_max - new_max)
        values = plgpu.load(
            v_ref.at[batch, pl.ds(start, tiles.block_k), kv_head, :],
            mask=key_ok[:, None],
            other=0.0,
        )
        pv = jnp.dot(p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return acc * correction[:, None] + pv, new_max, row_sum * correction + p.sum(axis=-1)

    carry = (
        jnp.zeros((tiles.block_q, d), jnp.float32),
        jnp.full((tiles.block_q,), MASKED, jnp.float32),
        jnp.zeros((tiles.block_q,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, split_len // tiles.block_k, step, carry)
    out = (acc / row_sum[:, None]).astype(out_ref.dtype)
    rows = pl.ds(q_tile * tiles.block_q, tiles.block_q)
    if lse_ref is None:
        plgpu.store(out_ref.at[batch, rows, head, :], out, mask=q_ok[:, None])
    else:
        plgpu.store(out_ref.at[batch, split, rows, head, :], out, mask=q_ok[:, None])
        plgpu.store(lse_ref.at[batch, split, rows, head], row_max + jnp.log(row_sum), mask=q_ok)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def split_kv_attention(
    q: Array,
    keys: Array,
    values: Array,
    key_valid: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Array:
    """Bidirectional grouped-query attention with a key-padding mask.

    q: [batch, t, heads, head_dim]; keys, values: [batch, s, kv_heads, head_dim];
    key_valid: [batch, s] bool. Returns [batch, t, heads, head_dim] in q's dtype.
    `tiles`: the program shape (default: `tiles_for(t, s, batch * heads)`). `interpret`: run
    in Pallas's interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import triton as plgpu

    b, t, n, d = q.shape
    s, kv_heads = keys.shape[1], keys.shape[2]
    if not fits(d) or n % kv_heads:
        raise ValueError(
            f"split_kv_attention: q {q.shape}, keys {keys.shape}; expected a power-of-two "
            "head dim >= 16 and heads a multiple of kv heads"
        )
    tiles = tiles or tiles_for(t, s, b * n)
    if not (tiling.is_block(tiles.block_q) and tiling.is_block(tiles.block_k)):
        raise ValueError(f"{tiles}: block_q and block_k must be powers of two >= 16")
    block_q = min(tiles.block_q, max(16, pl.next_power_of_2(t)))
    split_len = tiles.block_k * pl.cdiv(pl.cdiv(s, tiles.splits), tiles.block_k)
    splits = pl.cdiv(s, split_len)
    tiles = dataclasses.replace(tiles, block_q=block_q, splits=splits)
    bias = jnp.where(key_valid, 0.0, MASKED).astype(jnp.float32)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((b, t, n, d), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((b, splits, t, n, d), jnp.float32),
            jax.ShapeDtypeStruct((b, splits, t, n), jnp.float32),
        ]
    kernel = functools.partial(
        _kernel, tiles=tiles, n_heads=n, group=n // kv_heads, split_len=split_len
    )
    if splits == 1:
        kernel = functools.partial(_no_lse, kernel)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b * n, pl.cdiv(t, block_q), splits),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=tiling.interpret_mode(interpret),
        name="split_kv_attention",
    )(q, keys, values, bias)
    if splits == 1:
        return outs[0]
    return merge_slices(*outs, q.dtype)


def merge_slices(partial: Array, lse: Array, dtype) -> Array:
    """The attention output from its key slices' normalised fp32 outputs partial
    [b, splits, t, n, d] and log-sum-exps lse [b, splits, t, n], each weighted by its share
    of the softmax's total, in `dtype`."""
    weights = jax.nn.softmax(lse, axis=1)  # [b, splits, t, n]
    return jnp.einsum("bjtn,bjtnd->btnd", weights, partial).astype(dtype)


def _no_lse(kernel, q_ref, k_ref, v_ref, bias_ref, out_ref):
    kernel(q_ref, k_ref, v_ref, bias_ref, out_ref, None)
