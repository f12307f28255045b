"""A block's attention and its attention-output product in one Mosaic GPU kernel, joined
by global semaphores.

Question: a batch-1 block forward runs each layer as ~7 kernels, each losing a few µs to its
start and tail (`bench/NOTES.md`, "Kernel boundaries"). Without a data dependence the
attention kernel and the output product overlapped took 12.6 µs against 18.2 for the two
kernels; Pallas Triton could not keep the dependence. Mosaic GPU has global semaphores
(`pl.get_global`, `pl.semaphore_signal`, `plgpu.semaphore_wait`). In one kernel whose first
CTAs run the attention of one head each (`flash_attention_mosaic`'s kernel body) and whose
other CTAs run the split-K output product (contraction slices of whole heads), a product CTA
requests its first weight tiles, waits until every head of its slice has stored its output
(a counter per slice, which each head's CTA raises once its output is in memory), then
reads the outputs and streams the rest. How does that compare with the two kernels at
LLaDA-8B's block shape (32 queries, 384 keys, 32 heads of 128, 4096 -> 4096), is it exact,
and does it stay exact over many calls (a missing fence shows up as stale outputs)?

Rows: the two kernels (`split_kv_attention`, then `split_k_mosaic.matmul_partials` on its
output), and the joined kernel at a few tilings: each timed in a compiled loop (the engine's
XLA options: the loop a CUDA graph), by its kernels' device time, and checked against the
two kernels (attention output bit for bit where the attention tiles are the same; the
product's slices summed to ~fp32 rounding) over `--checks` calls.

    python -m bench.probes.attention_output [--keys 384] [--iters 200] [--checks 200]

Answer: see `bench/NOTES.md` ("Kernel boundaries").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from bench.common import save, time_in_program
from bench.kernels.timing import kernel_us
from djax.kernels import flash_attention_mosaic, split_k_mosaic, tma_ring
from djax.kernels.flash_attention_mosaic import MASKED
from djax.kernels.flash_attention_mosaic import Tiles as AttentionTiles
from djax.kernels.tma_ring import ROW_TILE, Tiles


def _fence(asm: str):
    """Inside a kernel: the PTX fence `asm`, run by every thread of the warpgroup."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], asm, "", has_side_effects=True)

    fence()


# After a TMA store has completed: its writes ordered before the generic proxy's release.
RELEASE = "fence.proxy.async.global;\n\tfence.acq_rel.gpu;"
# After the semaphore's acquire: the TMA loads that follow ordered after it.
ACQUIRE = "fence.proxy.async.global;"


