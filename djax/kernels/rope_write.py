"""From the fused q/k/v product to attention's inputs in one Pallas Triton kernel: the
optional q/k RMSNorm and clip, RoPE on queries and keys, and the window's keys and values
written into the K/V buffers in place.

In a block forward XLA spends three kernels per layer here (RoPE as a concatenate fusion,
then one dynamic-update-slice per buffer), each moving well under a megabyte at block rows:
the cost is launches and latency, not bytes. Here one program per (sequence, kv head, tile
of window positions) reads that head's query, key and value rows once and writes all three
results.

The q/k/v product may come as a split-K matmul's fp32 partial products
(`handoff.Partials`): the kernel adds them and rounds to the activation dtype first, as
`Partials.total()` would. In a denoising block it can also run inside the kernel
(`project_rope_and_write`): one program per (kv head, slot) computes that head's rows from
the normed window, so the product never goes through memory and one launch is saved.

Semantics are those of `layers.Attention`'s XLA path: `rms_norm` with the q/k scales, the
clip, rotate-half RoPE in fp32 from the given cos/sin tables, and buffer rows outside the
write range left as they were.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling
from djax.kernels.handoff import Partials, ScaledRows, add_slices, load_inv_rms

Array = jax.Array
BLOCK_T = 32  # window positions per program


@dataclasses.dataclass(frozen=True)
class HeadOps:
    """What the kernel applies to each head before RoPE: q/k RMSNorm with `eps` when
    `qk_norm` (the scales are arguments), then a clip to `[-clip, clip]` on q, k and v when
    `clip` is not None."""

    qk_norm: bool = False
    eps: float = 1e-6
    clip: float | None = None


def _parts(head_dim: int, rotary_dim: int) -> tuple[tuple[int, int], ...]:
    """A head's feature ranges `(start, size)`: the two rotary halves, then the rest."""
    half = rotary_dim // 2
    rest = ((rotary_dim, head_dim - rotary_dim),) if rotary_dim < head_dim else ()
    return ((0, half), (half, half)) + rest


def fits(head_dim: int, rotary_dim: int) -> bool:
    """Whether the kernel takes these heads: each part of a head (`_parts`) is a power of
    two wide, as Triton's tiles are."""
    return all(tiling.is_power_of_two(size) for _, size in _parts(head_dim, rotary_dim))


def _finish(head, parts, ops: HeadOps, dtype, scale_ref=None):
    """A head's parts (fp32 [rows, size] each, holding `dtype` values) after the q/k norm
    (`layers.rms_norm` over the whole head, rounding where it does; with `scale_ref`) and the
    clip."""
    if scale_ref is not None:
        d = sum(size for _, size in parts)
        inv_rms = jax.lax.rsqrt(sum(jnp.sum(p * p, axis=1) for p in head) / d + ops.eps)
        normed = []
        for p, (lo, size) in zip(head, parts, strict=True):
            scale = scale_ref[pl.ds(lo, size)].astype(jnp.float32)
            p = (p * inv_rms[:, None]).astype(dtype).astype(jnp.float32)
            normed.append((p * scale).astype(dtype).astype(jnp.float32))
        head = normed
    if ops.clip is not None:
        head = [jnp.clip(p, -ops.clip, ops.clip) for p in head]
    return head


def _rope(head, cos, sin):
    """Rotate-half RoPE on a head's parts: the two rotary halves turn, the rest stays."""
    x1, x2, *rest = head
    return [x1 * cos + -x2 * sin, x2 * cos + x1 * sin, *rest]


def _store(ref, index, head, parts, ok):
    """A head's parts into `ref.at[index + (part,)]`, rows where `ok`."""
    from jax.experimental.pallas import triton as plgpu

    for p, (lo, size) in zip(head, parts, strict=True):
        plgpu.store(ref.at[index + (pl.ds(lo, size),)], p.astype(ref.dtype), mask=ok)


