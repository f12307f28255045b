"""The q/k/v product of a denoising block with the q/k norm, clip, RoPE and K/V buffer writes in
its epilogue, as a Pallas Mosaic GPU kernel (Hopper: TMA copies, WGMMA):
`project_rope_and_write` (`rope_impl="mosaic"`), or with an fp8 weight by fp8 x fp8 WGMMA
(`project_rope_and_write_fp8`: e4m3 rows and K-major weight, their row and column scales
applied to the fp32 product before the epilogue); and that epilogue alone on a product made
elsewhere (`rope_and_write`: split-K partial products, `handoff.Partials`, are summed as
`Partials.total()` sums them). Semantics are those of `layers.Attention`'s XLA path:
`rms_norm` with the q/k scales, the clip, rotate-half RoPE in fp32 from the given cos/sin
tables, and buffer rows outside the write range left as they were.

Each CTA owns one row tile of 64 (whole sequences of the window) and one head slot of one kv
head: the kv head's query heads, then its key, then its value. It streams the x rows and that
slot's weight columns [model, head_dim] through a ring (`tma_ring`), so the product never goes
through memory (`rope_and_write`: reads its tile of each partial product by TMA and adds
them), then finishes the fp32 accumulator:

- the product rounded to the activation dtype, as `Partials.total()` rounds it;
- queries and keys: the q/k RMSNorm over the head (with `HeadOps.qk_norm`, its scale read by
  TMA at the CTA's start) and the clip, in WGMMA's accumulator layout (row sums and
  elementwise ops only: no feature is paired with another there); the head, whose values
  are then of the activation dtype, goes whole to the CTA's output tile in shared memory;
- rotate-half RoPE there: the two rotary halves are read back as separate column slices of
  that tile, and the cos/sin tiles (brought in by TMA) as whole tiles, all [64, rotary / 2]
  in one strided layout (`Layout.WG_STRIDED` of that shape, `VECTOR` values a vector), in
  which element i of each array is the same (row, feature) by construction: the layout
  numbers the elements of its shape row-major, whatever tile they are read from. The turned
  halves are written back in place in that layout;
- values: the clip.

Queries go out by TMA. Keys and values go to the K/V buffers [b, s, kv_heads, d], updated in
place (aliased), at each sequence's window rows: TMA stores take a dynamic row offset but a
static row count, so the CTA reads the buffer's rows under the window at its start and keeps
those outside the write range `[write_lo, write_hi)`, then writes the window's whole run of
rows. Rules: the window's rows `t` a multiple of 8 and at most 64 (a row tile holds
`64 // t` sequences), the model width a multiple of 64, head_dim 64 or 128 with a rotary
half (and any unrotated rest) a multiple of 8, and 16-bit activations and weights (the fp8
form: e4m3 rows and weight, a model width a multiple of 128, and a 16-bit epilogue).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import fp8_matmul_mosaic, tma_ring
from djax.kernels.handoff import Partials
from djax.kernels.tma_ring import ROW_ALIGN, ROW_TILE, Tiles

Array = jax.Array

HEAD_DIMS = (64, 128)  # WGMMA column tiles a head fills: one CTA's accumulator
PART_ALIGN = 8  # a rotary half [64, n] is whole `VECTOR`-wide vectors for 128 threads
VECTOR = 4  # values a thread holds per vector in the epilogue's strided layout
MAX_SPLITS = 4  # the most partial products `rope_and_write` sums (their tiles share memory)


@dataclasses.dataclass(frozen=True)
class HeadOps:
    """What the kernel applies to each head before RoPE: q/k RMSNorm with `eps` when
    `qk_norm` (the scales are arguments), then a clip to `[-clip, clip]` on q, k and v when
    `clip` is not None."""

    qk_norm: bool = False
    eps: float = 1e-6
    clip: float | None = None


PLAIN_HEADS = HeadOps()  # no q/k norm, no clip


def _parts(head_dim: int, rotary_dim: int) -> tuple[tuple[int, int], ...]:
    """A head's feature ranges `(start, size)`: the two rotary halves, then the rest."""
    half = rotary_dim // 2
    rest = ((rotary_dim, head_dim - rotary_dim),) if rotary_dim < head_dim else ()
    return ((0, half), (half, half)) + rest


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


