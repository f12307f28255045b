"""Compile time of the generation program at the compared setting (prompt 128, `SETTING`):
tracing and lowering, XLA's compile, and the first run, for a new shape and then again from
the persistent compilation cache after this process's caches are dropped. JAX's own
monitoring events say whether the persistent cache answered and where the seconds went.

    python -m bench.compile [--models dense moe] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time

import jax
import jax.numpy as jnp

from bench.common import SETTING, bench_model, model_config, save
from djax import engine
from djax.xla_options import compiler_options

EVENTS: collections.Counter = collections.Counter()
DURATIONS: collections.defaultdict = collections.defaultdict(float)


def _listen() -> None:
    jax.monitoring.register_event_listener(lambda name, **_: EVENTS.update([name]))
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: DURATIONS.__setitem__(name, DURATIONS[name] + secs)
    )


def phases(model, prompt_len: int) -> dict:
    """Seconds to lower, compile, run first and run again; the cache events in between."""
    EVENTS.clear()
    DURATIONS.clear()
    rows = [list(range(10, 10 + prompt_len))]
    plan, _ = engine.make_plan(model, SETTING, 1, prompt_len)
    inputs = engine.build_inputs(rows, plan, model.config.pad_token_id)
    names = ("tokens", "key_valid", "positions")

    def fresh():  # the program donates its row inputs
        return (model.params, *(jnp.asarray(inputs[k]) for k in names), jax.random.key(0))

    args = fresh()
    start = time.perf_counter()
    lowered = engine._program(model, plan).lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile(compiler_options(jax.default_backend()))
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first_at = time.perf_counter()
    args = fresh()
    again_at = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return {
        "lower_s": lowered_at - start,
        "compile_s": compiled_at - lowered_at,
        "first_run_s": first_at - compiled_at,
        "run_s": time.perf_counter() - again_at,
        "cache_events": {k: v for k, v in EVENTS.items() if "cache" in k},
        "durations_s": {k: round(v, 3) for k, v in DURATIONS.items() if v >= 0.05},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    engine.enable_compile_cache(tempfile.mkdtemp(prefix="djax_xla_cache_"))
    _listen()
    rows = []
    for name in args.models:
        model, _ = bench_model(model_config(name, args.tiny))
        for when in ("new shape", "persistent cache"):
            jax.clear_caches()
            rows.append({"model": name, "when": when, **phases(model, args.prompt)})
            print(rows[-1], flush=True)
        del model
    save("compile", {"setting": SETTING.__dict__, "prompt_len": args.prompt, "results": rows})


if __name__ == "__main__":
    main()
