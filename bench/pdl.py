"""Can a kernel read its weights before the kernel it depends on has finished?

Each product of a LLaDA-8B block layer loses ~2.5 µs to its start and tail (bench/NOTES.md,
"Not yet done" 1): its first weight bytes arrive only after its predecessor has ended, been
flushed, and it has been launched. With programmatic dependent launch (PDL) a kernel may
start while its predecessor still runs, and only `griddepcontrol.wait` holds it until the
predecessor's results are visible. XLA's PDL (`xla_gpu_enable_pdl`) puts that wait at the
start of the kernels it generates, so none of them can fetch anything early. Mosaic GPU
kernels place it themselves (`plgpu.griddepcontrol_wait`).

This probe chains `--chain` Mosaic GPU kernels, each streaming its own weight matrix (the
down product's 12288 × 4096 bf16, 100.7 MB by default) through a ring of TMA copies into
shared memory, and each reading one row of its predecessor's output after the wait, so the
chain is a real dependence. Variants:
- `wait_first`: the wait at the kernel's start, as XLA places it;
- `prefetch`: the first `--stages` weight tiles requested before the wait;
- either with `griddepcontrol.launch_dependents` at the start (so a successor may launch
  at once) or without it;
each compiled with and without `xla_gpu_enable_pdl` (command buffers off, so that the
profiler records every kernel). Without PDL the launch attribute is
off and the wait returns at once: every kernel starts after its predecessor has ended.
Per kernel of the chain: the device span of a call over its kernels (from a profiler trace)
and the wall time, against the weight bytes at the measured HBM read rate.

    python -m bench.pdl [--chain 8] [--rows 12288] [--cols 4096] [--stages 4] [--ctas 128]

GPU only (Hopper or newer).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import measure_ceilings, save
from bench.profile import newest_trace_events

TILE = (64, 256)  # weight rows x columns per TMA copy: 32 KB of bf16
ROW = 128  # floats each kernel passes to its successor per CTA


def stream_kernel(ctas: int, tiles_per_cta: int, stages: int, prefetch: bool, trigger: bool):
    """A Mosaic GPU kernel (x [ctas, ROW] f32, w [tiles, *TILE] bf16) -> [ctas, ROW] f32:
    CTA g streams weight tiles [g * tiles_per_cta, (g + 1) * tiles_per_cta) through a ring
    of `stages` shared-memory slots and writes x[g] + 1."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_gmem, w_gmem, out_gmem, ring, ring_bars, row, row_bar):
        g = jax.lax.axis_index("cta")
        base = g * tiles_per_cta
        if trigger:
            plgpu.griddepcontrol_launch_dependents()
        if not prefetch:
            plgpu.griddepcontrol_wait()
        for s in range(stages):
            plgpu.copy_gmem_to_smem(w_gmem.at[base + s], ring.at[s], ring_bars.at[s])
        if prefetch:
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem.at[g], row, row_bar.at[0])

        @pl.loop(0, tiles_per_cta)
        def _step(i):
            slot = jax.lax.rem(i, stages)
            plgpu.barrier_wait(ring_bars.at[slot])

            @pl.when(i + stages < tiles_per_cta)
            def _refill():
                plgpu.copy_gmem_to_smem(
                    w_gmem.at[base + i + stages], ring.at[slot], ring_bars.at[slot]
                )

        plgpu.barrier_wait(row_bar.at[0])
        row[...] = row[...] + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(row, out_gmem.at[g])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((ctas, ROW), jnp.float32),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((stages, *TILE), jnp.bfloat16),
            plgpu.Barrier(num_barriers=stages),
            plgpu.SMEM((ROW,), jnp.float32),
            plgpu.Barrier(num_barriers=1),
        ],
    )


def chain_time(ws, ctas: int, stages: int, prefetch: bool, trigger: bool, pdl: bool, repeats: int):
    """One variant: the wall time of a call of the chain over `ws` (each [tiles, *TILE]),
    and from a profiler trace of `repeats` calls the device span of each call (first
    kernel's start to last kernel's end), the kernels' own durations and what runs between
    them; with the output's check (each kernel adds 1: every value must be the chain's
    length)."""
    tiles_per_cta = ws[0].shape[0] // ctas
    kernel = stream_kernel(ctas, tiles_per_cta, stages, prefetch, trigger)

    def chain(x, ws):
        for w in ws:
            x = kernel(x, w)
        return x

    x = jnp.zeros((ctas, ROW), jnp.float32)
    options = {"xla_gpu_enable_pdl": pdl, "xla_gpu_enable_command_buffer": ""}
    compiled = jax.jit(chain).lower(x, ws).compile(options)
    out = compiled(x, ws)
    check = float(np.asarray(out).min()), float(np.asarray(out).max())
    start = time.perf_counter()
    for _ in range(repeats):
        out = compiled(x, ws)
    out.block_until_ready()
    wall = (time.perf_counter() - start) / repeats
    folder = Path(tempfile.mkdtemp(prefix="djax_pdl_trace_"))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(repeats):
            out = compiled(x, ws)
        out.block_until_ready()
    events = sorted(next(iter(newest_trace_events(folder).values())), key=lambda e: e["ts"])
    shutil.rmtree(folder)
    kernels = [e for e in events if "mosaic" in e["name"]]
    others = collections.Counter(e["name"] for e in events if "mosaic" not in e["name"])
    calls = [kernels[i : i + len(ws)] for i in range(0, len(kernels) - len(ws) + 1, len(ws))]
    spans = [c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls]
    return {
        "wall_us_per_kernel": 1e6 * wall / len(ws),
        "device_us_per_kernel": float(np.median(spans)) / len(ws),
        "kernel_us": float(np.median([e["dur"] for e in kernels])),
        "kernel_names": sorted({e["name"] for e in kernels}),
        "other_events_per_call": {name: n / repeats for name, n in others.items()},
        "check": check,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=8)
    parser.add_argument("--rows", type=int, default=12288)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--ctas", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"bench.pdl needs a Hopper GPU (Mosaic GPU kernels); got {jax.devices()}")
    tiles = args.rows * args.cols // (TILE[0] * TILE[1])
    if args.rows * args.cols % (TILE[0] * TILE[1]) or tiles % args.ctas:
        raise SystemExit(f"{args.rows} x {args.cols} is not {args.ctas} CTAs of whole {TILE} tiles")
    keys = jax.random.split(jax.random.key(0), args.chain)
    ws = [jax.random.normal(k, (tiles, *TILE), jnp.bfloat16) for k in keys]
    ceilings = measure_ceilings()
    weight_bytes = ws[0].nbytes
    floor_us = 1e6 * weight_bytes / ceilings["hbm_read_bytes_per_s"]
    rows = []
    for stages, prefetch, trigger, pdl in itertools.product(
        args.stages, (False, True), (False, True), (False, True)
    ):
        row = {"stages": stages, "prefetch": prefetch, "trigger": trigger, "pdl": pdl}
        try:
            row |= chain_time(ws, args.ctas, stages, prefetch, trigger, pdl, args.repeats)
            row |= {"floor_us": floor_us, "check_ok": row["check"] == (args.chain, args.chain)}
        except Exception as err:  # keep the other variants of a costly run
            row["error"] = f"{type(err).__name__}: {err}"[:1500]
        print(row, flush=True)
        rows.append(row)
    save(
        "pdl",
        {
            "options": vars(args),
            "weight_bytes": weight_bytes,
            "ceilings": ceilings,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
