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
pipeline stages.

Two versions of the one kernel that respect the dependence (the product's programs spinning
on counters or flags set by attention's programs; db83b97 and 25f1750, code at ebf0c55)
were slower than the engine's pair and gave wrong products in some calls on an H200
(bench/NOTES.md): Pallas Triton has no acquire load and no explicit CTA barrier.

    python -m bench.overlap [--calls 20] [--tiny]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bench.common import model_config, save
from bench.kernel_time import time_row
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
    rows = []
    reference = separate(q, k_buf, v_buf, key_valid, x, w)
    for label, form in forms.items():
        row = {"impl": label, "t": t, "keys": buffer, "weight_bytes": w.nbytes}

        def run(qs, k_buf, v_buf, key_valid, x, ws, form=form):
            return [form(q_, k_buf, v_buf, key_valid, x, w_) for q_, w_ in zip(qs, ws, strict=True)]

        fn = jax.jit(run)
        try:
            out = fn(qs[:1], k_buf, v_buf, key_valid, x, ws[:1])[0]
            row["equal_to_separate"] = all(
                bool(jnp.array_equal(a, b)) for a, b in zip(out, reference, strict=True)
            )
            time_row(row, fn, (qs, k_buf, v_buf, key_valid, x, ws), args.calls, w.nbytes, len(ws))
        except Exception as err:  # keep the other rows of a costly run
            row["error"] = f"{type(err).__name__}: {err}"[:1500]
        print(row, flush=True)
        rows.append(row)
    save("overlap", {"copies_bytes": COLD_BYTES, "results": rows})


if __name__ == "__main__":
    main()
