"""Probe: how long does the phase scheduler's host take per call (`djax.serving.phase`)?

Question. A phase call is short (9–10 ms with 8 slots stepping on an H100, LLaDA-8B and
LLaDA-MoE), and the host queues each call while the one before runs, so host work of
about a call's length per call leaves the device waiting. At 8 requests/s the LLaDA-MoE
phase server's device waited for the host up to 32% of the run (028f6de; 1.6% after the
fixes below, c3c1d05, `bench/results/serve_moe_phase_rate_<device>.json`). How much of a call
is the host's own work: admission, the refresh rows' layout and stream, the call's
dispatch, reading the block it ended?

Answer (the 2-core CPU machine, the tiny dense model; figures in bench/NOTES.md,
"Phase-multiplexed serving"). At 1d19f82: 0.84 ms a call at 32 slots, 0.67 at 8 (a run
of this probe on that code, not saved). A profile of it: a third comparing rows field by
field (the `_Row` dataclass's generated `__eq__`, behind every `row in deque` of
admission and dispatch), a quarter sending the stream's 11 arrays to the device one
`jnp.asarray` at a time. With rows compared by identity and the stream's host arrays
handed to the call, which sends them with its arguments (~35 µs here, not counted: the
stand-in sends nothing): 0.42 and 0.39 ms (d9cf9f7, `bench/results/phase_host_cpu.json`).
Either is well under a call's 9–10 ms, so the host's own work per call does not explain
that run's waits. On the H100 machine's host (38dc407, `phase_host_<device>.json`): 0.93
and 0.90 ms. The LLaDA-MoE phase server at 8/s waited 0.8% and 1.6% in two later runs
(38dc407, c3c1d05), not 32%, with 1 and 3 gaps over 10 ms against 307: the changes in
between (d9cf9f7: these two and the host-gap bound noted after each wait; 039395c: each
request's row keys from a compiled program instead of an eager vmap traced anew on the
API's thread) took it there; which of them did is not separated.

The engine runs as `djax serve` runs it (`PhaseEngine`, a fixed-steps decoder, so block
ends are known from the calls' count), its compiled programs swapped after warm-up for a
stand-in that returns at once with every block decoded: what is left is the host. Each
run submits `--requests-per-slot` × slots requests of a 40-token prompt and a 64-token
answer (blocks of 8, 8 steps a block) at once; prints and saves (`phase_host_<device>.json`)
the calls and the median host ms a call over `--repeats` runs per slot count.

    python -m bench.probes.phase_host [--model dense] [--slots 32 8] [--repeats 3]
        [--requests-per-slot 16]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import jax.numpy as jnp

import djax
from bench.common import bench_model, model_config, save
from djax.serving.engine import ServeConfig, make_engine
from djax.serving.metrics import ServerMetrics
from djax.serving.requests import EngineRequest, Failed, Finished

PROMPT, ANSWER, BLOCK = 40, 64, 8


class _Done:
    """Counts finished requests (`sink`), failed ones with their messages; `event` is set
    once `target` have finished."""

    def __init__(self, target: int):
        self.finished = 0
        self.failed: list[str] = []
        self.event = threading.Event()
        self.target = target

    def sink(self, event) -> None:
        if isinstance(event, Failed):
            self.failed.append(event.message)
        elif not isinstance(event, Finished):
            return
        self.finished += 1
        if self.finished >= self.target:
            self.event.set()


def host_only_engine(model, slots: int):
    """A started phase engine on `slots` slots whose programs, once compiled, are swapped
    for a stand-in that returns at once with every block decoded; and its count of calls."""
    generation = djax.GenerationConfig(gen_length=ANSWER, block_length=BLOCK, steps=ANSWER)
    config = ServeConfig(
        generation=generation, scheduler="phase", max_batch=slots, max_seq_len=PROMPT + ANSWER
    )
    engine = make_engine(model, config, ServerMetrics())
    engine.start()
    if not engine.wait_ready(1800):
        raise SystemExit("phase_host: the engine did not get ready")
    block = jnp.full((slots, BLOCK), 5, jnp.int32)  # an id that is not the mask
    steps = jnp.full((slots,), BLOCK, jnp.int32)
    calls = [0]

    def stand_in(params, pool, stream):
        calls[0] += 1
        return {"pool": pool, "block": block + 0, "step_in_block": steps + 0}

    for shape in list(engine._programs):
        engine._programs[shape] = stand_in
    return engine, calls


def host_ms_per_call(engine, calls: list[int], requests: int) -> tuple[int, float]:
    """(calls, host ms a call) of one run of `requests` requests submitted at once."""
    done = _Done(requests)
    prompt = tuple(range(3, 3 + PROMPT))
    first = calls[0]
    start = time.perf_counter()
    with engine._lock:  # one admission sees them all
        for i in range(requests):
            engine.submit(EngineRequest(f"r{i}", prompt, ANSWER, ignore_eos=True), done.sink)
    if not done.event.wait(600):
        raise SystemExit(f"phase_host: {done.finished} of {requests} requests finished")
    seconds = time.perf_counter() - start
    if done.failed:
        raise SystemExit(f"phase_host: requests failed: {done.failed[:3]}")
    n = calls[0] - first
    return n, 1e3 * seconds / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dense")
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests-per-slot", type=int, default=16)
    args = parser.parse_args()
    model, _ = bench_model(model_config(args.model, tiny=True))
    rows = []
    for slots in args.slots:
        engine, calls = host_only_engine(model, slots)
        requests = args.requests_per_slot * slots
        runs = [host_ms_per_call(engine, calls, requests) for _ in range(args.repeats)]
        engine.stop()
        row = {
            "model": args.model,
            "slots": slots,
            "requests": args.requests_per_slot * slots,
            "calls": runs[0][0],
            "host_ms_per_call": statistics.median(ms for _, ms in runs),
            "runs_ms": [ms for _, ms in runs],
        }
        print(row, flush=True)
        rows.append(row)
    save("phase_host", {"results": rows})


if __name__ == "__main__":
    main()
