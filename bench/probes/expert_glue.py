"""Probe: where does a LLaDA-MoE layer's expert time go, per kernel, for each expert path?

Question. With spread routing the Mosaic GPU expert tiles gave 636.8 tokens/s against the
Triton tiles' 880.4 (1b8f64f, `bench/results/generate_spread_fp8_NVIDIA_H100_80GB_HBM3.json`),
though the kernels were near each other in the micro-bench. Is the gap in the kernels or
around them?

Answer (H100, 28b4ae3 and 5272924; figures in bench/NOTES.md, "Off Pallas Triton"). The
kernels were level (280.6 against 271.6 µs at 32 tokens); XLA's work around the Mosaic ones
was not: 55 µs at 32 tokens, 190 at 384, most of it one fusion that recomputed the aligned
layout's compare-and-sum for every gathered value. With the layout materialised once
(`expert_tiles_mosaic.aligned_layout`), 298.6 µs in all at 32 tokens and 338.1 at 384,
against the Triton path's 289.5 and 328.3 (the Triton kernels are deleted since; the probe
now prints the Mosaic path and XLA's grouped path). With the pairs laid out by expert
without a sort (`group_layout`, 6c77181): 295.4 µs at 32 tokens, of which the kernels 273.1,
and 333.1 at 384; its first version, a prefix sum along the pairs, cost one 26.5 µs kernel
by itself (73c10b8). At a block's 32 tokens the every-token layout (`... tokens` paths,
3fe6e60) leaves no layout, gather or tile table around the kernels: fp8 x fp8 177.6 µs a
call in a loop against 194.7 (159.5 against 172.6 µs of kernels), bf16 302.4 against 315.5
(a40eb34; its two expert kernels 277.2 against 272.7 µs: every token's rows are stored).
Output of the runs: `bench/results/logs/expert_glue_NVIDIA_H100_80GB_HBM3.log`.

Prints, per token count, each path's device µs per call summed over its kernels and its
largest kernels (`kernel_us`: a profiler trace of 20 calls), LLaDA-MoE's expert shapes,
spread routing: the expert tiles and XLA's grouped path on bf16 weights, the fp8 x fp8
expert tiles on e4m3 weights held K-major (`fp8 mosaic`: what sets its glue apart from
bf16's), both tiles' paths in the every-token layout of a block forward (`... tokens`:
`experts_by_token`, at most 64 tokens), and with `--paths router` the router alone.

With `--loop N` it also prints each path's wall µs per call inside one compiled loop of N
calls (djax's XLA options: the loop runs as a CUDA graph, as a generation's does, so the
figure holds the gaps between kernels that the kernels' sum leaves out); with `--hlo DIR`
it writes each path's compiled program to DIR, naming the fusions the trace lists.

    python -m bench.probes.expert_glue [--tokens 32 384] [--paths mosaic xla "fp8 mosaic"
        "mosaic tokens" "fp8 mosaic tokens" router] [--top 8] [--loop 50] [--hlo DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import model_config, spread_routing
from bench.kernels.timing import kernel_us
from djax.kernels.tma_ring import ROW_ALIGN
from djax.models import fp8
from djax.models.llada_moe import (
    experts_by_token,
    experts_grouped,
    fp8_mosaic_mlp,
    mosaic_mlp,
    route,
)
from djax.xla_options import compiler_options

# name: (the routed-expert path, the weights it takes: bf16, or fp8 held K-major)
PATHS = {
    "mosaic": (functools.partial(experts_grouped, mlp=mosaic_mlp, align=ROW_ALIGN), "bf16"),
    "xla": (experts_grouped, "bf16"),
    "fp8 mosaic": (
        functools.partial(experts_grouped, mlp=fp8_mosaic_mlp, align=ROW_ALIGN),
        "fp8_k_major",
    ),
    # every token through each routed expert (a block's layout: at most 64 tokens)
    "mosaic tokens": (functools.partial(experts_by_token, mlp=mosaic_mlp), "bf16"),
    "fp8 mosaic tokens": (functools.partial(experts_by_token, mlp=fp8_mosaic_mlp), "fp8_k_major"),
}
TOKEN_PATHS_MAX = 64  # the most tokens the every-token paths take (one row tile)
FIRST = None  # every expert on the one device, as a one-device MoEBlock passes it


def k_major_fp8(gate_up, down) -> tuple:
    """The experts in e4m3, K-major, as a model loaded with `fp8_impl="mosaic"` holds them."""
    moved = fp8.to_layout(fp8.quantize_params({"gate_up": gate_up, "down": down}), True)
    return tuple(
        fp8.Fp8Weight(moved[name], moved[f"{name}_scale"], True, leading=1)
        for name in ("gate_up", "down")
    )


def loop_us(fn, args: tuple, calls: int) -> float:
    """Wall µs per call of `fn(*args)` run `calls` times inside one compiled loop, each call
    taking the last one's output into its first argument (so XLA cannot hoist it), with
    djax's XLA options; the median of 5 timings of the loop."""

    def body(_, x):
        return x + 1e-3 * fn(x, *args[1:])[: x.shape[0]].astype(x.dtype)

    looped = jax.jit(lambda x: jax.lax.fori_loop(0, calls, body, x))
    compiled = looped.lower(args[0]).compile(compiler_options(jax.default_backend()))
    jax.block_until_ready(compiled(args[0]))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(args[0]))
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times)) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[32, 384])
    parser.add_argument("--top", type=int, default=8, help="kernels listed per path")
    parser.add_argument("--paths", nargs="+", choices=[*PATHS, "router"], default=[*PATHS])
    parser.add_argument("--loop", type=int, default=0, help="calls in one compiled loop")
    parser.add_argument("--hlo", type=Path, help="write each path's compiled program here")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    args = parser.parse_args()
    cfg = model_config("moe", args.tiny)
    e, m, f, k = cfg.n_experts, cfg.d_model, cfg.expert_hidden, cfg.experts_per_token
    keys = jax.random.split(jax.random.key(0), 4)
    gate_up = (jax.random.normal(keys[0], (e, m, 2, f)) / np.sqrt(m)).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[1], (e, f, m)) / np.sqrt(f)).astype(jnp.bfloat16)
    weights_by_form = {"bf16": (gate_up, down)}
    if any(PATHS[p][1] == "fp8_k_major" for p in args.paths if p in PATHS):
        if m % 128 or f % 128:
            raise SystemExit(
                f"bench: 'fp8 mosaic' takes model and expert widths that are multiples of 128; "
                f"got {m} and {f}{' (--tiny)' if args.tiny else ''}"
            )
        weights_by_form["fp8_k_major"] = k_major_fp8(gate_up, down)
    router = jax.random.normal(keys[2], (m, e), jnp.bfloat16)
    routing = jax.jit(spread_routing(route), static_argnums=(3, 4))
    for n in args.tokens:
        x = jax.random.normal(keys[3], (n, m), jnp.bfloat16)
        weights, experts = routing(x, router, None, k, False)
        runs = {}
        if "router" in args.paths:  # the router alone: its product, softmax and top-k
            runs["router"] = (routing, (x, router, None, k, False))
        for name in args.paths:
            if name in PATHS and not (name.endswith(" tokens") and n > TOKEN_PATHS_MAX):
                path, form = PATHS[name]
                runs[name] = (jax.jit(path), (x, weights, experts, *weights_by_form[form], FIRST))
        for name, (fn, fn_args) in runs.items():
            us = kernel_us(fn, fn_args, 20)
            print(f"{n} tokens, {name}: {sum(us.values()):.1f} us", flush=True)
            for kernel, t in sorted(us.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"  {t:8.1f}  {kernel[:90]}", flush=True)
            if args.loop and name != "router":
                print(f"  in a loop: {loop_us(fn, fn_args, args.loop):.1f} us a call", flush=True)
            if args.hlo:
                args.hlo.mkdir(parents=True, exist_ok=True)
                text = fn.lower(*fn_args).compile().as_text()
                (args.hlo / f"{name.replace(' ', '_')}_{n}.hlo").write_text(text)


if __name__ == "__main__":
    main()