def joined(
    q,
    keys,
    values,
    key_valid,
    w,
    att: AttentionTiles,
    prod: Tiles,
    fences: bool = True,
    memory_scope: str = "sys",
    wait: bool = True,
):
    """(attention output [1, t, n, d], the output product's fp32 slices [splits, t, N]) of
    q [1, t, n, d] against keys and values [1, s, n, d] (key_valid [1, s]) and w [n d, N],
    in one kernel: `att` the attention CTAs' tiles (one split, one warpgroup), `prod` the
    product CTAs' (block_k = d: a step is one head; splits dividing n)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, t, n, d = q.shape
    s = keys.shape[1]
    k_dim, n_dim = w.shape
    if b != 1 or t > ROW_TILE or keys.shape[2] != n or k_dim != n * d or prod.block_k != d:
        raise ValueError("joined: batch 1, t <= 64, no grouped heads, w [n d, N], block_k = d")
    if n % prod.splits or att.splits != 1 or att.warpgroups != 1:
        raise ValueError("joined: product splits dividing the heads; attention one split, one wg")
    steps = pl.cdiv(s, att.block_k)
    att = dataclasses.replace(att, stages=min(att.stages, steps))
    padded = steps * att.block_k
    bias = jnp.where(key_valid, 0.0, MASKED).astype(jnp.float32)
    bias = jnp.pad(bias, ((0, 0), (0, padded - s)), constant_values=MASKED)
    last = jnp.max(jnp.where(key_valid, jnp.arange(1, s + 1, dtype=jnp.int32), 0), axis=-1)
    key_steps = (last + att.block_k - 1) // att.block_k
    heads_per_split = n // prod.splits
    column_tiles = n_dim // prod.block_n
    attention_ctas = n
    product_ctas = prod.splits * column_tiles
    swizzled = tma_ring.swizzled()
    att_slots = (att.stages, att.block_k, d)
    att_memory = (
        plgpu.SMEM((ROW_TILE, d), q.dtype, transforms=swizzled),
        plgpu.SMEM(att_slots, q.dtype, transforms=swizzled),
        plgpu.SMEM(att_slots, q.dtype, transforms=swizzled),
        plgpu.SMEM((att.stages, att.block_k), jnp.float32),
        plgpu.SMEM((ROW_TILE, d), q.dtype),
        plgpu.SMEM((ROW_TILE,), jnp.float32),
    )
    prod_memory = (
        plgpu.SMEM((prod.stages, ROW_TILE, d), q.dtype, transforms=swizzled),
        plgpu.SMEM((prod.stages, d, prod.block_n), w.dtype, transforms=swizzled),
        plgpu.SMEM((ROW_TILE, prod.block_n), jnp.float32),
    )

    def body(q_g, k_g, v_g, bias_g, steps_g, w_g, o_g, parts_g, memory, *bars):
        (q_s, k_slots, v_slots, bias_slots, o_s, lse_s), (x_slots, w_slots, out_s) = memory
        q_bar, k_bars, v_bars, bias_bars, x_bars, w_bars = bars
        done = pl.get_global(plgpu.SemaphoreType.REGULAR((prod.splits,)))
        cta = jax.lax.axis_index("cta")

        @pl.when(cta < attention_ctas)
        def _attention():
            flash_attention_mosaic._kernel(
                q_g,
                k_g,
                v_g,
                bias_g,
                steps_g,
                o_g,
                q_s,
                ((k_slots, v_slots, bias_slots), (o_s, lse_s)),
                q_bar,
                k_bars,
                v_bars,
                bias_bars,
                tiles=att,
                n_heads=n,
                group=1,
                q_tiles=1,
                steps=steps,
                t=t,
                split_out=False,
                per_head=False,
                out_fp8=False,
                interpreting=False,
            )
            if fences:
                _fence(RELEASE)
            plgpu.semaphore_signal(done.at[cta // heads_per_split], 1, memory_scope=memory_scope)

        @pl.when(cta >= attention_ctas)
        def _product():
            p = cta - attention_ctas
            split, column = p // column_tiles, p % column_tiles
            cols = pl.ds(column * prod.block_n, prod.block_n)
            first_head = split * heads_per_split

            def fetch_w(step, slot):
                ks = pl.ds((first_head + step) * d, d)
                plgpu.copy_gmem_to_smem(w_g.at[ks, cols], w_slots.at[slot], w_bars.at[slot])

            def fetch_x(step, slot):
                rows = o_g.at[0, pl.ds(0, ROW_TILE), first_head + step]
                plgpu.copy_gmem_to_smem(rows, x_slots.at[slot], x_bars.at[slot])

            ahead = min(prod.stages, heads_per_split)
            for step in range(ahead):
                fetch_w(step, step)
            if wait:
                plgpu.semaphore_wait(
                    done.at[split], heads_per_split, decrement=False, memory_scope=memory_scope
                )
            if fences:
                _fence(ACQUIRE)
            for step in range(ahead):
                fetch_x(step, step)

            def scope(acc):
                @pl.loop(0, heads_per_split)
                def _step(i):
                    slot = jax.lax.rem(i, prod.stages)
                    plgpu.barrier_wait(x_bars.at[slot])
                    plgpu.barrier_wait(w_bars.at[slot])
                    plgpu.wgmma(acc, x_slots.at[slot], w_slots.at[slot])
                    plgpu.wgmma_wait(0)

                    @pl.when(i + prod.stages < heads_per_split)
                    def _refill():
                        fetch_w(i + prod.stages, slot)
                        fetch_x(i + prod.stages, slot)

                out_s[...] = acc[...]

            pl.run_scoped(scope, plgpu.ACC((ROW_TILE, prod.block_n), jnp.float32))
            tma_ring.store_rows(out_s, lambda rows: parts_g.at[split, rows, cols], 0, t)

    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((b, t, n, d), q.dtype),
            jax.ShapeDtypeStruct((prod.splits, t, n_dim), jnp.float32),
        ),
        grid=(attention_ctas + product_ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.RefUnion(att_memory, prod_memory),
            plgpu.Barrier(num_barriers=1),
            *(plgpu.Barrier(num_barriers=att.stages) for _ in range(3)),
            *(plgpu.Barrier(num_barriers=prod.stages) for _ in range(2)),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(q, keys, values, bias, key_steps, w)


def apart(q, keys, values, key_valid, w):
    """The two kernels the joined one replaces, at their own tilings."""
    o = flash_attention_mosaic.split_kv_attention(q, keys, values, key_valid)
    parts = split_k_mosaic.matmul_partials(o.reshape(q.shape[1], -1), w)
    return o, parts.parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=384)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--checks", type=int, default=200)
    parser.add_argument("--calls", type=int, default=50, help="calls in the profiler trace")
    args = parser.parse_args()
    t, n, d, width = 32, 32, 128, 4096
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (1, t, n, d), jnp.bfloat16)
    k = jax.random.normal(key[1], (1, args.keys, n, d), jnp.bfloat16)
    v = jax.random.normal(key[2], (1, args.keys, n, d), jnp.bfloat16)
    w = (jax.random.normal(key[3], (n * d, width), jnp.float32) * 0.02).astype(jnp.bfloat16)
    valid = jnp.ones((1, args.keys), bool)
    forms = {"apart": apart}
    att64 = AttentionTiles(block_k=64, stages=2)
    prod64 = Tiles(block_n=64, block_k=d, splits=2, stages=3)
    for att, prod, options in (
        (att64, prod64, {}),
        (AttentionTiles(block_k=128, stages=2), dataclasses.replace(prod64, stages=4), {}),
        (att64, Tiles(block_n=128, block_k=d, splits=4, stages=3), {}),
        (att64, prod64, {"fences": False}),
        (att64, prod64, {"memory_scope": "gpu"}),
        (att64, prod64, {"wait": False}),
    ):
        label = f"joined att {att.block_k}x{att.stages} prod n{prod.block_n} s{prod.splits} "
        label += f"x{prod.stages}" + "".join(f" {k}={v}" for k, v in options.items())
        forms[label] = functools.partial(joined, att=att, prod=prod, **options)
    reference_o, reference_parts = jax.jit(apart)(q, k, v, valid, w)
    reference_sum = np.asarray(reference_parts.sum(0))
    rows = []
    for label, form in forms.items():
        row = {"form": label, "keys": args.keys}
        run = jax.jit(form)
        try:
            o, parts = run(q, k, v, valid, w)
            total = np.asarray(parts.sum(0))
            row["o_max_abs_diff"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - reference_o)))
            row["product_rel_error"] = float(
                np.linalg.norm(total - reference_sum) / np.linalg.norm(reference_sum)
            )
            outs = [run(q, k, v, valid, w) for _ in range(args.checks)]
            row["calls_differing"] = sum(
                not (np.array_equal(a, o) and np.array_equal(b, parts)) for a, b in outs
            )

            def step(q, k, v, valid, w, form=form):
                out, parts = form(q, k, v, valid, w)
                return q + (1e-3 * out + 1e-6 * parts[0, :, : n * d].reshape(q.shape)).astype(
                    q.dtype
                )

            row["loop_us"] = 1e6 * time_in_program(step, q, args.iters, k, v, valid, w)
            row["kernels_us"] = kernel_us(run, (q, k, v, valid, w), args.calls)
            row["device_us"] = sum(row["kernels_us"].values())
        except Exception as err:  # keep the other forms of a costly run
            row["error"] = f"{type(err).__name__}: {err}"[:2000]
        print(row, flush=True)
        rows.append(row)
    save("attention_output", {"shape": [t, n, d, width], "results": rows})


if __name__ == "__main__":
    main()
