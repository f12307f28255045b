"""Device time of kernels, read from profiler traces, for the kernel benchmarks
(`bench.kernels`, `bench.probes`), and the error measure they share."""

from __future__ import annotations

import collections
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.profile import newest_trace_events


def kernel_us(fn, args: tuple, calls: int) -> dict[str, float]:
    """Device µs per call of each kernel `fn` launches, read from a profiler trace of `calls`
    separate calls. Off GPUs (no device events) the wall time per call, under "wall"."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() != "gpu":
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        return {"wall": 1e6 * (time.perf_counter() - start) / calls}
    folder = Path(tempfile.mkdtemp(prefix="djax_kernel_trace_"))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    events = next(iter(newest_trace_events(folder).values()))
    shutil.rmtree(folder)
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        totals[e["name"]] += e["dur"] / calls
    return dict(totals)


def time_row(row: dict, fn, args: tuple, calls: int, weight_bytes: int, products: int = 1):
    """Fill a result row with `fn`'s kernel µs per product (`kernel_us` over `calls` calls,
    each running `products` products), their sum and the weight read rate in TB/s."""
    per_call = kernel_us(fn, args, calls)
    row["kernels_us"] = {name: us / products for name, us in per_call.items()}
    row["us"] = sum(row["kernels_us"].values())
    row["weight_TB_per_s"] = weight_bytes / row["us"] / 1e6


def rel_error(out, reference) -> float:
    """Relative L2 error of `out` against `reference`, in fp32."""
    out, reference = out.astype(jnp.float32), reference.astype(jnp.float32)
    return float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
