"""Probe: does `bench.sparse`'s timed call carry a cost of its own beside its forwards?

Question. At batch 16 and prompt 4,096 (LLaDA-8B, keep 0.25), `bench.sparse` timed a sparse
block forward at 16.76-17.12 ms where the profiler's trace of the same loop spans 16.33 ms a
forward; the dense forward's timing and trace agree (24.85 against 24.78 ms). The timing
divides a whole call (`iters` forwards in one compiled loop, the state donated) by `iters`,
so a cost paid once a call (a copy of a donated buffer at the program's entry, the host's
dispatch of ~450 arguments) lands in every forward's figure, and the engine does not pay it:
its kept rows are made inside its program. Is there such a cost, and how large is it?

Answer (H100, f0a92cc, `bench/results/sparse_call_NVIDIA_H100_80GB_HBM3.json`): a call
costs 1.0 ms besides its forwards dense and 3.4 ms sparse, 0.17 ms a forward at 20 forwards
a call; neither program holds a copy of 1 MB or more, and both take 283 MB of temp memory,
so no donated buffer is copied. The slopes, 24.38 and 16.62 ms a forward, give 1.467x
(bench/NOTES.md, "Sparse attention"): the call's cost does not explain the gap to 1.5x.

Method. Each form (dense, sparse) is the loop `bench.sparse` times, compiled once with its
forward count a traced argument, so calls of 5, 20 and 60 forwards run one program: the
slope of the median call time over the count is a forward's time, its intercept the call's
own cost. Beside the times: the compiled program's memory analysis (a temp size near the
kept rows' size would be a copy of them) and every copy instruction of at least 1 MB in
its optimised HLO.

    python -m bench.probes.sparse_call [--batch 16] [--prompt-len 4096] [--recent 64]
        [--counts 5 20 60] [--repeats 3] [--tiny]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import model_config, save
from bench.sparse import BLOCK, GEN, block_loop, random_choice
from djax import programs, xla_options
from djax.kernel_options import KernelOptions
from djax.models import init_params
from djax.models.kernel_choice import Shapes
from djax.models.sparse_attention import SparseAttention, kept_keys

ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
COPY = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (copy(?:-start)?)\(")
MB = 1 << 20


def large_copies(hlo: str) -> list[dict]:
    """The copy instructions of at least 1 MB in an optimised HLO text: shape and bytes."""
    copies = []
    for dtype, dims, op in COPY.findall(hlo):
        size = ITEMSIZE.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
        if size >= MB:
            copies.append({"op": op, "shape": f"{dtype}[{dims}]", "mb": size / MB})
    return copies


def memory(compiled) -> dict:
    """The compiled program's memory analysis, in MB."""
    analysis = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp")
    return {f: getattr(analysis, f"{f}_size_in_bytes") / MB for f in fields}


def measure(step, state, params, counts: list[int], repeats: int) -> dict:
    """Median seconds of calls of each forward count, their slope and intercept, the
    program's memory and its large copies."""

    def loop(state, params, count):
        return jax.lax.fori_loop(0, count, lambda _, c: step(c, params), state)

    options = xla_options.compiler_options(jax.default_backend())
    program = jax.jit(loop, donate_argnums=0)
    compiled = program.lower(state, params, jnp.int32(1)).compile(options)
    state = jax.block_until_ready(compiled(state, params, jnp.int32(counts[0])))  # warm
    seconds = {}
    for count in counts:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state = jax.block_until_ready(compiled(state, params, jnp.int32(count)))
            times.append(time.perf_counter() - start)
        seconds[count] = float(np.median(times))
    slope, intercept = np.polyfit(counts, [seconds[c] for c in counts], 1)
    return {
        "call_s": {str(c): s for c, s in seconds.items()},
        "per_call_ms": {str(c): 1e3 * s / c for c, s in seconds.items()},
        "forward_ms": 1e3 * float(slope),
        "call_overhead_ms": 1e3 * float(intercept),
        "memory_mb": memory(compiled),
        "copies": large_copies(compiled.as_text()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--counts", nargs="+", type=int, default=[5, 20, 60])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    args = p.parse_args(argv)
    if len(set(args.counts)) < 2:
        raise SystemExit(f"--counts {args.counts}: expected at least two different counts")
    dtype = jnp.bfloat16
    config = model_config("dense", args.tiny)
    params = init_params(config, dtype, seed=0)
    seq = args.prompt_len + GEN
    kernels = programs.kernel_choice(
        KernelOptions(), config, dtype, Shapes(args.batch, BLOCK, seq, BLOCK)
    )
    module = programs.local_module(config, dtype, kernels, None)
    rule = SparseAttention(args.keep, args.recent, kept_keys(args.keep, args.recent, seq, BLOCK))
    chosen = random_choice(
        rule, config.n_layers, args.batch, config.n_kv_heads, seq, args.prompt_len
    )
    rows = {}
    for name, kept in {"dense": None, "sparse": chosen}.items():
        step, state = block_loop(module, config, args.batch, seq, args.prompt_len, kept)
        rows[name] = measure(step, state, params, args.counts, args.repeats)
        print(name, rows[name], flush=True)
    ratio = {
        "timed_per_call": rows["dense"]["per_call_ms"][str(max(args.counts))]
        / rows["sparse"]["per_call_ms"][str(max(args.counts))],
        "slope": rows["dense"]["forward_ms"] / rows["sparse"]["forward_ms"],
    }
    print("dense / sparse", ratio, flush=True)
    save(
        "sparse_call",
        {
            "model": "dense",
            "tiny": args.tiny,
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "keys": seq,
            "sparse": {"keep": args.keep, "recent": args.recent, "keys": rule.keys},
            "attention": kernels.block.layers.attention,
            "results": rows,
            "speedup": ratio,
        },
    )


if __name__ == "__main__":
    main()