def window_fits(t: int, head_dim: int, rotary_dim: int) -> bool:
    """Whether the kernels take windows of `t` rows and these heads: `t` a multiple of 8 up to
    64, `head_dim` in `HEAD_DIMS`, and head parts (the rotary halves and the rest) multiples
    of 8."""
    return (
        0 < t <= ROW_TILE
        and t % ROW_ALIGN == 0
        and head_dim in HEAD_DIMS
        and 0 < rotary_dim <= head_dim
        and all(size % PART_ALIGN == 0 for _, size in _parts(head_dim, rotary_dim))
    )


def fits(t: int, model: int, head_dim: int, rotary_dim: int) -> bool:
    """Whether `project_rope_and_write` takes windows of `t` rows and these widths
    (`window_fits`, and `model` a multiple of 64)."""
    return model % tma_ring.TILE == 0 and window_fits(t, head_dim, rotary_dim)


def tiles_for(head_dim: int) -> Tiles:
    """A head's columns in 64-wide steps through 4 slots (the fastest ring of
    `bench.kernels.mosaic --products qkv_rope --sweep` at LLaDA-8B's heads)."""
    return Tiles(block_n=head_dim, block_k=tma_ring.TILE, splits=1, stages=4)


def _read(ref, interpreting: bool) -> Array:
    """A whole tile [64, n] of shared memory in WGMMA's accumulator layout, read thread by
    thread (its rows are not swizzled, so no bank-conflict-free plan exists; the tiles are
    small). Mosaic GPU's interpreter reads it as it is."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpreting:
        return ref[...]
    return tma_ring.load(ref, plgpu.Layout.WGMMA, optimized=False)


def _strided(ref, interpreting: bool) -> Array:
    """The values at `ref` (a tile or a column slice of one, [64, n]) in the epilogue's
    strided layout of their shape: element i of any two arrays of one shape read so is the
    same (row, column) of their tiles. Mosaic GPU's interpreter has no rule for the cast (the
    identity on values) and reads the values as they are."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    value = ref[...]
    if interpreting:
        return value
    return plgpu.layout_cast(value, plgpu.Layout.WG_STRIDED(value.shape, vec_size=VECTOR))