def _buffer_rows(bounds_ref, keys_ref, t: int, first, row_ok):
    """Where window rows `first + [0, BLOCK_T)` go in the K/V buffers and which are written,
    as `layers.write_window` does: (first buffer row, write mask [BLOCK_T, 1]). A window
    reaching past the buffer's end sits at its last `t` rows."""
    start, write_lo, write_hi = bounds_ref[0], bounds_ref[1], bounds_ref[2]
    base = jnp.minimum(jnp.maximum(start, 0), keys_ref.shape[1] - t)
    positions = start + first + jnp.arange(BLOCK_T)
    return base + first, row_ok & ((positions >= write_lo) & (positions < write_hi))[:, None]


def _kernel(*refs, ops: HeadOps, parts, group: int, buffered: bool):
    """One (sequence, kv head, position tile) program. Refs are whole arrays, in order:
    bounds [3] int32 (start, write_lo, write_hi), qkv [splits, b, t, kv, group + 2, d]
    (fp32 partial products, or the activation dtype with one split), cos/sin
    [b, t, rotary / 2] fp32, then the q and k scales [d] (with `qk_norm`), then the key and
    value buffers [b, s, kv, d] (with `buffered`; aliased to the outputs); outputs q
    [b, t, kv, group, d], keys, values [b, s, kv, d]."""
    from jax.experimental.pallas import triton as plgpu

    bounds_ref, qkv_ref, cos_ref, sin_ref, *refs = refs
    (q_scale, k_scale), refs = (refs[:2], refs[2:]) if ops.qk_norm else ((None, None), refs)
    q_ref, keys_ref, values_ref = refs[2:] if buffered else refs
    batch, kv_head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    splits, t, dtype = qkv_ref.shape[0], qkv_ref.shape[2], q_ref.dtype
    first = tile * BLOCK_T
    rows = pl.ds(first, BLOCK_T)
    row_ok = (first + jnp.arange(BLOCK_T) < t)[:, None]
    buffer_first, write_ok = first, row_ok  # a fresh whole-window array: every row
    if buffered:
        buffer_first, write_ok = _buffer_rows(bounds_ref, keys_ref, t, first, row_ok)

    def load(index):
        """Head `index` of the kv head's slot, as fp32 parts [BLOCK_T, size], its partial
        products summed and rounded to the activation dtype."""
        out = []
        for lo, size in parts:
            slices = [
                plgpu.load(
                    qkv_ref.at[
                        jnp.int32(s), batch, rows, kv_head, jnp.int32(index), pl.ds(lo, size)
                    ],
                    mask=row_ok,
                    other=0.0,
                ).astype(jnp.float32)
                for s in range(splits)
            ]
            out.append(add_slices(slices, dtype))
        return out

    table = batch, rows, pl.ds(0, parts[0][1])
    cos = plgpu.load(cos_ref.at[table], mask=row_ok, other=0.0)
    sin = plgpu.load(sin_ref.at[table], mask=row_ok, other=0.0)
    for j in range(group):
        head = _rope(_finish(load(j), parts, ops, dtype, q_scale), cos, sin)
        _store(q_ref, (batch, rows, kv_head, jnp.int32(j)), head, parts, row_ok)
    key = _rope(_finish(load(group), parts, ops, dtype, k_scale), cos, sin)
    buffer_rows = pl.ds(buffer_first, BLOCK_T)
    _store(keys_ref, (batch, buffer_rows, kv_head), key, parts, write_ok)
    value = _finish(load(group + 1), parts, ops, dtype)
    _store(values_ref, (batch, buffer_rows, kv_head), value, parts, write_ok)


def _buffer_and_scale_problems(b, kv_heads, d, buffers, scales, ops: HeadOps) -> list[str]:
    """What is wrong with the K/V buffers [b, s, kv_heads, d] and q/k norm scales [d]."""
    problems = []
    if buffers is not None and any(
        buf.shape[::2] != (b, kv_heads) or buf.shape[3] != d for buf in buffers
    ):
        problems.append(f"buffers {[buf.shape for buf in buffers]}")
    if ops.qk_norm != (scales is not None) or scales and any(s.shape != (d,) for s in scales):
        problems.append(f"qk_norm={ops.qk_norm} with scales {scales and [s.shape for s in scales]}")
    return problems


