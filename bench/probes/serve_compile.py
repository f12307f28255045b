"""Where a serving block program's cold compile goes.

Question: `djax serve` with fp8 weights took ~40 s a block program to warm up cold
(LLaDA-8B, 21 programs, 844 s; LLaDA-MoE ~23 s a program; bf16 servers 5-12 s), its log
full of XLA's GEMM autotuner warning "Delay kernel timed out". Is the time in tracing and
lowering (djax's Python, the Mosaic GPU kernels), in XLA's compile, and there in its GEMM
autotuning?

Each leg is a fresh process with no compile cache: it builds the bench model (random
weights, `bench.common.bench_model`), the continuous serving engine of `bench.serve`'s trace,
and compiles one block program (`ServingEngine.call_bytes(batch, seq)`, for each of
`--batches`), under the XLA
options of its leg (`DJAX_XLA_OPTIONS`, over djax's own). A row holds the leg's seconds
(the whole compile, and JAX's own phases from its monitoring events), and how many lines of
the leg's log hold the autotuner's warning.

    python -m bench.probes.serve_compile [--model dense] [--batches 1 4] [--seq 1024]
        [--legs dtype:default fp8:xla_gpu_enable_triton_gemm=true fp8:default] [--tiny]

A leg's options are `DJAX_XLA_OPTIONS` over djax's own (`djax.xla_options`): since the
answer below, djax's own compile dense fp8 programs with Triton GEMM fusions off, so the
slow form is `fp8:xla_gpu_enable_triton_gemm=true` (the first run's `fp8:default`).

Answer: see `bench/NOTES.md` ("fp8 weights", the fp8 servers' warm-up).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import jax

from bench.common import model_config, save, use_routing

AUTOTUNER_WARNING = "Delay kernel timed out"


def leg(model_name: str, weights: str, batch: int, seq: int, tiny: bool) -> dict:
    """One fresh process: build the model and the engine, compile one block program."""
    from bench.common import bench_model
    from bench.serve import served_generation, trace_lengths
    from djax.serving.engine import ServeConfig, ServingEngine
    from djax.serving.metrics import ServerMetrics

    durations: collections.defaultdict = collections.defaultdict(float)
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: durations.__setitem__(name, durations[name] + secs)
    )
    config = model_config(model_name, tiny)
    if config.is_moe:
        use_routing("spread")
    start = time.perf_counter()
    model, _ = bench_model(config, weights=weights)
    built = time.perf_counter() - start
    serve_config = ServeConfig(
        generation=served_generation(trace_lengths(tiny)),
        scheduler="continuous",
        max_batch=batch,
        max_seq_len=seq,
        sampling=False,
    )
    engine = ServingEngine(model, serve_config, ServerMetrics())
    durations.clear()  # the model's build compiled programs of its own
    start = time.perf_counter()
    engine.call_bytes(batch, seq)
    return {
        "build_s": round(built, 2),
        "compile_s": round(time.perf_counter() - start, 2),
        "durations_s": {k: round(v, 2) for k, v in durations.items() if v >= 0.05},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dense", choices=["dense", "moe"])
    parser.add_argument("--batches", type=int, nargs="+", default=[4])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument(
        "--legs",
        nargs="+",
        default=["dtype:default", "fp8:xla_gpu_enable_triton_gemm=true", "fp8:default"],
        help="WEIGHTS:OPTIONS, OPTIONS `default` (djax's own) or XLA options over djax's "
        "joined by commas",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny config (a CPU's smoke test)")
    parser.add_argument("--leg", help=argparse.SUPPRESS)  # internal: run one leg
    args = parser.parse_args()
    if args.leg:
        batch = args.batches[0]
        print(
            "ROW " + json.dumps(leg(args.model, args.leg, batch, args.seq, args.tiny)), flush=True
        )
        return
    rows = []
    for batch, spec in ((b, spec) for b in args.batches for spec in args.legs):
        weights, _, options = spec.partition(":")
        if weights not in ("dtype", "fp8") or not options:
            raise SystemExit(f"bench.probes.serve_compile: leg {spec!r}; expected WEIGHTS:OPTIONS")
        # no compile cache (empty turns djax's off: the serving engine would turn it on)
        env = os.environ | {"DJAX_COMPILE_CACHE": ""}
        if options != "default":
            env["DJAX_XLA_OPTIONS"] = " ".join(options.split(","))
        command = [sys.executable, "-m", "bench.probes.serve_compile", "--leg", weights]
        command += ["--model", args.model, "--batches", str(batch), "--seq", str(args.seq)]
        command += ["--tiny"] if args.tiny else []
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        line = next((x for x in done.stdout.splitlines() if x.startswith("ROW ")), "")
        result = json.loads(line[4:]) if line else {"error": done.stderr[-3000:]}
        warnings = sum(AUTOTUNER_WARNING in x for x in done.stderr.splitlines())
        rows.append(
            {
                "weights": weights,
                "xla_options": options,
                "batch": batch,
                "seq": args.seq,
                **result,
                "process_s": round(wall, 1),
                "autotuner_warnings": warnings,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    setting = {"model": args.model, "seq": args.seq}
    save("serve_compile", {**setting, "results": rows}, setting=args.model)


if __name__ == "__main__":
    main()