def _row_iota(shape: tuple[int, int], interpreting: bool) -> Array:
    """The row index of each element of an int32 array of `shape` in `_strided`'s layout."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpreting:
        return jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    layout = plgpu.Layout.WG_STRIDED(shape, vec_size=VECTOR)
    return plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)


def _kernel(
    bounds_gmem,
    *refs,
    ops: HeadOps,
    half: int,
    group: int,
    seqs: int,
    kv_heads: int,
    t: int,
    s: int,
    tiles: Tiles,
    steps: int,
    splits: int | None,
    buffered: bool,
    interpreting: bool,
    fp8: bool = False,
):
    """One CTA (row tile, kv head, slot). Refs: bounds [3] int32; the product's source: with
    `splits` None x [m, model] (m = b * t) and w [model, kv * (group + 2) * d], multiplied
    through the ring, else its partial products [splits, m, kv * (group + 2) * d] (fp32, or
    the activation dtype with one split), summed; cos/sin [m, rotary / 2] fp32, the q and k
    scales [2, d] (with `qk_norm`); with `buffered` the key and value buffers [b * s, kv * d]
    (updated in place), then the output q [b * t, kv * group * d]; else the outputs q, keys
    and values [b * t, kv * d]; then scratch: the source's (the ring, or the partials' tiles
    and their barriers), the output tile, the buffer's rows, cos, sin, the scales, and
    barriers. `half`: the features of a rotary half (rotary / 2). `fp8`: x [m, model] and
    w [kv * (group + 2) * d, model] (K-major) e4m3, followed by their scales, x's [1, m] per
    row and w's [1, kv * (group + 2) * d] per column, applied to the fp32 product; the
    source's scratch ends with the two scales' tiles and their barriers (and, in Mosaic
    GPU's interpreter, `fp8_matmul_mosaic.k_major_multiply`'s untransposed tile)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if splits is None and fp8:
        (x_gmem, w_gmem, x_scale_gmem, w_scale_gmem), refs = refs[:4], refs[4:]
    elif splits is None:
        (x_gmem, w_gmem), refs = refs[:2], refs[2:]
    else:
        (partials_gmem,), refs = refs[:1], refs[1:]
    cos_gmem, sin_gmem, *refs = refs
    scales_gmem, refs = (refs[0], refs[1:]) if ops.qk_norm else (None, refs)
    if buffered:  # the buffers are refs the kernel updates in place, then q
        keys_gmem, values_gmem, q_gmem, *scratch = refs
    else:
        q_gmem, keys_gmem, values_gmem, *scratch = refs
    *source, out_smem, cached_smem, cos_smem, sin_smem, scales_smem, bars, cached_bars = scratch
    d, slots = out_smem.shape[1], group + 2
    cta = jax.lax.axis_index("cta")
    row_tile, kv_head, slot = cta // (kv_heads * slots), cta // slots % kv_heads, cta % slots
    per_tile = ROW_TILE // t
    first = row_tile * per_tile * t
    start, write_lo, write_hi = bounds_gmem[0], bounds_gmem[1], bounds_gmem[2]
    base = jnp.minimum(jnp.maximum(start, 0), s - t)  # as `layers.write_window` places it
    head_cols = pl.ds(kv_head * d, d)
    slot_cols = pl.ds((kv_head * slots + slot) * d, d)

    def sequences():
        """(i, seq): the row tile's sequences (seq < b only in the last tile)."""
        return [(i, row_tile * per_tile + i) for i in range(per_tile)]

    rows = pl.ds(first, ROW_TILE)
    if splits is not None:  # the partials' tiles, read past the rows' end as zeros
        partials_smem, partials_bars = source
        for i in range(splits):
            plgpu.copy_gmem_to_smem(
                partials_gmem.at[i, rows, slot_cols], partials_smem.at[i], partials_bars.at[i]
            )

    @pl.when(slot <= group)  # queries and keys: every copy a CTA starts, it waits for
    def _tables():
        plgpu.copy_gmem_to_smem(cos_gmem.at[rows], cos_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(sin_gmem.at[rows], sin_smem, bars.at[1])
        if scales_gmem is not None:
            plgpu.copy_gmem_to_smem(scales_gmem, scales_smem, bars.at[2])

    if buffered:  # the buffer's rows under each sequence's window, kept outside the range
        for index, buf in ((group, keys_gmem), (group + 1, values_gmem)):

            @pl.when(slot == index)
            def _fetch(buf=buf):
                for i, seq in sequences():

                    @pl.when(seq < seqs)
                    def _seq(i=i, seq=seq):
                        plgpu.copy_gmem_to_smem(
                            buf.at[pl.ds(seq * s + base, t), head_cols],
                            cached_smem.at[pl.ds(i * t, t)],
                            cached_bars.at[i],
                        )

    def finish(product):
        dtype = out_smem.dtype
        y = product.astype(dtype).astype(jnp.float32)

        def head_ops(scale_row):
            """The whole head after the q/k norm (with `scale_row`) and the clip, in the
            accumulator's layout, its values of `dtype`."""
            head = y
            if scale_row is not None:
                plgpu.barrier_wait(bars.at[2])
                inv_rms = jax.lax.rsqrt(jnp.sum(head * head, axis=1) / d + ops.eps)
                head = head * jax.lax.broadcast_in_dim(inv_rms, head.shape, [0])
                head = head.astype(dtype).astype(jnp.float32)
                scale = tma_ring.accumulator_columns(scales_smem[scale_row], interpreting)
                scale = jax.lax.broadcast_in_dim(scale.astype(jnp.float32), head.shape, [1])
                head = (head * scale).astype(dtype).astype(jnp.float32)
            if ops.clip is not None:
                head = jnp.minimum(jnp.maximum(head, -ops.clip), ops.clip)
            return head

        def rope():
            """Turn the rotary halves of the head in the output tile, in place."""
            plgpu.barrier_wait(bars.at[0])
            plgpu.barrier_wait(bars.at[1])
            first, second = out_smem.at[:, pl.ds(0, half)], out_smem.at[:, pl.ds(half, half)]
            x1 = _strided(first, interpreting).astype(jnp.float32)
            x2 = _strided(second, interpreting).astype(jnp.float32)
            cos = _strided(cos_smem, interpreting)
            sin = _strided(sin_smem, interpreting)
            first[...] = (x1 * cos + -x2 * sin).astype(dtype)
            second[...] = (x2 * cos + x1 * sin).astype(dtype)

        def keep_cached():
            """The output tile's rows outside the write range replaced by the buffer's."""
            for i, seq in sequences():

                @pl.when(seq < seqs)
                def _wait(i=i):
                    plgpu.barrier_wait(cached_bars.at[i])

            head = _strided(out_smem, interpreting)
            cached = _strided(cached_smem, interpreting)
            position = start + jax.lax.rem(_row_iota(head.shape, interpreting), t)
            ok = (position >= write_lo) & (position < write_hi)
            out_smem[...] = jnp.where(ok, head, cached)

        # Each step written once for every kind of slot that takes it, not once per kind:
        # a kernel's lowering time follows its program's size.
        if ops.qk_norm:  # queries' scale row 0, keys' 1; values are not normed

            @pl.when(slot <= group)
            def _normed():
                scale_row = (slot == group).astype(jnp.int32)
                out_smem[...] = head_ops(scale_row).astype(dtype)

            @pl.when(slot == group + 1)
            def _value():
                out_smem[...] = head_ops(None).astype(dtype)

        else:
            out_smem[...] = head_ops(None).astype(dtype)
        pl.when(slot <= group)(rope)
        if buffered:  # keys and values
            pl.when(slot >= group)(keep_cached)

    if splits is None and fp8:
        untransposed = source.pop() if interpreting else None
        *ring, x_scale_smem, w_scale_smem, scale_bars = source
        plgpu.copy_gmem_to_smem(x_scale_gmem.at[:, rows], x_scale_smem, scale_bars.at[0])
        plgpu.copy_gmem_to_smem(w_scale_gmem.at[:, slot_cols], w_scale_smem, scale_bars.at[1])

        def finish_scaled(product):
            plgpu.barrier_wait(scale_bars.at[0])
            plgpu.barrier_wait(scale_bars.at[1])
            (scaled,) = fp8_matmul_mosaic.scale_products(
                [product], w_scale_smem, x_scale_smem, interpreting
            )
            finish(scaled)

        w_tile = lambda ks: w_gmem.at[slot_cols, ks]  # noqa: E731
        multiply = fp8_matmul_mosaic.k_major_multiply(untransposed)
        tma_ring.stream(
            x_gmem, [w_tile], ring, tiles, 0, steps, rows, finish_scaled, multiply=multiply
        )
    elif splits is None:
        w_tile = lambda ks: w_gmem.at[ks, slot_cols]  # noqa: E731
        tma_ring.stream(x_gmem, [w_tile], source, tiles, 0, steps, rows, finish)
    else:  # summed in order, as `handoff.add_slices` sums them
        slices = []
        for i in range(splits):
            plgpu.barrier_wait(partials_bars.at[i])
            slices.append(_read(partials_smem.at[i], interpreting).astype(jnp.float32))
        finish(sum(slices[1:], slices[0]))
    plgpu.commit_smem()
    for i, seq in sequences():
        tile_rows = out_smem.at[pl.ds(i * t, t)]

        @pl.when((seq < seqs) & (slot < group))
        def _query(tile_rows=tile_rows, seq=seq):
            cols = pl.ds((kv_head * group + slot) * d, d)
            plgpu.copy_smem_to_gmem(tile_rows, q_gmem.at[pl.ds(seq * t, t), cols])

        for index, buf in ((group, keys_gmem), (group + 1, values_gmem)):

            @pl.when((seq < seqs) & (slot == index))
            def _kv(tile_rows=tile_rows, seq=seq, buf=buf):
                plgpu.copy_smem_to_gmem(tile_rows, buf.at[pl.ds(seq * s + base, t), head_cols])

    plgpu.wait_smem_to_gmem(0)


def _check(name, lead, kv_heads, d, cos, sin, buffers, scales, ops, dtype, more) -> None:
    """Raise a ValueError naming `name` and what is wrong with the window's heads, tables,
    buffers and scales (and `more`, the caller's problems), where anything is."""
    b, t = lead
    rotary = 2 * cos.shape[-1]
    problems = list(more)
    if cos.shape != (b, t, rotary // 2) or sin.shape != cos.shape:
        problems.append(f"rows {lead} with cos {cos.shape}, sin {sin.shape}")
    elif not window_fits(t, d, rotary):
        problems.append(f"{t} window rows, rotary dim {rotary} of {d}")
    problems += _buffer_and_scale_problems(b, kv_heads, d, buffers, scales, ops)
    if buffers is not None and buffers[0].shape[1] < t:
        problems.append(f"buffers of {buffers[0].shape[1]} rows for a {t}-row window")
    if buffers is not None and any(buf.dtype != dtype for buf in buffers):
        problems.append(f"buffers {[buf.dtype.name for buf in buffers]} for {dtype.name} rows")
    if problems:
        raise ValueError(
            f"{name}: {'; '.join(problems)}; expected window rows t a multiple of 8 up to "
            f"{ROW_TILE}, heads of d in {HEAD_DIMS} features, cos/sin [b, t, r / 2] for an "
            "even r in (0, d] with r / 2 and d - r multiples of 8, buffers [b, s >= t, "
            "kv_heads, d] of the rows' dtype, and q/k scales [d] exactly when qk_norm"
        )


def _run(source, source_scratch, shape, dtype, cos, sin, buffers, bounds, scales, ops, **static):
    """The kernel over a window of `shape` (b, t, kv_heads, group, d) with `dtype` rows:
    `source` its product's input arrays, `source_scratch` their scratch; `static` the rest
    of `_kernel`'s keywords (tiles, steps, splits, interpret). Returns (q, keys, values)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, t, kv_heads, group, d = shape
    rotary = 2 * cos.shape[-1]
    s = t if buffers is None else buffers[0].shape[1]
    m = b * t
    per_tile = ROW_TILE // t
    rows = lambda a: a.reshape(m, a.shape[-1])  # noqa: E731  (m: a multiple of 8, as TMA reads)
    inputs = [bounds.astype(jnp.int32), *source, rows(cos), rows(sin)]
    if ops.qk_norm:
        inputs.append(jnp.stack(scales).astype(dtype))
    out_type = [jax.ShapeDtypeStruct((m, kv_heads * group * d), dtype)]
    if buffers is None:
        out_type += [jax.ShapeDtypeStruct((m, kv_heads * d), dtype)] * 2
    else:  # updated in place: the kernel's refs alias them
        buffers = [
            jax.new_ref(buf.reshape(b * s, kv_heads * d), memory_space=plgpu.GMEM)
            for buf in buffers
        ]
        inputs += buffers
    params = tma_ring.interpret_params(static.pop("interpret"))
    kernel = functools.partial(
        _kernel,
        ops=ops,
        half=rotary // 2,
        group=group,
        seqs=b,
        kv_heads=kv_heads,
        t=t,
        s=s,
        buffered=buffers is not None,
        interpreting=params is not None,
        **static,
    )
    scratch = [
        *source_scratch,
        plgpu.SMEM((ROW_TILE, d), dtype),  # the output tile
        plgpu.SMEM((ROW_TILE, d), dtype),  # the buffer's rows under the window
        plgpu.SMEM((ROW_TILE, rotary // 2), jnp.float32),  # cos
        plgpu.SMEM((ROW_TILE, rotary // 2), jnp.float32),  # sin
        plgpu.SMEM((2, d), dtype),  # the q and k scales
        plgpu.Barrier(num_barriers=3),  # cos, sin, scales
        plgpu.Barrier(num_barriers=per_tile),  # the buffer's rows, by sequence
    ]

    def body(*refs):  # the scratch in a scope, as `plgpu.kernel` allocates it
        pl.run_scoped(functools.partial(kernel, *refs), *scratch)

    outs = pl.kernel(
        body,
        out_type=out_type,
        mesh=plgpu.Mesh(grid=(pl.cdiv(b, per_tile) * kv_heads * (group + 2),), grid_names=("cta",)),
        interpret=params or False,
        name="qkv_rope_mosaic" if static["splits"] is None else "rope_mosaic",
    )(*inputs)
    q, keys, values = (outs[0], *buffers) if buffers is not None else outs
    if buffers is not None:
        keys, values = keys[...], values[...]
    kv_shape = (b, s, kv_heads, d)
    return q.reshape(b, t, kv_heads, group, d), keys.reshape(kv_shape), values.reshape(kv_shape)


def _epilogue_bytes(d: int, rotary: int, dtype) -> int:
    """Shared memory of the epilogue's tiles beside the source's."""
    item = jnp.dtype(dtype).itemsize
    return 2 * ROW_TILE * d * item + ROW_TILE * rotary * 4 + 2 * d * item


@functools.partial(jax.jit, static_argnames=("ops", "tiles", "interpret"))
def project_rope_and_write(
    x: Array,
    w: Array,
    cos: Array,
    sin: Array,
    buffers: tuple[Array, Array] | None,
    bounds: Array,
    scales: tuple[Array, Array] | None = None,
    ops: HeadOps = PLAIN_HEADS,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """`rope_and_write(x @ w, ...)` with the q/k/v product inside the kernel, in Mosaic GPU
    (rows already normed: not `ScaledRows`).

    x: [b, t, model] normed window rows; w: [model, kv_heads, group + 2, head_dim], both bf16
    or both fp16 (`fits`); the rest as `rope_and_write`. Returns (q [b, t, kv_heads, group,
    head_dim], keys, values). The product is rounded to x's dtype before the head ops.
    `tiles`: the ring (default `tiles_for`; `block_n` must be head_dim); `interpret`: run in
    Mosaic GPU's interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    name = "rope_write_mosaic.project_rope_and_write"
    if x.ndim != 3 or w.ndim != 4 or w.shape[0] != x.shape[-1] or w.shape[2] < 3:
        raise ValueError(
            f"{name}: x {x.shape} with w {w.shape}; expected x [b, t, model] and w [model, "
            "kv_heads, group + 2, d] with group >= 1"
        )
    tma_ring.check_operands(name, x, w)
    (b, t, model), (kv_heads, slots, d) = x.shape, w.shape[1:]
    more = [] if model % tma_ring.TILE == 0 else [f"model width {model}, not a multiple of 64"]
    _check(name, (b, t), kv_heads, d, cos, sin, buffers, scales, ops, x.dtype, more)
    tiles = tiles or tiles_for(d)
    if tiles.block_n != d or tiles.splits != 1:
        raise ValueError(f"{tiles}: the q/k/v product takes block_n = head_dim = {d}, splits=1")
    rotary = 2 * cos.shape[-1]
    tiles.check(model, d, weights=1, out_bytes=0, extra=_epilogue_bytes(d, rotary, x.dtype))
    return _run(
        [x.reshape(b * t, model), w.reshape(model, -1)],
        tma_ring.ring_scratch(tiles, x.dtype, weights=1),
        (b, t, kv_heads, slots - 2, d),
        x.dtype,
        cos,
        sin,
        buffers,
        bounds,
        scales,
        ops,
        tiles=tiles,
        steps=model // tiles.block_k,
        splits=None,
        interpret=interpret,
    )


def fp8_tiles_for(head_dim: int) -> Tiles:
    """`tiles_for`'s ring at one byte a value: 128-wide contraction steps (the 8-bit
    swizzled row), as many bytes a step as the 16-bit ring's 64."""
    return dataclasses.replace(tiles_for(head_dim), block_k=fp8_matmul_mosaic.K_TILE)


@functools.partial(jax.jit, static_argnames=("dtype", "ops", "tiles", "interpret"))
def project_rope_and_write_fp8(
    xq: Array,
    x_scale: Array,
    w_t: Array,
    w_scale: Array,
    cos: Array,
    sin: Array,
    buffers: tuple[Array, Array] | None,
    bounds: Array,
    scales: tuple[Array, Array] | None = None,
    ops: HeadOps = PLAIN_HEADS,
    dtype=jnp.bfloat16,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """`project_rope_and_write` with an fp8 q/k/v weight: the product by fp8 x fp8 WGMMA
    (`fp8_matmul_mosaic`'s rule: both operands e4m3, the row and column scales applied to
    the fp32 product), then the same epilogue in `dtype`.

    xq: [b, t, model] e4m3 window rows, x_scale [b, t] fp32 (`fp8_matmul_mosaic.
    quantize_rows`, or the norm kernel's `handoff.QuantizedRows`); w_t: [kv_heads, group + 2,
    head_dim, model] e4m3 (a K-major q/k/v `Fp8Weight`'s values), w_scale [kv_heads, group
    + 2, head_dim] fp32; model a multiple of 128; the rest as `rope_and_write`, with
    buffers and q/k scales of `dtype` (bf16 or fp16). Returns (q, keys, values) of `dtype`.
    `tiles`: the ring (default `fp8_tiles_for`; `block_n` must be head_dim); `interpret`
    as `project_rope_and_write`'s.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "rope_write_mosaic.project_rope_and_write_fp8"
    fp8_matmul_mosaic.check_operands(name, xq, x_scale, w_t, w_scale, dtype)
    if xq.ndim != 3 or w_t.ndim != 4 or w_t.shape[1] < 3 or jnp.dtype(dtype).itemsize != 2:
        raise ValueError(
            f"{name}: xq {xq.shape}, w_t {w_t.shape}, dtype {jnp.dtype(dtype).name}; "
            "expected xq [b, t, model], w_t [kv_heads, group + 2, d, model] with group >= 1 "
            "and a 16-bit dtype"
        )
    (b, t, model), (kv_heads, slots, d, _) = xq.shape, w_t.shape
    _check(name, (b, t), kv_heads, d, cos, sin, buffers, scales, ops, jnp.dtype(dtype), [])
    tiles = tiles or fp8_tiles_for(d)
    if tiles.block_n != d or tiles.splits != 1:
        raise ValueError(f"{tiles}: the q/k/v product takes block_n = head_dim = {d}, splits=1")
    interpreting = tma_ring.interpret_params(interpret) is not None
    scale_bytes = (ROW_TILE + d) * 4 + (tiles.block_k * d if interpreting else 0)
    extra = _epilogue_bytes(d, 2 * cos.shape[-1], dtype) + scale_bytes
    tiles.check(model, d, weights=1, out_bytes=0, extra=extra, itemsize=1)
    source_scratch = [
        *tma_ring.ring_scratch(tiles, fp8_matmul_mosaic.FP8, weights=1, k_major=True),
        plgpu.SMEM((1, ROW_TILE), jnp.float32),  # x's scales, by row
        plgpu.SMEM((1, d), jnp.float32),  # the slot's column scales
        plgpu.Barrier(num_barriers=2),
    ]
    if interpreting:  # `fp8_matmul_mosaic.k_major_multiply`'s untransposed weight tile
        source_scratch.append(plgpu.SMEM((tiles.block_k, d), fp8_matmul_mosaic.FP8))
    m = b * t
    source = [
        xq.reshape(m, model),
        w_t.reshape(-1, model),
        x_scale.reshape(1, m),
        w_scale.reshape(1, -1),
    ]
    return _run(
        source,
        source_scratch,
        (b, t, kv_heads, slots - 2, d),
        jnp.dtype(dtype),
        cos,
        sin,
        buffers,
        bounds,
        scales,
        ops,
        tiles=tiles,
        steps=model // tiles.block_k,
        splits=None,
        fp8=True,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("ops", "interpret"))
def rope_and_write(
    qkv: Array | Partials,
    cos: Array,
    sin: Array,
    buffers: tuple[Array, Array] | None,
    bounds: Array,
    scales: tuple[Array, Array] | None = None,
    ops: HeadOps = PLAIN_HEADS,
    interpret: bool | None = None,
) -> tuple[Array, Array, Array]:
    """Queries ready for attention and the K/V buffers with the window's rows written, from a
    q/k/v product made elsewhere, in Mosaic GPU: one
    CTA per (row tile, kv head, slot) reads its head's tile of each partial product by TMA,
    sums them in `handoff.add_slices`' order and finishes them as `project_rope_and_write`
    does.

    qkv: [b, t, kv_heads, group + 2, head_dim] in bf16 or fp16, or `Partials` of that shape
    (at most `MAX_SPLITS` slices); cos, sin: [b, t, rotary_dim / 2] fp32
    (`layers.rope_tables`); buffers: (keys, values) [b, s, kv_heads, head_dim] with s >= t,
    updated in place, or None for a whole-sequence window (fresh [b, t, kv_heads, head_dim]
    arrays come back); bounds: int32 [3] = (window start, write_lo, write_hi): window row `i`
    sits at position `start + i` and is written when that lies in `[write_lo, write_hi)` (a
    window past the buffer's end sits at its last `t` rows, as in `layers.write_window`);
    scales: the q and k norm scales [head_dim] (with `ops.qk_norm`). `t` a multiple of 8 up
    to 64 and the heads as `fits` says. Returns (q [b, t, kv_heads, group, head_dim], keys,
    values). `interpret`: as `project_rope_and_write`'s.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "rope_write_mosaic.rope_and_write"
    products = qkv.parts if isinstance(qkv, Partials) else qkv[None]
    if products.ndim != 6 or products.shape[4] < 3:
        raise ValueError(
            f"{name}: qkv {products.shape[1:]}; expected [b, t, kv_heads, group + 2, d] with "
            "group >= 1"
        )
    splits, b, t, kv_heads, slots, d = products.shape
    dtype = jnp.dtype(qkv.dtype)
    more = []
    if not tma_ring.takes_dtype(dtype) or splits > MAX_SPLITS:
        more.append(f"{splits} slices of {products.dtype.name} for {dtype.name} rows")
    _check(name, (b, t), kv_heads, d, cos, sin, buffers, scales, ops, dtype, more)
    partials = products.reshape(splits, b * t, kv_heads * slots * d)
    source_scratch = [
        plgpu.SMEM((splits, ROW_TILE, d), products.dtype),
        plgpu.Barrier(num_barriers=splits),
    ]
    return _run(
        [partials],
        source_scratch,
        (b, t, kv_heads, slots - 2, d),
        dtype,
        cos,
        sin,
        buffers,
        bounds,
        scales,
        ops,
        tiles=None,
        steps=0,
        splits=splits,
        interpret=interpret,
    )
