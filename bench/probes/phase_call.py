"""Probe: where does a phase call's device time go (`djax.phase`, `--scheduler phase`)?

Question. On the LLaDA-MoE serve trace the first phase scheduler served 0.80× the
continuous scheduler's tokens/s (1922854, `bench/results/serve_moe_phase_<device>.json`),
its calls taking 34 ms (median) for 32 slots' steps (1,024 tokens) and ~1,000 refresh
tokens. Which part of the call is the time?

Answer (H100, LLaDA-MoE, spread routing; figures in bench/NOTES.md, "Phase-multiplexed
serving"). At 1922854 a steps-only call took 23.9 ms, 39% of it copies: the pool's K/V
copied at every layer (the block's K/V written back into the pool out of place) and XLA's
attention transposing them. With the block K/V written in place and the steps attending
with the block forward's Mosaic GPU kernel, the refresh stream with cuDNN (d4d7e8a): 12.6
ms. Refresh tokens cost ~11 ms per 1,000 (30.2 ms with 1,800 of them), most of it in the
Mosaic GPU expert tiles (5.8 ms a call at 1,024 tokens, 14.4 at 3,072): the experts are
not bound by reading their weights once a call holds the refreshes' tokens too, so
refreshes do not ride free on the steps' weight reads. Attending over 384 of the pool's
1,024 positions was no faster (the slice is a copy): the pool spans were dropped.
LLaDA-8B (H100, af851bf, `--model dense`): a steps-only call 28.3 ms, 75% cuBLAS products
(compute-bound at 1,024 tokens); with 1,800 refresh tokens 93.8 ms, 11.2 ms of it copying
every layer's pool K/V before the stream's scatters, which were unordered with the steps'
reads of the pool. Tied to the forward's output (e01d2ba), the scatters write in place:
84.9 ms.

Prints, for each stream (refresh tokens a call) and each count of stepping slots (the
leading slots that take a cached step: a server with few rows running steps few), the
median milliseconds of a call over `--calls` calls, the resolved kernel choice, and for
`--profile` streams (at the most stepping slots) a profiler table of device time per op
category (`bench.profile.summarize`). The pool holds 32 rows of 300 tokens in 1,024
positions; each timed call with a stream refreshes rows of 300 tokens.

    python -m bench.probes.phase_call [--model moe] [--streams 0 1024 2048]
        [--stepping 32 16 8] [--calls 10] [--profile 0 2048]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import ROUTINGS, bench_model, model_config, save, use_routing
from bench.profile import trace_summaries
from djax import phase
from djax.decoders import DecoderSpec
from djax.diffusion import row_keys
from djax.serving.layout import RowLayout

SLOTS, POOL, BLOCK, ROW = 32, 1024, 32, 300


def refreshes(layout: RowLayout, slots: list[int]) -> list[phase.Refresh]:
    """Rows of ROW tokens (prompt ROW - 2 blocks, then two answer blocks) for `slots`."""
    rows = []
    for slot in slots:
        arrays = layout.arrays(1, ROW)
        layout.fill(arrays, 0, np.arange(10, 10 + ROW - 2 * BLOCK, dtype=np.int32), BLOCK)
        rows.append(
            phase.Refresh(
                slot,
                arrays["tokens"][0],
                arrays["positions"][0],
                -1,
                slot,
                row_keys(slot, 1)[0],
                0.9,
                0.0,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="moe")
    parser.add_argument("--routing", choices=ROUTINGS, default="spread")
    parser.add_argument("--streams", type=int, nargs="+", default=[0, 1024, 2048])
    parser.add_argument(
        "--stepping", type=int, nargs="+", default=[SLOTS], help=f"stepping slots (≤ {SLOTS})"
    )
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--profile", type=int, nargs="*", default=[0, 2048])
    parser.add_argument("--out", default="/tmp/djax_phase_profile")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    use_routing(args.routing)
    config = model_config(args.model, args.tiny)
    model, _ = bench_model(config)
    layout = RowLayout(BLOCK, config.mask_token_id, config.pad_token_id)

    def plan(stream: int, stepping: int = SLOTS) -> phase.PhasePlan:
        return phase.PhasePlan(
            slots=SLOTS,
            stepping=stepping,
            pool_len=POOL,
            stream=stream,
            refresh_rows=max(1, min(SLOTS, stream // (8 * BLOCK))),
            block_len=BLOCK,
            steps_per_block=8,
            decoder=DecoderSpec("low_confidence"),
            mask_id=config.mask_token_id,
        )

    def program(p: phase.PhasePlan):
        return phase.phase_program(model, p, phase.phase_kernels(model, p))

    pool = phase.place_pool(
        model,
        phase.empty_pool(config, SLOTS, POOL, BLOCK, model.dtype),
    )
    fill = plan(2048)
    fill_program = program(fill)
    per_call = 2048 // ROW
    for first in range(0, SLOTS, per_call):
        slots = list(range(first, min(first + per_call, SLOTS)))
        stream = phase.place_stream(model, phase.pack_stream(fill, refreshes(layout, slots), 0))
        pool = fill_program(model.params, pool, stream)["pool"]
    rows = []
    for stream_len, stepping in itertools.product(args.streams, args.stepping):
        p = plan(stream_len, stepping)
        run = program(p)
        slots = list(range(min(stream_len // ROW, p.refresh_rows))) if stream_len else []
        stream = None
        if stream_len:
            stream = phase.place_stream(model, phase.pack_stream(p, refreshes(layout, slots), 0))
        pool = jax.block_until_ready(run(model.params, pool, stream)["pool"])  # compile
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            pool = jax.block_until_ready(run(model.params, pool, stream)["pool"])
            times.append(1e3 * (time.perf_counter() - start))
        row = {
            "stream": stream_len,
            "stepping": stepping,
            "refresh_rows": len(slots),
            "refresh_tokens": len(slots) * ROW,
            "ms_median": statistics.median(times),
            "kernels": phase.phase_kernels(model, p).explain(),
        }
        if stream_len in args.profile and stepping == max(args.stepping):
            out = Path(args.out) / f"stream_{stream_len}"
            with jax.profiler.trace(str(out), create_perfetto_trace=True):
                for _ in range(3):
                    pool = jax.block_until_ready(run(model.params, pool, stream)["pool"])
            row["profile_3_calls"] = next(iter(trace_summaries(out).values()))
        print({k: v for k, v in row.items() if k not in ("kernels", "profile_3_calls")})
        rows.append(row)
    print(rows[0]["kernels"])
    save(f"phase_call_{args.model}", {"model": args.model, "routing": args.routing, "rows": rows})


if __name__ == "__main__":
    main()
