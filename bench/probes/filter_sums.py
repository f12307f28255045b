"""Probe: which form of the top-k / top-p threshold search's sums runs fastest on a GPU?

Question. `decoders.filtered` finds each row's top-k and top-p thresholds by a search over
the float32 order: each pass sums a weight (1, or a probability) over the vocabulary above
`_SEARCH_WAYS` candidate thresholds. Written as one sum over a [rows, ways, vocab]
broadcast, a step with filtered rows cost LLaDA-8B's generation 16% of its tokens/s at
batch 1 and 30% at batch 8 on an H100 (`bench.generate --sampling`, 5db105f), where reading
the logits once a pass predicts a few percent. Which form does XLA compile into a kernel
that reads the logits fewest times, and does the number of ways matter?

Answer (H100, run at 9f72b19 from this probe's code, the output in
`bench/results/logs/filter_sums_NVIDIA_H100_80GB_HBM3.log`; `filtered` alone on logits
[batch, 32, 126464], top_k 50 and top_p 0.9, median of 15 calls, ms at batch 1 / 8): the
broadcast 1.40 / 7.79; sixteen sibling sums 1.05 / 4.53 (XLA fuses them, but not into one
read); the thresholds on the minor axis, summed over the vocabulary ("column") 0.68 / 3.35,
and in a second run 0.74 / 3.47 at 16 ways x 8 passes, 0.68 / 3.38 at 8 x 11, 1.89 / 12.6
at 32 x 7, 2.88 / 19.6 at 64 x 6; a 17-bin histogram of each score's bucket 1.51 / 10.0;
3 ways x 16 passes as siblings 0.74 / 4.07; a binary search (32 passes) 0.99 / 6.86. Every
form gave the same kept set. `filtered` takes the column form at 16 ways x 8 passes.

    python -m bench.probes.filter_sums [--batches 1 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import save
from djax import decoders

VOCAB = 126464  # LLaDA-8B's
BLOCK = 32


def search(masses: Callable, ways_n: int, passes: int) -> Callable:
    """`decoders._highest_reaching`'s search with the pass's sums written as `masses(order,
    weight, t)` over `ways_n` thresholds, for `passes` passes ((ways_n + 1) ** passes must
    reach 2 ** 32 for an exact threshold)."""

    def highest_reaching(order, weight, target, lo, hi, axis_name):
        ways = jnp.arange(1, ways_n + 1, dtype=jnp.uint32)

        def one_pass(_, bounds):
            lo, hi = bounds
            width = hi - lo
            step = width // (ways_n + 1) + (width % (ways_n + 1) > 0)
            offset = step[..., None] * ways
            t = jnp.where(offset < width[..., None], lo[..., None] + offset, hi[..., None])
            mass = masses(order, weight, t)
            reaches = (mass >= target[..., None]) & (t < hi[..., None])
            new_lo = jnp.max(jnp.where(reaches, t, lo[..., None]), axis=-1)
            return new_lo, jnp.min(jnp.where(reaches, hi[..., None], t), axis=-1)

        return jax.lax.fori_loop(0, passes, one_pass, (lo, hi))[0]

    return highest_reaching


def broadcast(order, weight, t):
    above = order[..., None, :] >= t[..., :, None]
    return jnp.sum(jnp.where(above, weight[..., None, :], 0), axis=-1)


def siblings(order, weight, t):
    sums = [
        jnp.sum(jnp.where(order >= t[..., j, None], weight, 0), axis=-1) for j in range(t.shape[-1])
    ]
    return jnp.stack(sums, axis=-1)


def column(order, weight, t):
    above = order[..., :, None] >= t[..., None, :]
    return jnp.sum(jnp.where(above, weight[..., :, None], 0), axis=-2)


def histogram(order, weight, t):
    bucket = jnp.sum(order[..., None, :] >= t[..., :, None], axis=-2, dtype=jnp.int32)
    bins = jnp.arange(t.shape[-1] + 1)
    hist = jnp.sum(jnp.where(bucket[..., :, None] == bins, weight[..., :, None], 0), axis=-2)
    return jnp.flip(jnp.cumsum(jnp.flip(hist, -1), -1), -1)[..., 1:]


FORMS = {
    "broadcast 16x8": search(broadcast, 16, 8),
    "siblings 16x8": search(siblings, 16, 8),
    "column 16x8": search(column, 16, 8),
    "column 8x11": search(column, 8, 11),
    "column 32x7": search(column, 32, 7),
    "column 64x6": search(column, 64, 6),
    "histogram 16x8": search(histogram, 16, 8),
    "siblings 3x16": search(siblings, 3, 16),
    "binary 1x32": search(siblings, 1, 32),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args()
    own = decoders._highest_reaching
    rows = []
    try:
        for batch in args.batches:
            rng = np.random.default_rng(0)
            scaled = rng.standard_normal((batch, BLOCK, args.vocab), np.float32) * 3
            scaled = jnp.asarray(scaled)
            filters = decoders.Filters(
                jnp.full((batch,), 50, jnp.int32), jnp.full((batch,), 0.9, jnp.float32)
            )
            reference = None
            for name, form in FORMS.items():
                decoders._highest_reaching = form
                # a new function per form: jit would reuse its trace of `filtered` itself
                run = jax.jit(lambda x, f: decoders.filtered(x, f))
                kept = jax.block_until_ready(run(scaled, filters))
                reference = kept if reference is None else reference
                seconds = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(run(scaled, filters))
                    seconds.append(time.perf_counter() - start)
                row = {"batch": batch, "form": name, "ms": 1e3 * statistics.median(seconds)}
                row["same_kept_set"] = bool(jnp.array_equal(kept, reference))
                rows.append(row)
                print(row, flush=True)
    finally:
        decoders._highest_reaching = own
    save("filter_sums", {"vocab": args.vocab, "block": BLOCK, "results": rows})


if __name__ == "__main__":
    main()
