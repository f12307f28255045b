"""Whether a weight-streaming product gains from running beside a latency-bound kernel: the
bound on what fusing a block layer's kernels into fewer launches could give.

A LLaDA-8B block layer runs six kernels, and each loses ~2.5-3 µs to its start and tail
while the weights stream at full rate only in between (bench/NOTES.md). Attention (32
queries against the K/V buffer, 64 programs) reads ~6 MB and leaves most SMs and most of
HBM's bandwidth idle for ~6 µs; the attention-output product after it reads 33.5 MB. Here
both run as one kernel: programs `0 .. A-1` are attention's (`flash_attention._kernel`),
the rest the product's split-K programs (`split_k._kernel`), or the other way round, with
no data dependence between them (the product reads a stale input). A fused kernel that
respects the dependence (the product waiting for its heads) can only do worse, so if the
one kernel is not clearly faster than the two, fusing them is not worth building.

Rows (device µs per pair from profiler traces, weights L2-cold over >= 256 MB of copies, a
query per copy so that no attention is shared): `separate` (the two kernels as the engine
runs them), `one kernel, attention first` and `one kernel, product first`, each at 3 and 4
pipeline stages. Then the real thing, `dependent:`: the product reads attention's output,
as the engine's two kernels (`separate`) or as one kernel whose product programs, numbered
after attention's, first read the weights of their slice's first `ahead` heads, then spin
(volatile loads) on a flag per attention program of their heads, then read the attention
output with volatile loads (from L2, past any stale L1 line). Each attention program, after
its stores, sums a tile spanning every warp (the cross-warp reduction sits behind a CTA
barrier, which orders all its threads' stores before it) and sets its flag with an atomic
whose value depends on that sum (acq_rel, GPU scope). The scheme relies on programs
starting in the order of their numbers, so that a waiting program never holds the SM that
an unstarted producer needs. Each such row checks its results against the two kernels for
every weight copy over every call (products up to the order of their fp32 sums). On an
H200 this version, like a first one (db83b97: one counter per slice, incremented by a
128-wide atomic after the stores, no barrier; plain loads of the attention output), gave
wrong products in some calls and was slower than the two kernels (bench/NOTES.md): it is
kept as the evidence, not as a pattern to follow.

    python -m bench.overlap [--calls 20] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bench.common import model_config, save
from bench.kernel_time import rel_error, time_row
from djax.models import flash_attention, pallas_tiles, split_k

COLD_BYTES = 256 << 20
BUFFER = 384  # the dual cache's K/V buffer at the bench setting


def _unravel(i, sizes: tuple[int, ...]) -> tuple:
    """Program number `i` of a row-major grid of `sizes` -> its coordinates."""
    coords = []
    for size in reversed(sizes):
        coords.append(i % size)
        i = i // size
    return tuple(reversed(coords))


def _both_kernel(
    q_ref, k_ref, v_ref, bias_ref, x_ref, w_ref, att_ref, parts_ref, *, attention, product, first
):
    """Attention's programs and the product's in one grid; `first` says whose come first."""
    (att_body, att_grid), (mm_body, mm_grid) = attention, product
    att_programs = att_grid[0] * att_grid[1] * att_grid[2]
    mm_programs = mm_grid[0] * mm_grid[1] * mm_grid[2]
    pid = pl.program_id(0)

    def run_attention(i):
        att_body(q_ref, k_ref, v_ref, bias_ref, att_ref, None, program=_unravel(i, att_grid))

    def run_product(i):
        mm_body(x_ref, w_ref, parts_ref, program=_unravel(i, mm_grid))

    if first == "attention":
        pl.when(pid < att_programs)(lambda: run_attention(pid))
        pl.when(pid >= att_programs)(lambda: run_product(pid - att_programs))
    else:
        pl.when(pid < mm_programs)(lambda: run_product(pid))
        pl.when(pid >= mm_programs)(lambda: run_attention(pid - mm_programs))


def one_kernel(q, keys, values, key_valid, x, w, *, first: str, stages: int):
    """Attention over the buffer and the split-K product `x @ w` in one pallas_call; returns
    (attention output, product partials)."""
    from jax.experimental.pallas import triton as plgpu

    b, t, n, d = q.shape
    s, kv_heads = keys.shape[1], keys.shape[2]
    att = flash_attention.tiles_for(t, s, b * n)
    if att.splits != 1:
        raise ValueError(f"{att}: this bench takes block shapes whose attention is one slice")
    att_grid = (b * n, pl.cdiv(t, att.block_q), 1)
    att_body = functools.partial(
        flash_attention._kernel, tiles=att, n_heads=n, group=n // kv_heads, split_len=s
    )
    m, k = x.shape
    mm = split_k.tiles_for(m, k, w.shape[1])
    mm_grid = (pl.cdiv(m, mm.block_m), w.shape[1] // mm.block_n, mm.splits)
    mm_body = functools.partial(split_k._kernel, tiles=mm, steps=k // (mm.splits * mm.block_k))
    programs = att_grid[0] * att_grid[1] + mm_grid[0] * mm_grid[1] * mm_grid[2]
    bias = jnp.where(key_valid, 0.0, flash_attention.MASKED).astype(jnp.float32)
    return pl.pallas_call(
        functools.partial(
            _both_kernel, attention=(att_body, att_grid), product=(mm_body, mm_grid), first=first
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((mm.splits, m, w.shape[1]), jnp.float32),
        ],
        grid=(programs,),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=stages),
        interpret=pallas_tiles.interpret_mode(None),
        name="attention_and_product",
    )(q, keys, values, bias, x, w)


def _signal(flags_ref, q_ref, pid, program, block_q: int):
    """After the program's stores: a sum over a tile that spans every warp (its reduction
    passes through shared memory behind a CTA barrier, which orders every thread's stores
    before it), then this program's flag made nonzero by an atomic (acq_rel, GPU scope) whose
    value depends on that sum, so that it cannot run before the barrier."""
    from jax.experimental.pallas import triton as plgpu

    head, q_tile, _ = program
    queries = pl.ds(q_tile * block_q, block_q)
    tile = plgpu.load(q_ref.at[jnp.int32(0), queries, head, :]).astype(jnp.float32)
    total = jnp.sum(tile)
    flags_ref[pid] += (total == total).astype(jnp.int32) + 1


def _wait(flags_ref, first, count):
    """Spin (volatile loads) until flags `first .. first + count - 1` are all nonzero."""
    from jax.experimental.pallas import triton as plgpu

    def one(i, carry):
        return jax.lax.while_loop(
            lambda seen: seen == 0,
            lambda seen: plgpu.load(flags_ref.at[first + i], volatile=True),
            jnp.int32(0),
        )

    jax.lax.fori_loop(0, count, one, jnp.int32(0))


def _dependent_kernel(
    q_ref, k_ref, v_ref, bias_ref, w_ref, flags_in, att_ref, parts_ref, flags_ref, *, att, mm, ahead
):
    """Attention's programs first, then the output product's. A product program reads the
    first `ahead` heads of its weight rows, then waits until every attention program of
    its contraction slice (its heads) has flagged, then reads their output (volatile loads,
    from L2) and finishes its product."""
    del flags_in  # aliased to flags_ref
    from jax.experimental.pallas import triton as plgpu

    att_body, att_grid, heads_per_slice = att
    tiles, mm_grid, steps = mm
    att_programs = att_grid[0] * att_grid[1] * att_grid[2]
    q_tiles = att_grid[1]
    pid = pl.program_id(0)
    d = att_ref.shape[-1]

    @pl.when(pid < att_programs)
    def _attention():
        program = _unravel(pid, att_grid)
        att_body(q_ref, k_ref, v_ref, bias_ref, att_ref, None, program=program)
        _signal(flags_ref, q_ref, pid, program, att_ref.shape[1] // q_tiles)

    @pl.when(pid >= att_programs)
    def _product():
        row_tile, column_tile, split = _unravel(pid - att_programs, mm_grid)
        rows = pl.ds(row_tile * tiles.block_m, tiles.block_m)
        cols = pl.ds(column_tile * tiles.block_n, tiles.block_n)
        row_ok = row_tile * tiles.block_m + jnp.arange(tiles.block_m) < att_ref.shape[1]
        first_head = split * heads_per_slice
        early = [w_ref[pl.ds((first_head + h) * d, d), cols] for h in range(ahead)]
        _wait(flags_ref, first_head * q_tiles, heads_per_slice * q_tiles)

        def x_tile(head, lo, width):
            return plgpu.load(
                att_ref.at[jnp.int32(0), rows, head, pl.ds(lo, width)],
                mask=row_ok[:, None],
                other=0.0,
                volatile=True,
            )

        acc = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
        for h, w in enumerate(early):
            acc += jnp.dot(x_tile(first_head + h, 0, d), w, preferred_element_type=jnp.float32)

        def step(i, acc):
            k0 = (first_head + ahead) * d + i * tiles.block_k
            w = w_ref[pl.ds(k0, tiles.block_k), cols]
            x = x_tile(k0 // d, k0 % d, tiles.block_k)
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps - ahead * d // tiles.block_k, step, acc)
        plgpu.store(parts_ref.at[split, rows, cols], acc, mask=row_ok[:, None])


def dependent_kernel(q, keys, values, key_valid, x, w, *, splits: int, ahead: int):
    """Attention, then the output product of its result (`x` is ignored) in `splits`
    contraction slices, in one pallas_call whose product programs read `ahead` heads of
    weights before waiting on attention's flags (zeroed for each call); returns (attention
    output, product partials)."""
    from jax.experimental.pallas import triton as plgpu

    del x
    b, t, n, d = q.shape
    s, kv_heads = keys.shape[1], keys.shape[2]
    att = flash_attention.tiles_for(t, s, b * n)
    mm = split_k.tiles_for(t, n * d, w.shape[1])
    mm = dataclasses.replace(mm, splits=splits, block_k=min(mm.block_k, d))
    if b != 1 or att.splits != 1 or d % mm.block_k or n % splits or ahead > n // splits:
        raise ValueError(f"{att}, {mm}, ahead={ahead}: one sequence, one key slice, whole heads")
    att_grid = (n, pl.cdiv(t, att.block_q), 1)
    att_body = functools.partial(
        flash_attention._kernel, tiles=att, n_heads=n, group=n // kv_heads, split_len=s
    )
    mm_grid = (pl.cdiv(t, mm.block_m), w.shape[1] // mm.block_n, splits)
    steps = n * d // (splits * mm.block_k)
    att_programs = att_grid[0] * att_grid[1]
    programs = att_programs + mm_grid[0] * mm_grid[1] * mm_grid[2]
    bias = jnp.where(key_valid, 0.0, flash_attention.MASKED).astype(jnp.float32)
    flags = jnp.zeros((att_programs,), jnp.int32)
    att_out, parts, _ = pl.pallas_call(
        functools.partial(
            _dependent_kernel,
            att=(att_body, att_grid, n // splits),
            mm=(mm, mm_grid, steps),
            ahead=ahead,
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((splits, t, w.shape[1]), jnp.float32),
            jax.ShapeDtypeStruct(flags.shape, flags.dtype),
        ],
        grid=(programs,),
        input_output_aliases={5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=4),
        interpret=pallas_tiles.interpret_mode(None),
        name="attention_then_product",
    )(q, keys, values, bias, w, flags)
    return att_out, parts


def dependent_separate(q, keys, values, key_valid, x, w):
    """The engine's two kernels, the product reading attention's output."""
    del x
    out = flash_attention.split_kv_attention(q, keys, values, key_valid)
    return out, split_k.matmul_partials(out.reshape(out.shape[1], -1), w).parts


def same(out, reference) -> bool:
    """Equal attention outputs, and products equal up to the order of their fp32 sums
    (slice counts may differ): relative error <= 1e-5."""
    (att, parts), (att_ref, parts_ref) = out, reference
    close = rel_error(parts.sum(0), parts_ref.sum(0)) <= 1e-5
    return bool(jnp.array_equal(att, att_ref)) and close


def separate(q, keys, values, key_valid, x, w):
    """The engine's two kernels."""
    out = flash_attention.split_kv_attention(q, keys, values, key_valid)
    return out, split_k.matmul_partials(x, w).parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config("dense", args.tiny)
    keys_ = jax.random.split(jax.random.key(0), 5)
    t, n, kv, d = 32, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    buffer = BUFFER if not args.tiny else 64
    q = jax.random.normal(keys_[0], (1, t, n, d), jnp.bfloat16)
    k_buf = jax.random.normal(keys_[1], (1, buffer, kv, d), jnp.bfloat16)
    v_buf = jax.random.normal(keys_[2], (1, buffer, kv, d), jnp.bfloat16)
    key_valid = jnp.ones((1, buffer), bool)
    x = jax.random.normal(keys_[3], (t, n * d), jnp.bfloat16)
    w = (jax.random.normal(keys_[4], (n * d, cfg.d_model)) * (n * d) ** -0.5).astype(jnp.bfloat16)
    copies = max(1, -(-COLD_BYTES // w.nbytes)) if not args.tiny else 1
    ws = [w * (1 + i / 64) for i in range(copies)]
    # a query per weight copy, so that XLA cannot compute one attention for all copies
    qs = [q * (1 - i / 64) for i in range(copies)]
    forms = {"separate": separate}
    for first in ("attention", "product"):
        for stages in (3, 4):
            label = f"one kernel, {first} first, {stages} stages"
            forms[label] = functools.partial(one_kernel, first=first, stages=stages)
    dependent = {"dependent: separate": dependent_separate}
    for splits, ahead in ((4, 0), (4, 1), (4, 2), (8, 0), (8, 1), (8, 2)):
        label = f"dependent: one kernel, {splits} slices, {ahead} heads read ahead"
        dependent[label] = functools.partial(dependent_kernel, splits=splits, ahead=ahead)
    rows = []
    for label, form in {**forms, **dependent}.items():
        base = dependent_separate if label.startswith("dependent") else separate
        reference = base(q, k_buf, v_buf, key_valid, x, w)
        row = {"impl": label, "t": t, "keys": buffer, "weight_bytes": w.nbytes}

        def run(qs, k_buf, v_buf, key_valid, x, ws, form=form):
            return [form(q_, k_buf, v_buf, key_valid, x, w_) for q_, w_ in zip(qs, ws, strict=True)]

        fn = jax.jit(run)
        try:
            out = fn(qs[:1], k_buf, v_buf, key_valid, x, ws[:1])[0]
            row["equal_to_separate"] = same(out, reference)
            if label.startswith("dependent"):  # the result of every weight copy, every call
                outs = [fn(qs, k_buf, v_buf, key_valid, x, ws) for _ in range(args.calls)]
                row["equal_every_call"] = all(
                    same(o, base(q_, k_buf, v_buf, key_valid, x, w_))
                    for got in outs
                    for o, q_, w_ in zip(got, qs, ws, strict=True)
                )
            time_row(row, fn, (qs, k_buf, v_buf, key_valid, x, ws), args.calls, w.nbytes, len(ws))
        except Exception as err:  # keep the other rows of a costly run
            row["error"] = f"{type(err).__name__}: {err}"[:1500]
        print(row, flush=True)
        rows.append(row)
    save("overlap", {"copies_bytes": COLD_BYTES, "results": rows})


if __name__ == "__main__":
    main()
