"""Probe: can a kernel read its weights before the kernel it depends on has finished?

Question. Each product of a LLaDA-8B block layer loses ~2.5 µs to its start and tail: its
first weight bytes arrive only after its predecessor has ended, been flushed, and it has
been launched. With programmatic dependent launch (PDL) a kernel may start while its
predecessor still runs, and only `griddepcontrol.wait` holds it until the predecessor's
results are visible. XLA's PDL (`xla_gpu_enable_pdl`) puts that wait at the start of the
kernels it generates, so none of them can fetch anything early; Mosaic GPU kernels place it
themselves (`plgpu.griddepcontrol_wait`). How much of the boundary does that hide?

Answer (H200, commits ff6c0d9-b7f85c8, result `bench/results/pdl_NVIDIA_H200.json`; the
tables are in bench/NOTES.md). A bare stream reads 100.7 MB in 23.4-23.8 µs (4.2-4.3 TB/s,
start and tail included). Only both halves together help: a trigger at the predecessor's
start and weight tiles requested before the wait save 1.2-1.3 µs per kernel; either alone
saves nothing, and `xla_gpu_enable_pdl` changes nothing for Mosaic GPU kernels. With a short
dependent kernel (~1 µs, like a norm) between two streams a third of it hides; with a
1.7 µs one, triggers at the start make the pair slower. Bound for a block layer made only of
Mosaic GPU kernels with tuned triggers: 2-4 µs per layer (1.5-3% of a block forward).

This probe chains `--chain` Mosaic GPU kernels, each streaming its own weight matrix (the
down product's 12288 × 4096 bf16, 100.7 MB by default) through a ring of TMA copies into
shared memory, and each reading one row of its predecessor's output after the wait, so the
chain is a real dependence. Variants:
- `wait_first`: the wait at the kernel's start, as XLA places it;
- `prefetch`: the first `--stages` weight tiles requested before the wait;
- `griddepcontrol.launch_dependents` at the start (so a successor may launch at once),
  after the last weight tile has arrived, or not at all;
each compiled with and without `xla_gpu_enable_pdl` (command buffers off, so that the
profiler records every kernel). Without PDL the launch attribute is
off and the wait returns at once: every kernel starts after its predecessor has ended.
With `--spin N` a short dependent kernel (N multiply-adds per value, like a norm kernel
between two products) follows each stream and triggers its successor as it starts, so the
next stream's early weight requests may hide it. Per weight stream of the chain: the device
span of a call (from a profiler trace) and the wall time, against the weight bytes at the
measured HBM read rate.

    python -m bench.probes.pdl [--chain 8] [--rows 12288] [--cols 4096] [--stages 4] [--ctas 128]
        [--spin 0 2000]

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


TRIGGERS = ("none", "start", "end")


def stream_kernel(ctas: int, tiles_per_cta: int, stages: int, prefetch: bool, trigger: str):
    """A Mosaic GPU kernel (x [ctas, ROW] f32, w [tiles, *TILE] bf16) -> [ctas, ROW] f32:
    CTA g streams weight tiles [g * tiles_per_cta, (g + 1) * tiles_per_cta) through a ring
    of `stages` shared-memory slots and writes x[g] + 1. `trigger` (TRIGGERS): where it
    lets its successor launch, at its start or after its last weight tile has arrived."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def stream(x_gmem, w_gmem, out_gmem, ring, ring_bars, row, row_bar):
        g = jax.lax.axis_index("cta")
        base = g * tiles_per_cta
        if trigger == "start":
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

        if trigger == "end":
            plgpu.griddepcontrol_launch_dependents()
        plgpu.barrier_wait(row_bar.at[0])
        row[...] = row[...] + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(row, out_gmem.at[g])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        stream,
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


