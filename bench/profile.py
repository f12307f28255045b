"""Profile a whole generation under `jax.profiler` and summarise where the device time goes.

Writes the XProf/TensorBoard trace (and its Perfetto JSON) under `--out`, then a table of
device time per op category — matmul, attention, MoE, norms/elementwise, decoder, copies,
idle gaps — read from the trace's device events, readable without a viewer. Results:
`profile_<model>_<device>.json` (`profile_moe_spread_<device>.json` with `--routing spread`).

    python -m bench.profile [--model dense] [--devices N] [--cache dual] [--options k=v,...]
                            [--weights dtype|fp8] [--out DIR] [--tiny]
    python -m bench.profile --resummarize TRACE_DIR RESULT_JSON

The profiler does not see the kernels of a loop body captured as one CUDA graph (the
engine's loop command buffers, `djax.xla_options`): the profiled programs compile without
`WHILE` and `CONDITIONAL` command buffers (`TRACED_COMMAND_BUFFERS`, unless
`DJAX_XLA_OPTIONS` is set), so every kernel of every step is in the trace; the generation's
seconds are then those of that program, a little slower than the engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from bench.common import (
    ROUTINGS,
    SETTING,
    bench_model,
    commit,
    compile_loop,
    model_config,
    parse_options,
    save,
    use_routing,
)
from djax import generate, xla_options
from djax.config import WEIGHTS

# The engine's command buffers less the loop bodies (WHILE, CONDITIONAL), whose kernels a
# trace would not show one by one.
TRACED_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"

# First match wins; tested against the kernel name plus the op/scope names in its args.
CATEGORIES = [
    ("collectives", r"nccl|psum|all-?reduce|all_reduce|allreduce|all-?gather|collective"),
    ("copies", r"memcpy|memset|\bcopy|dynamic[-_]update[-_]slice|transpose"),
    ("decoder", r"decoder"),
    ("moe", r"ragged|grouped|experts?_?|router|\bsort|top_?k|scatter|argsort"),
    ("attention", r"fmha|flash|cudnn|attention|softmax"),
    ("matmul", r"gemm|cublas|cutlass|nvjet|xmma|wgmma|\bdot|matmul|triton_gemm|residual_product"),
    # a Mosaic GPU kernel without a name (`anonymous_mosaic_gpu_kernel`) whose scopes name no
    # category above
    ("mosaic (unnamed)", r"mosaic_gpu"),
]


def categorize(text: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, text, re.IGNORECASE):
            return name
    return "norms/elementwise"


def event_category(event: dict) -> str:
    """A kernel's category from its own name where that names one (`matmul_partials` inside
    the attention module is a matmul), else from its name with the op and scope names in
    its args (`loop_reduce_fusion` inside the decoder; an anonymous Mosaic GPU kernel inside
    the attention module)."""
    name = event.get("name", "")
    own = categorize(name)
    if own not in ("norms/elementwise", "mosaic (unnamed)"):
        return own
    return categorize(" ".join([name] + [str(v) for v in event.get("args", {}).values()]))


def device_events(trace: dict) -> dict[str, list[dict]]:
    """Complete events ('X') of each device process (pid named like /device:GPU:0), by
    device name."""
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device_pids = {
        pid for pid, name in names.items() if re.search(r"/device:(GPU|TPU)|GPU:\d", name)
    }
    events: dict[str, list[dict]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in device_pids and e.get("dur", 0) > 0:
            events[names[e["pid"]]].append(e)
    return dict(sorted(events.items()))


def summarize(events: list[dict]) -> dict:
    """Busy microseconds per category, the idle gaps of the device between kernels (no
    kernel on any stream), and how much of that idle time borders a collective (the gap
    before a collective starts or after one ends: time spent waiting on the other devices
    and on the hand-offs between the compute and collective streams)."""
    busy: dict[str, float] = defaultdict(float)
    spans = []
    durations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        category = event_category(e)
        busy[category] += e["dur"]
        durations[e.get("name", "")].append(e["dur"])
        spans.append((e["ts"], e["ts"] + e["dur"], category))
    if not spans:
        return {"error": "no device events found in the trace"}
    spans.sort()
    idle = idle_by_collectives = 0.0
    end, last = spans[0][0], spans[0][2]
    for start, stop, category in spans:
        if start > end:
            idle += start - end
            if "collectives" in (last, category):
                idle_by_collectives += start - end
        if stop > end:
            end, last = stop, category
    wall = spans[-1][1] - spans[0][0]
    busy["idle gaps"] = idle
    totals = {name: sum(durs) for name, durs in durations.items()}
    ranked = sorted(totals, key=totals.get, reverse=True)
    per_call = {  # a name can cover calls of several shapes: the mean is total / calls
        name: {
            "calls": len(durations[name]),
            "median_us": float(np.median(durations[name])),
            "mean_us": totals[name] / len(durations[name]),
        }
        for name in ranked[:60]
    }
    return {
        "wall_us": wall,
        "busy_us": dict(busy),
        "pct": {k: 100 * v / wall for k, v in busy.items()},
        "idle_next_to_collectives_us": idle_by_collectives,
        "top_kernels_us": {name: totals[name] for name in ranked[:15]},
        "kernel_calls": per_call,
        "events": len(events),
    }


def print_table(summary: dict) -> None:
    if "error" in summary:
        print(summary["error"])
        return
    print(f"{'category':<20} {'ms':>9} {'% of wall':>10}")
    for name, us in sorted(summary["busy_us"].items(), key=lambda kv: -kv[1]):
        print(f"{name:<20} {us / 1e3:>9.2f} {summary['pct'][name]:>9.1f}%")
    if summary["idle_next_to_collectives_us"]:
        us = summary["idle_next_to_collectives_us"]
        print(
            f"{'  idle by collectives':<20} {us / 1e3:>9.2f} {100 * us / summary['wall_us']:>9.1f}%"
        )
    print(f"{'wall':<20} {summary['wall_us'] / 1e3:>9.2f}")
    print("(device streams overlap, so categories may add up to more than the wall time)")


def newest_trace_events(trace_dir: Path) -> dict[str, list[dict]] | None:
    """`device_events` of the newest Perfetto trace under `trace_dir` (None: no trace)."""
    perfetto = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not perfetto:
        return None
    with gzip.open(perfetto[-1]) as fh:
        return device_events(json.load(fh))


def trace_summaries(trace_dir: Path) -> dict[str, dict]:
    """`summarize` of each device in the newest Perfetto trace under `trace_dir`, printed."""
    per_device = newest_trace_events(trace_dir)
    summaries = {"all": {"error": "no perfetto trace written"}}
    if per_device is not None:
        summaries = {name: summarize(events) for name, events in per_device.items()} or {
            "all": {"error": "no device events found in the trace"}
        }
    for name, summary in summaries.items():
        print(name)
        print_table(summary)
    return summaries


def profile_in_program(step, state, iters: int, *operands, donate: bool = False) -> dict:
    """Where one call of `compile_loop`'s program (`iters` steps of `step`) spends its
    device time: `summarize` of the first device in its trace, with the busy time of each
    category and of each of the most costly kernels per step (`busy_us_per_step`,
    `kernels_us_per_step`), and the last step's kernels in order, [name, µs] each
    (`last_step_kernels`: a step's events, the trace's last `1 / iters` of them). On a GPU
    the loop compiles with `TRACED_COMMAND_BUFFERS`, so the loop body's kernels show one by
    one; a trace without device events (a CPU's) gives `summarize`'s error."""
    options = xla_options.compiler_options(jax.default_backend())
    if jax.default_backend() == "gpu":
        options = {**options, "xla_gpu_enable_command_buffer": TRACED_COMMAND_BUFFERS}
    call = compile_loop(step, state, iters, *operands, options=options, donate=donate)
    state = call(state)  # compiled and warm outside the trace
    folder = Path(tempfile.mkdtemp(prefix="djax_loop_trace_"))
    try:
        with jax.profiler.trace(str(folder), create_perfetto_trace=True):
            call(state)
        per_device = newest_trace_events(folder) or {}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    events = next(iter(per_device.values()), [])
    summary = summarize(events)
    if "error" in summary:
        return summary
    summary["busy_us_per_step"] = {k: v / iters for k, v in summary["busy_us"].items()}
    summary["kernels_us_per_step"] = {
        name: us / iters for name, us in summary["top_kernels_us"].items()
    }
    ordered = sorted(events, key=lambda e: e["ts"])
    summary["last_step_kernels"] = [
        [e.get("name", ""), e["dur"]] for e in ordered[len(ordered) - len(ordered) // iters :]
    ]
    return summary


def resummarize(trace_dir: Path, result: Path) -> None:
    """Recompute a saved profile result's summaries from its trace (e.g. after the
    categories changed), recording when and by which command."""
    record = json.loads(result.read_text())
    summaries = trace_summaries(trace_dir)
    record["summary"] = next(iter(summaries.values()))
    record["summary_per_device"] = summaries
    record.setdefault("resummarized", []).append(
        {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", *sys.argv]),
            "commit": commit(),
        }
    )
    result.write_text(json.dumps(record, indent=2))
    print(f"rewrote {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dense")
    parser.add_argument("--cache", default="dual")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--attention-impl", default="auto")
    parser.add_argument("--moe-impl", default="auto")
    parser.add_argument("--routing", choices=ROUTINGS, default="model", help="see use_routing")
    parser.add_argument(
        "--options", default="default", help="more module options: key=value[,key=value]"
    )
    parser.add_argument("--devices", type=int, default=1, help="TP (dense) / EP (MoE) size")
    parser.add_argument(
        "--weights", choices=WEIGHTS, default="dtype", help="fp8: projections and experts in fp8"
    )
    parser.add_argument("--out", default="/tmp/djax_profile")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--resummarize",
        nargs=2,
        metavar=("TRACE_DIR", "RESULT_JSON"),
        help="only recompute RESULT_JSON's summaries from the trace in TRACE_DIR",
    )
    args = parser.parse_args()
    if args.resummarize:
        resummarize(Path(args.resummarize[0]), Path(args.resummarize[1]))
        return
    os.environ.setdefault(
        xla_options.ENV, f"xla_gpu_enable_command_buffer={TRACED_COMMAND_BUFFERS}"
    )
    use_routing(args.routing)
    config = model_config(args.model, args.tiny)
    options = {"attention_impl": args.attention_impl, "moe_impl": args.moe_impl}
    options = tuple(sorted((options | parse_options(args.options)).items()))
    model, _ = bench_model(config, args.devices, options, args.weights)
    gen = dataclasses.replace(SETTING, cache=args.cache)
    prompt = np.arange(10, 10 + args.prompt_len).tolist()
    generate(model, [prompt], gen)  # compile outside the trace
    out_dir = Path(args.out)
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        result = generate(model, [prompt], gen)
    summaries = trace_summaries(out_dir)
    spread = "_spread" if config.is_moe and args.routing == "spread" else ""
    fp8 = "_fp8" if args.weights == "fp8" else ""
    save(
        f"profile_{args.model}{spread}{fp8}",
        {
            "model": args.model,
            "cache": args.cache,
            "prompt_len": args.prompt_len,
            "options": dict(options),
            "routing": args.routing,
            "weights": args.weights,
            "xla_options": os.environ[xla_options.ENV],
            "generation_seconds": result.stats.seconds,
            "forwards": result.stats.forwards,
            "refreshes": result.stats.refreshes,
            "trace_dir": str(out_dir),
            "devices": args.devices,
            "summary": next(iter(summaries.values())),
            "summary_per_device": summaries,
        },
    )


if __name__ == "__main__":
    main()
