"""Compile time of the generation program at the compared setting (prompt 128, `SETTING`):
tracing and lowering, XLA's compile, and the first run, for a new shape and then again from
the persistent compilation cache. Each leg is a fresh Python process sharing one cache
folder, as when a user starts djax again: the second leg reads the lowered program back
(`djax.program_cache`) and XLA's executable from the cache. JAX's own monitoring events say
whether the persistent cache answered and where the seconds went. `--profile`: each row
also holds the functions its lowering spent the most time in (cProfile, by cumulative
seconds; `lowering_profile`).

    python -m bench.compile [--models dense moe] [--tiny] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from bench.common import SETTING, bench_model, model_config, save
from djax import engine, program_cache

EVENTS: collections.Counter = collections.Counter()
DURATIONS: collections.defaultdict = collections.defaultdict(float)


def _listen() -> None:
    jax.monitoring.register_event_listener(lambda name, **_: EVENTS.update([name]))
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: DURATIONS.__setitem__(name, DURATIONS[name] + secs)
    )


def hot_functions(profile: cProfile.Profile, count: int = 30) -> list[dict]:
    """The `count` functions of `profile` with the most cumulative seconds."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, _, tottime, cumtime, _)}
    rows = [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls": calls,
            "own_s": round(own, 3),
            "cumulative_s": round(cumulative, 3),
        }
        for (file, line, name), (calls, _, own, cumulative, _) in stats.items()
    ]
    return sorted(rows, key=lambda row: -row["cumulative_s"])[:count]


def phases(model, prompt_len: int, profile: bool = False) -> dict:
    """Seconds to lower, compile, run first and run again; the cache events in between;
    with `profile`, the lowering's hottest functions (`hot_functions`)."""
    EVENTS.clear()
    DURATIONS.clear()
    rows = [list(range(10, 10 + prompt_len))]
    plan, _ = engine.make_plan(model, SETTING, 1, prompt_len)
    args = engine.program_args(model, plan, rows, SETTING)
    folder = engine.programs_folder()  # None: no persistent cache
    programs = Path(folder or ".") / program_cache.FOLDER
    saved_before = len(list(programs.glob(f"*{program_cache.SUFFIX}"))) if folder else 0
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    lowered = engine.lower(model, plan, args)
    if profiler:
        profiler.disable()
    lowered_at = time.perf_counter()
    compiled = lowered.compile(engine.compiler_options(model, engine.kernel_choice(model, plan)))
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first_at = time.perf_counter()
    args = engine.program_args(model, plan, rows, SETTING)  # the first run donated them
    again_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    hot = {"lowering_profile": hot_functions(profiler)} if profiler else {}
    return {
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "first_run_s": first_at - compiled_at,
        "run_s": time.perf_counter() - again_at,
        "saved_programs_before": saved_before,
        "cache_events": {k: v for k, v in EVENTS.items() if "cache" in k},
        "durations_s": {k: round(v, 3) for k, v in DURATIONS.items() if v >= 0.05},
        **hot,
    }


def leg(name: str, tiny: bool, prompt_len: int, profile: bool) -> None:
    """One fresh process: build the model, measure, print the row as JSON."""
    _listen()
    engine.enable_compile_cache()  # the folder comes from $DJAX_COMPILE_CACHE
    model, _ = bench_model(model_config(name, tiny))
    print("ROW " + json.dumps(phases(model, prompt_len, profile)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="rows hold the lowering's hottest functions"
    )
    parser.add_argument("--leg", help=argparse.SUPPRESS)  # internal: run one leg
    args = parser.parse_args()
    if args.leg:
        return leg(args.leg, args.tiny, args.prompt, args.profile)
    cache = tempfile.mkdtemp(prefix="djax_xla_cache_")
    rows = []
    for name in args.models:
        for when in ("new shape", "persistent cache, new process"):
            command = [sys.executable, "-m", "bench.compile", "--leg", name]
            command += ["--prompt", str(args.prompt)] + (["--tiny"] if args.tiny else [])
            command += ["--profile"] if args.profile else []
            env = {**os.environ, "DJAX_COMPILE_CACHE": cache}
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            row = next((line for line in done.stdout.splitlines() if line.startswith("ROW ")), "")
            result = json.loads(row[4:]) if row else {"error": done.stderr[-3000:]}
            rows.append({"model": name, "when": when, **result})
            print(rows[-1], flush=True)
    save("compile", {"setting": SETTING.__dict__, "prompt_len": args.prompt, "results": rows})


if __name__ == "__main__":
    main()