def small_kernel(ctas: int, spin: int, trigger: bool):
    """A short dependent Mosaic GPU kernel, like the norm kernels between a layer's
    products: (x [ctas, ROW] f32) -> x + 1, after `spin` dependent multiply-adds per value
    (their result only guards the add, so the compiler keeps them); with `trigger`, its
    successor may launch as it starts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def small(x_gmem, out_gmem, row, row_bar):
        g = jax.lax.axis_index("cta")
        if trigger:
            plgpu.griddepcontrol_launch_dependents()
        plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem.at[g], row, row_bar.at[0])
        plgpu.barrier_wait(row_bar.at[0])
        value = row[...]
        settled = jax.lax.fori_loop(0, spin, lambda _, t: t * 0.5 + 1.0, value)
        row[...] = value + 1.0 + jnp.where(settled > 1e30, 1.0, 0.0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(row, out_gmem.at[g])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        small,
        out_type=jax.ShapeDtypeStruct((ctas, ROW), jnp.float32),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[plgpu.SMEM((ROW,), jnp.float32), plgpu.Barrier(num_barriers=1)],
    )


def chain_time(
    ws,
    ctas: int,
    stages: int,
    prefetch: bool,
    trigger: str,
    pdl: bool,
    repeats: int,
    spin: int = 0,
):
    """One variant: the wall time of a call of the chain over `ws` (each [tiles, *TILE]),
    and from a profiler trace of `repeats` calls the device span of each call (first
    kernel's start to last kernel's end) per weight stream, the kernels' own durations and
    what runs between them; with the output's check (each kernel adds 1: every value must
    be the number of kernels). With `spin`, a `small_kernel` (triggering as the streams do)
    follows each stream."""
    tiles_per_cta = ws[0].shape[0] // ctas
    kernel = stream_kernel(ctas, tiles_per_cta, stages, prefetch, trigger)
    small = small_kernel(ctas, spin, trigger != "none") if spin else None

    def chain(x, ws):
        for w in ws:
            x = kernel(x, w)
            x = x if small is None else small(x)
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
    per_call = len(ws) * (2 if spin else 1)
    calls = [kernels[i : i + per_call] for i in range(0, len(kernels) - per_call + 1, per_call)]
    spans = [c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls]
    durations = collections.defaultdict(list)
    for e in kernels:
        durations[e["name"]].append(e["dur"])
    return {
        "wall_us_per_kernel": 1e6 * wall / len(ws),
        "device_us_per_kernel": float(np.median(spans)) / len(ws),
        "kernel_us": {name: float(np.median(d)) for name, d in durations.items()},
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
    parser.add_argument("--triggers", nargs="+", choices=TRIGGERS, default=list(TRIGGERS))
    parser.add_argument(
        "--spin",
        type=int,
        nargs="+",
        default=[0],
        help="also a small dependent kernel after each stream, with this many steps (0: none)",
    )
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(
            f"bench.probes.pdl needs a Hopper GPU (Mosaic GPU kernels); got {jax.devices()}"
        )
    tiles = args.rows * args.cols // (TILE[0] * TILE[1])
    if args.rows * args.cols % (TILE[0] * TILE[1]) or tiles % args.ctas:
        raise SystemExit(f"{args.rows} x {args.cols} is not {args.ctas} CTAs of whole {TILE} tiles")
    keys = jax.random.split(jax.random.key(0), args.chain)
    ws = [jax.random.normal(k, (tiles, *TILE), jnp.bfloat16) for k in keys]
    ceilings = measure_ceilings()
    weight_bytes = ws[0].nbytes
    floor_us = 1e6 * weight_bytes / ceilings["hbm_read_bytes_per_s"]
    rows = []
    for spin, stages, prefetch, trigger, pdl in itertools.product(
        args.spin, args.stages, (False, True), args.triggers, (False, True)
    ):
        row = {"spin": spin, "stages": stages, "prefetch": prefetch, "trigger": trigger}
        row["pdl"] = pdl
        kernels = args.chain * (2 if spin else 1)
        try:
            row |= chain_time(ws, args.ctas, stages, prefetch, trigger, pdl, args.repeats, spin)
            row |= {"floor_us": floor_us, "check_ok": row["check"] == (kernels, kernels)}
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