def _run(kernel, grid, inputs, shape, dtype, buffers, num_warps, num_stages, interpret, name):
    """The `pallas_call` both wrappers share: outputs q [b, t, kv_heads, group, d] in
    `dtype` and the keys and values (the buffers, aliased to the last two inputs, or fresh
    [b, t, kv_heads, d] arrays); `shape` is (b, t, kv_heads, group, d)."""
    from jax.experimental.pallas import triton as plgpu

    b, t, kv_heads, _, d = shape
    kv_shape = buffers[0].shape if buffers is not None else (b, t, kv_heads, d)
    out_shape = [
        jax.ShapeDtypeStruct(shape, dtype),
        *(
            jax.ShapeDtypeStruct(kv_shape, dtype if buffers is None else buf.dtype)
            for buf in (buffers or (None, None))
        ),
    ]
    aliases = {len(inputs) - 2: 1, len(inputs) - 1: 2} if buffers is not None else {}
    return tuple(
        pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            input_output_aliases=aliases,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=tiling.interpret_mode(interpret),
            name=name,
        )(*inputs)
    )


@functools.partial(jax.jit, static_argnames=("ops", "num_warps", "interpret"))
def rope_and_write(
    qkv: Array | Partials,
    cos: Array,
    sin: Array,
    buffers: tuple[Array, Array] | None,
    bounds: Array,
    scales: tuple[Array, Array] | None = None,
    ops: HeadOps = HeadOps(),
    num_warps: int = 4,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """Queries ready for attention and the K/V buffers with the window's rows written.

    qkv: [b, t, kv_heads, group + 2, head_dim] (per kv head: its query heads, key, value),
    or `Partials` of that shape;
    cos, sin: [b, t, rotary_dim / 2] fp32 (`layers.rope_tables`); buffers: (keys, values)
    [b, s, kv_heads, head_dim], updated in place, or None for a whole-sequence window (then
    fresh [b, t, kv_heads, head_dim] arrays come back); bounds: int32 [3] = (window start,
    write_lo, write_hi): window row `i` sits at position `start + i` and is written when
    that lies in `[write_lo, write_hi)`; scales: the q and k norm scales [head_dim] (with
    `ops.qk_norm`). Returns (q [b, t, kv_heads, group, head_dim], keys, values).
    Like `layers.write_window`, a window reaching past the buffer's end is written at its
    last `t` rows. `interpret`: run in Pallas's interpreter (default: exactly off GPUs, as
    the CPU tests do).
    """
    products = qkv.parts if isinstance(qkv, Partials) else qkv[None]
    b, t, kv_heads, heads_per_kv, d = products.shape[1:]
    rotary = 2 * cos.shape[-1]
    group = heads_per_kv - 2
    problems = []
    if group < 1 or cos.shape != (b, t, rotary // 2) or sin.shape != cos.shape:
        problems.append(f"qkv {products.shape[1:]} with cos {cos.shape}, sin {sin.shape}")
    if not (0 < rotary <= d and fits(d, rotary)):
        problems.append(f"rotary dim {rotary} for head dim {d}")
    problems += _buffer_and_scale_problems(b, kv_heads, d, buffers, scales, ops)
    if problems:
        raise ValueError(
            f"rope_and_write: {'; '.join(problems)}; expected qkv [b, t, kv_heads, group + 2, "
            "d] with group >= 1, cos/sin [b, t, r / 2] for an even r in (0, d] with r / 2 "
            "and d - r powers of two (or d - r = 0), buffers [b, s, kv_heads, d], and q/k "
            "scales [d] exactly when qk_norm"
        )
    inputs = [bounds.astype(jnp.int32), products, cos, sin, *(scales or ()), *(buffers or ())]
    kernel = functools.partial(
        _kernel, ops=ops, parts=_parts(d, rotary), group=group, buffered=buffers is not None
    )
    grid = (b, kv_heads, pl.cdiv(t, BLOCK_T))
    shape = (b, t, kv_heads, group, d)
    return _run(
        kernel, grid, inputs, shape, qkv.dtype, buffers, num_warps, 1, interpret, "rope_and_write"
    )


def projection_fits(t: int, model: int, head_dim: int, rotary_dim: int) -> bool:
    """Whether `project_rope_and_write` takes this window and these heads: at most
    `BLOCK_T` window positions, a model width that is a multiple of 16, and head parts
    (`_parts`) that are Triton matmul tiles (powers of two, at least 16)."""
    return (
        t <= BLOCK_T
        and model % 16 == 0
        and all(tiling.is_block(size) for _, size in _parts(head_dim, rotary_dim))
    )


def _project_kernel(
    *refs, ops: HeadOps, parts, group: int, buffered: bool, block_k: int, norm_eps: float | None
):
    """One (kv head, slot) program: slot `j < group` is query head j of the kv head, then
    its key, then its value. Refs are whole arrays, in order: bounds [3] int32, x [b, t, k]
    (with `norm_eps`, then the squares [tiles, b, t] of `ScaledRows`), w [k, kv, group + 2,
    d], cos/sin [b, t, rotary / 2] fp32, the q and k scales [d] (with `qk_norm`), the key
    and value buffers [b, s, kv, d] (with `buffered`; aliased to the outputs); outputs q
    [b, t, kv, group, d], keys, values [b, s, kv, d]."""
    from jax.experimental.pallas import triton as plgpu

    bounds_ref, x_ref, *refs = refs
    squares_ref, refs = (refs[0], refs[1:]) if norm_eps is not None else (None, refs)
    w_ref, cos_ref, sin_ref, *refs = refs
    (q_scale, k_scale), refs = (refs[:2], refs[2:]) if ops.qk_norm else ((None, None), refs)
    q_ref, keys_ref, values_ref = refs[2:] if buffered else refs
    kv_head, slot = pl.program_id(0), pl.program_id(1)
    b, t, k = x_ref.shape
    dtype = q_ref.dtype
    rows = pl.ds(0, BLOCK_T)
    row_ok = (jnp.arange(BLOCK_T) < t)[:, None]
    buffer_first, write_ok = 0, row_ok
    if buffered:
        buffer_first, write_ok = _buffer_rows(bounds_ref, keys_ref, t, 0, row_ok)

    def step(i, heads):
        """One `block_k` slice of the contraction: the slot's weight parts are read once
        and used for every sequence."""
        ks = pl.ds(i * block_k, block_k)
        ws = [w_ref[ks, kv_head, slot, pl.ds(lo, size)] for lo, size in parts]
        out = []
        for seq, head in enumerate(heads):
            x = plgpu.load(x_ref.at[jnp.int32(seq), rows, ks], mask=row_ok, other=0.0)
            out.append(
                tuple(
                    acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
                    for acc, w in zip(head, ws, strict=True)
                )
            )
        return tuple(out)

    zeros = tuple(jnp.zeros((BLOCK_T, size), jnp.float32) for _, size in parts)
    # The RMSNorm of x, as rows scaled after the product: the sums of squares are read
    # before the weight loop, so their load is not in the kernel's tail.
    inv_rms = [
        load_inv_rms(squares_ref, (jnp.int32(seq), rows), row_ok[:, 0], k, norm_eps)
        for seq in range(b)
        if squares_ref is not None
    ]
    heads = jax.lax.fori_loop(0, k // block_k, step, (zeros,) * b)

    def emit(seq, head):
        """Sequence `seq`'s product for this slot, rounded as `Partials.total()` rounds it,
        through the slot's head ops and into its output."""
        if squares_ref is not None:
            head = [p * inv_rms[seq] for p in head]
        seq = jnp.int32(seq)
        head = [p.astype(dtype).astype(jnp.float32) for p in head]
        table = seq, rows, pl.ds(0, parts[0][1])
        cos = plgpu.load(cos_ref.at[table], mask=row_ok, other=0.0)
        sin = plgpu.load(sin_ref.at[table], mask=row_ok, other=0.0)
        buffer_rows = pl.ds(buffer_first, BLOCK_T)

        @pl.when(slot < group)
        def _query():
            query = _rope(_finish(head, parts, ops, dtype, q_scale), cos, sin)
            _store(q_ref, (seq, rows, kv_head, slot), query, parts, row_ok)

        @pl.when(slot == group)
        def _key():
            key = _rope(_finish(head, parts, ops, dtype, k_scale), cos, sin)
            _store(keys_ref, (seq, buffer_rows, kv_head), key, parts, write_ok)

        @pl.when(slot == group + 1)
        def _value():
            value = _finish(head, parts, ops, dtype)
            _store(values_ref, (seq, buffer_rows, kv_head), value, parts, write_ok)

    for seq, head in enumerate(heads):
        emit(seq, head)


@functools.partial(jax.jit, static_argnames=("ops", "num_warps", "num_stages", "interpret"))
def project_rope_and_write(
    x: Array | ScaledRows,
    w: Array,
    cos: Array,
    sin: Array,
    buffers: tuple[Array, Array] | None,
    bounds: Array,
    scales: tuple[Array, Array] | None = None,
    ops: HeadOps = HeadOps(),
    num_warps: int = 4,
    num_stages: int = 4,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """`rope_and_write(x @ w, ...)` with the q/k/v product inside the same kernel: djax's
    GPU path for a denoising block, where the product is a skinny, weight-read-bound matmul.
    One program per (kv head, slot) computes that head's [t, head_dim] product for every
    sequence, reading its weight columns once, then finishes it as `rope_and_write` does.

    x: [b, t, model] normed window rows (t <= BLOCK_T), or `ScaledRows` whose RMSNorm the
    kernel applies to the product's rows; w: [model, kv_heads, group + 2,
    head_dim]; the rest as `rope_and_write`. Returns (q [b, t, kv_heads, group, head_dim],
    keys, values). The product is rounded to x's dtype before the head ops, as
    `split_k.Partials.total()` rounds it.
    """

    squares, norm_eps = None, None
    if isinstance(x, ScaledRows):
        x, squares, norm_eps = x.scaled, x.squares, x.eps
    if x.ndim != 3 or w.ndim != 4 or w.shape[0] != x.shape[-1] or w.shape[2] < 3:
        raise ValueError(
            f"project_rope_and_write: x {x.shape} with w {w.shape}; expected x [b, t, model] "
            "and w [model, kv_heads, group + 2, d] with group >= 1"
        )
    (b, t, model), (kv_heads, slots, d) = x.shape, w.shape[1:]
    rotary, group = 2 * cos.shape[-1], slots - 2
    problems = []
    if cos.shape != (b, t, rotary // 2) or sin.shape != cos.shape:
        problems.append(f"x {x.shape} with cos {cos.shape}, sin {sin.shape}")
    elif not (0 < rotary <= d and projection_fits(t, model, d, rotary)):
        problems.append(f"{t} window rows, model width {model}, rotary dim {rotary} of {d}")
    problems += _buffer_and_scale_problems(b, kv_heads, d, buffers, scales, ops)
    if problems:
        raise ValueError(
            f"project_rope_and_write: {'; '.join(problems)}; expected x [b, t, model] with t "
            f"<= {BLOCK_T} and model a multiple of 16, w [model, kv_heads, group + 2, d] with "
            "group >= 1, cos/sin [b, t, r / 2] for an even r in (0, d] with r / 2 and d - r "
            "powers of two >= 16 (or d - r = 0), buffers [b, s, kv_heads, d], and q/k scales "
            "[d] exactly when qk_norm"
        )
    inputs = [bounds.astype(jnp.int32), x, *([] if squares is None else [squares]), w, cos, sin]
    inputs += [*(scales or ()), *(buffers or ())]
    kernel = functools.partial(
        _project_kernel,
        ops=ops,
        parts=_parts(d, rotary),
        group=group,
        buffered=buffers is not None,
        block_k=tiling.largest_block(model, 128),
        norm_eps=norm_eps,
    )
    shape = (b, t, kv_heads, group, d)
    return _run(
        kernel,
        (kv_heads, slots),
        inputs,
        shape,
        x.dtype,
        buffers,
        num_warps,
        num_stages,
        interpret,
        "qkv_matmul_rope",
    )
