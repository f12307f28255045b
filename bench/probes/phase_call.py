"""Probe: where does a phase call's device time go (`djax.phase`, `--scheduler phase`)?

Question. On the LLaDA-MoE serve trace the phase scheduler's calls took 34 ms (median) for
32 slots' steps (1,024 tokens) plus ~1,000 refresh tokens, and it served 0.80× the
continuous scheduler's tokens/s (`bench/results/serve_moe_phase_<device>.json`). A
block call's cached step of 32 rows costs ~13 ms: which part of the phase call is the rest?

Prints, for each (stream, span) — refresh tokens a call and pool positions its steps
attend to — the median milliseconds of a call over `--calls` calls, the resolved kernel
choice, and for `--profile` shapes a profiler table of device time per op category
(`bench.profile.summarize`). The pool holds 32 rows of 300 tokens; each timed call with a
stream refreshes rows of 300 tokens into it.

    python -m bench.probes.phase_call [--model moe] [--streams 0 1024 2048]
        [--spans 384 1024] [--calls 10]
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--spans", type=int, nargs="+", default=[384, 1024])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--profile", nargs="*", default=["2048,1024", "0,1024"])
    parser.add_argument("--out", default="/tmp/djax_phase_profile")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    use_routing(args.routing)
    config = model_config(args.model, args.tiny)
    model, _ = bench_model(config)
    layout = RowLayout(BLOCK, config.mask_token_id, config.pad_token_id)

    def plan(stream: int, span: int) -> phase.PhasePlan:
        return phase.PhasePlan(
            slots=SLOTS,
            pool_len=POOL,
            stream=stream,
            refresh_rows=max(1, min(SLOTS, stream // (4 * BLOCK))),
            block_len=BLOCK,
            steps_per_block=8,
            decoder=DecoderSpec("low_confidence"),
            mask_id=config.mask_token_id,
            keys_len=span,
        )

    def program(p: phase.PhasePlan):
        return phase.phase_program(model, p, phase.phase_kernels(model, p))

    pool = phase.place_pool(
        model,
        phase.empty_pool(
            plan(0, POOL),
            (config.n_kv_heads, config.head_dim),
            config.n_layers,
            model.dtype,
            config.pad_token_id,
        ),
    )
    fill = plan(2048, POOL)
    fill_program = program(fill)
    per_call = 2048 // ROW
    for first in range(0, SLOTS, per_call):
        slots = list(range(first, min(first + per_call, SLOTS)))
        stream = phase.place_stream(model, phase.pack_stream(fill, refreshes(layout, slots), 0))
        pool = fill_program(model.params, pool, stream)["pool"]
    rows = []
    for stream_len in args.streams:
        for span in args.spans:
            p = plan(stream_len, span)
            run = program(p)
            slots = list(range(min(stream_len // ROW, p.refresh_rows))) if stream_len else []
            stream = None
            if stream_len:
                stream = phase.place_stream(
                    model, phase.pack_stream(p, refreshes(layout, slots), 0)
                )
            pool = jax.block_until_ready(run(model.params, pool, stream)["pool"])  # compile
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                pool = jax.block_until_ready(run(model.params, pool, stream)["pool"])
                times.append(1e3 * (time.perf_counter() - start))
            row = {
                "stream": stream_len,
                "span": span,
                "refresh_rows": len(slots),
                "refresh_tokens": len(slots) * ROW,
                "ms_median": statistics.median(times),
                "kernels": phase.phase_kernels(model, p).explain(),
            }
            if f"{stream_len},{span}" in args.profile:
                out = Path(args.out) / f"s{stream_len}_k{span}"
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
