"""How many rows a serving block call can hold on one device, with the memory budget's chunked
logits and with a whole `[batch, block, vocab]` fp32 logits tensor (what an engine that makes
every step's logits at once holds), at each `--seqs` sequence length.

Compile only, nothing runs: the serving engine's own block-call programs (`djax serve`'s
continuous scheduler, `SETTING`'s decoder and dual cache, blocks of 32, no sampling) for the
model with random bf16 weights (`bench.common`), and each program's bytes beside the weights
as the engine counts them (`djax.serving.memory`: the compiled program's memory analysis).
The budget is the engine's: `--memory-fraction` of the device's memory (`bytes_limit`, with
JAX's pool sized as `djax serve` sizes it: `memory.size_device_pool`), or `--memory-bytes`,
less the weights. Per variant the largest batch whose call fits is found from the bytes of
batches 1 and 2 (a call's bytes grow about linearly in its batch): the batch they predict,
then its neighbours until a fitting batch and the one above it (over the budget) were both
compiled, bisecting when the prediction was far off.

    python -m bench.memory [--model dense] [--seqs 4096] [--logits-chunk 16384]
        [--memory-fraction 0.9] [--memory-bytes N] [--max-batch 512] [--tiny]

Results: `memory_<device>.json`, one row per sequence: both batches and their ratio, the
budget, the weights, the calls' bytes at those batches, the bytes a row adds (batch 2 less
batch 1), the logits' share (whole less chunked at the whole-logits batch), the K/V buffers
of a row, and every compiled batch's bytes (`probes`). `--tiny` checks the script on a CPU,
which reports no memory: pass `--memory-bytes` there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Sequence

import jax

from bench.common import SETTING, bench_model, model_config, save
from djax import Model, engine
from djax.serving import memory
from djax.serving.engine import ServeConfig, ServingEngine
from djax.serving.metrics import ServerMetrics

BLOCK = 32


def largest_batch(cost: Callable[[int], int], limit: int, max_batch: int) -> tuple[int, dict]:
    """The largest batch in [1, max_batch] whose `cost` is within `limit` (0 when none),
    assuming `cost` grows with the batch; and every batch's cost it asked for. Asks for
    batches 1 and 2, then, twice, for the batch a line through the bracket's ends predicts
    (through batches 1 and 2 while no batch is known to be over) and its neighbour toward
    the boundary; then bisects what is left between a fitting batch and one over."""
    probes: dict[int, int] = {}

    def ask(batch: int) -> bool:
        if batch not in probes:
            probes[batch] = cost(batch)
        return probes[batch] <= limit

    if not ask(1):
        return 0, probes
    if max_batch == 1:
        return 1, probes
    lo, hi = (2, max_batch + 1) if ask(2) else (1, 2)  # lo fits, hi is over (or past the end)

    def narrow(probe: int) -> bool:
        nonlocal lo, hi
        probe = min(max(probe, lo + 1), hi - 1)
        fits = ask(probe)
        lo, hi = (probe, hi) if fits else (lo, probe)
        return fits

    rounds = 0
    while hi - lo > 1:
        rounds += 1
        if rounds > 2:
            narrow((lo + hi) // 2)
            continue
        a, b = (lo, hi) if hi in probes else (1, 2)
        per_row = max((probes[b] - probes[a]) / (b - a), 1)
        fits = narrow(lo + int((limit - probes[lo]) // per_row))
        if hi - lo > 1:
            narrow(lo + 1 if fits else hi - 1)
    return lo, probes


def serving_engine(model: Model, seq: int, chunk: int, args: argparse.Namespace) -> ServingEngine:
    """The serving engine whose block calls are measured: logits `chunk` ids at a time (0:
    the whole vocabulary)."""
    generation = dataclasses.replace(SETTING, block_length=BLOCK, logits_chunk=chunk)
    config = ServeConfig(
        generation=generation,
        scheduler="continuous",  # its block calls are what is measured
        max_batch=args.max_batch,
        max_seq_len=seq,
        sampling=False,
        memory_fraction=args.memory_fraction,
        memory_bytes=args.memory_bytes,
    )
    return ServingEngine(model, config, ServerMetrics())


def measure(model: Model, seq: int, args: argparse.Namespace) -> dict:
    """One row: the largest batch at `seq` with chunked and with whole logits."""
    variants = {"budgeted": args.logits_chunk, "unbudgeted": 0}
    engines = {name: serving_engine(model, seq, chunk, args) for name, chunk in variants.items()}
    limit = engines["budgeted"].memory.limit
    if limit is None:
        raise SystemExit("bench.memory: the device reports no memory (a CPU): pass --memory-bytes")

    def search(name: str) -> tuple[int, dict]:
        return largest_batch(lambda b: engines[name].call_bytes(b, seq), limit, args.max_batch)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # XLA compiles without the GIL
        found = dict(zip(variants, pool.map(search, variants), strict=True))
    (batch, probes), (whole_batch, whole_probes) = found["budgeted"], found["unbudgeted"]
    cfg = model.config
    itemsize = jax.numpy.dtype(model.dtype).itemsize
    at = max(whole_batch, 1)
    chunked_at = engines["budgeted"].call_bytes(at, seq)
    print(f"seq {seq}: batch {batch} with chunked logits, {whole_batch} with whole logits")
    return {
        "seq_len": seq,
        "block_length": BLOCK,
        "logits_chunk": args.logits_chunk,
        "batch_budgeted": batch,
        "batch_unbudgeted": whole_batch,
        "ratio": round(batch / whole_batch, 3) if whole_batch else None,
        "budget_bytes": limit,
        "weight_bytes": memory.weight_bytes(model.params),
        "device_bytes": memory.device_memory(model),
        "call_bytes_budgeted": probes.get(batch),
        "call_bytes_unbudgeted": whole_probes.get(whole_batch),
        "bytes_per_row_budgeted": row_bytes(probes),
        "bytes_per_row_unbudgeted": row_bytes(whole_probes),
        "logits_bytes_at_batch": {
            "batch": at,
            "whole_less_chunked": whole_probes[at] - chunked_at,
        },
        "kv_bytes_per_row": 2 * cfg.n_layers * seq * cfg.n_kv_heads * cfg.head_dim * itemsize,
        "probes": {"budgeted": probes, "unbudgeted": whole_probes},
    }


def row_bytes(probes: dict[int, int]) -> int | None:
    """The bytes one more row adds to a call (batch 2 less batch 1)."""
    return probes[2] - probes[1] if 2 in probes else None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dense", "moe", "llada2_mini"), default="dense")
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096], help="sequence lengths")
    parser.add_argument(
        "--logits-chunk",
        type=int,
        help="vocabulary ids per logits chunk of the budgeted calls (default: 16384, a quarter "
        "of the vocabulary with --tiny)",
    )
    parser.add_argument("--memory-fraction", type=float, default=0.9)
    parser.add_argument("--memory-bytes", type=int, help="the device's bytes (needed on a CPU)")
    parser.add_argument("--max-batch", type=int, default=512, help="the largest batch tried")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    config = model_config(args.model, args.tiny)
    if config.block_diffusion:
        raise SystemExit(f"bench.memory: {args.model} decodes by block diffusion, not served")
    if args.logits_chunk is None:
        args.logits_chunk = config.vocab_size // 4 if args.tiny else 16384
    if not 0 < args.logits_chunk < config.vocab_size:
        raise SystemExit(
            f"bench.memory: --logits-chunk {args.logits_chunk}; expected an int in "
            f"(0, {config.vocab_size}) (the vocabulary)"
        )
    memory.size_device_pool()  # before the backend starts, as `djax serve` does
    engine.enable_compile_cache()  # the folder comes from $DJAX_COMPILE_CACHE
    model, _ = bench_model(config)
    rows = [measure(model, seq, args) for seq in args.seqs]
    save(
        "memory",
        {
            "model": args.model,
            "setting": {**SETTING.__dict__, "block_length": BLOCK, "logits_chunk": None},
            "memory_fraction": args.memory_fraction,
            "memory_bytes": args.memory_bytes,
            "pool": {name: os.environ.get(name) for name in memory.POOL_VARIABLES},
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
