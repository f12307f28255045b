"""Decoding strategies: which masked positions of the current block to commit this step.

Every function works on a whole batch at once (`[batch, block]` arrays) and inside the
compiled loop. Logits may be split over the vocabulary across the mesh axis `axis_name`;
the (token, confidence) reduction then combines per-device maxima and sums with
`pmax`/`psum` instead of gathering full logits, and stays exact.

Semantics: confidence is softmax(clean logits)[token]; the
prediction is argmax at temperature 0, a Gumbel-max sample of softmax(logits / T) above,
limited to the ids a row's top-k and top-p keep (`Filters`, `filtered`; whole logits only);
the mask id is never predicted, so it is never committed.

`predict` takes a step's whole logits; `predict_chunked` computes them a vocabulary chunk at
a time and keeps only running statistics per position (the best choosable score, its id,
the logit there, the running max and the sum of exps), so no [batch, block, vocab] array
exists. Both draw the same Gumbel noise (`gumbel_noise`, a function of the row's key, the
position and the vocabulary id), so from the same logits they pick the same tokens;
`DecoderSpec.chunk_for` says which one a program takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from djax.generation import DECODERS, FIXED_DECODERS

Array = jax.Array
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The decoder and its static parameters (part of the compiled program's key).

    low_threshold: τ_low of `hierarchy`; factor: f of `factor`; credit_*: α, γ, β of
    `credit`. The threshold (τ of `threshold` and `credit`, τ_high of `hierarchy`) and the
    temperature are per-row values of the program (`djax.diffusion.Rows`), so rows of one
    batch may differ in them. logits_chunk: vocabulary ids per chunk of a step's logits
    (`predict_chunked`), 0 for the whole vocabulary at once (`chunk_for`).
    """

    name: str = "threshold"
    low_threshold: float = 0.4
    factor: float = 1.0
    credit_alpha: float = 0.7
    credit_gamma: float = 0.2
    credit_beta: float = 0.8
    logits_chunk: int = 0

    @property
    def fixed_steps(self) -> bool:
        return self.name in FIXED_DECODERS

    def chunk_for(self, vocab_local: int, smoothing: bool = False) -> int | None:
        """The vocabulary chunk a step computes its logits in (`predict_chunked`), or None
        for the whole of this device's `vocab_local` ids at once (`predict`): None when
        `logits_chunk` is 0 or covers the vocabulary, for `credit` (its state holds every
        token of every position) and under iteration `smoothing` (the expected embedding
        needs every probability)."""
        whole = self.name == "credit" or smoothing
        if whole or self.logits_chunk == 0 or self.logits_chunk >= vocab_local:
            return None
        return self.logits_chunk


# ---------------------------------------------------------------- vocabulary reductions


def _vocab_offset(local_vocab: int, axis_name: str | None) -> Array | int:
    return 0 if axis_name is None else jax.lax.axis_index(axis_name) * local_vocab


class VocabStats(NamedTuple):
    """Running statistics of a pass over vocabulary ids, each [...]: the best choosable
    score, its id (the lowest on ties), the clean logit there, the max clean logit and the
    sum of exp(logit - that max)."""

    best: Array
    arg: Array
    at: Array
    top: Array
    total: Array


def _merge(a: tuple[Array, ...], b: tuple[Array, ...]) -> VocabStats:
    """The statistics of two disjoint sets of ids (associative and commutative)."""
    best_a, arg_a, at_a, top_a, sum_a = a
    best_b, arg_b, at_b, top_b, sum_b = b
    take_b = (best_b > best_a) | ((best_b == best_a) & (arg_b < arg_a))
    top = jnp.maximum(top_a, top_b)

    def rescaled(part_top: Array, part_sum: Array) -> Array:  # empty parts stay 0
        return jnp.where(part_top == top, part_sum, part_sum * jnp.exp(part_top - top))

    return VocabStats(
        jnp.where(take_b, best_b, best_a),
        jnp.where(take_b, arg_b, arg_a),
        jnp.where(take_b, at_b, at_a),
        top,
        rescaled(top_a, sum_a) + rescaled(top_b, sum_b),
    )


def _vocab_pass(choosable: Array, logits: Array) -> VocabStats:
    """One pass over some vocabulary ids (the last axis of both); `arg` counts from the
    first of them.

    One variadic reduction in place of three over fp32 logits of [batch, block, vocab]: the
    arg-max, the max and the sum of exps read the logits once (`bench/NOTES.md`, "The
    decoder").
    """
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    operands = (choosable, index, logits, logits, jnp.ones_like(logits))
    init = (NEG_INF, jnp.iinfo(jnp.int32).max, 0.0, NEG_INF, 0.0)
    init = tuple(jnp.asarray(v, x.dtype) for v, x in zip(init, operands, strict=True))
    merge = lambda a, b: tuple(_merge(a, b))
    return VocabStats(*jax.lax.reduce(operands, init, merge, (logits.ndim - 1,)))


def _token_and_logsumexp(
    stats: VocabStats, vocab_local: int, axis_name: str | None
) -> tuple[Array, Array, Array]:
    """A pass's statistics over this device's `vocab_local` ids (`arg` a local id) as the
    global token id of the best choosable score, the logit at it and logsumexp(logits) over
    the (possibly split) vocabulary: the devices' statistics are combined with
    `pmax`/`pmin`/`psum`."""
    best, arg, at, top, total = stats
    if axis_name is None:
        return arg, at, top + jnp.log(total)
    candidate = arg + _vocab_offset(vocab_local, axis_name)
    is_best = best == jax.lax.pmax(best, axis_name)
    big = jnp.iinfo(jnp.int32).max
    token = jax.lax.pmin(jnp.where(is_best, candidate, big), axis_name)
    at = jax.lax.psum(jnp.where(candidate == token, at, 0.0), axis_name)
    global_top = jax.lax.pmax(top, axis_name)
    total = jax.lax.psum(total * jnp.exp(top - global_top), axis_name)
    return token, at, global_top + jnp.log(total)


def _top_and_logsumexp(
    choosable: Array, logits: Array, axis_name: str | None
) -> tuple[Array, Array, Array]:
    """The first arg-max of `choosable` over the (possibly split) vocabulary as a global
    token id, `logits` at it, and logsumexp(logits); each [...]."""
    stats = _vocab_pass(choosable, logits)
    return _token_and_logsumexp(stats, logits.shape[-1], axis_name)


def _logsumexp_global(logits: Array, axis_name: str | None) -> Array:
    local_max = jnp.max(logits, axis=-1)
    global_max = local_max if axis_name is None else jax.lax.pmax(local_max, axis_name)
    total = jnp.sum(jnp.exp(logits - global_max[..., None]), axis=-1)
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
    return global_max + jnp.log(total)


def gumbel_noise(key: Array, positions: int, vocab_ids: Array, vocab_size: int) -> Array:
    """Gumbel noise [positions, len(vocab_ids)] for the given global vocabulary ids of a
    row's `positions` block positions.

    Element (p, v) is a function of the key and its counter p · vocab_size + v alone
    (Threefry-2x32 on that counter, as `jax.random.gumbel(key, (positions, vocab_size))`
    draws it under JAX's default partitionable Threefry), so any split of the vocabulary,
    over devices or into chunks, draws exactly the noise of the whole.
    """
    if positions * vocab_size >= 2**32:
        raise ValueError(
            f"gumbel_noise: {positions} positions × vocabulary {vocab_size} ≥ 2**32 counters"
        )
    counter = jnp.arange(positions, dtype=jnp.uint32)[:, None] * jnp.uint32(vocab_size)
    counter = counter + vocab_ids.astype(jnp.uint32)[None, :]
    k1, k2 = jax.random.key_data(key)
    # threefry_2x32 hashes the first half of its counts with the second: (0, c) for each c
    pairs = jnp.concatenate([jnp.zeros_like(counter), counter]).ravel()
    hashed = threefry_2x32((k1, k2), pairs).reshape((2,) + counter.shape)
    bits = hashed[0] ^ hashed[1]
    # a uniform in [tiny, 1) from the top 23 bits, as jax.random.uniform makes it
    one = jnp.asarray(np.float32(1.0).view(np.uint32))
    floats = jax.lax.bitcast_convert_type((bits >> 9) | one, jnp.float32) - 1.0
    tiny = jnp.finfo(jnp.float32).tiny
    uniform = jnp.maximum(tiny, floats * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


class Filters(NamedTuple):
    """Per-row limits on what a sampled token may be, applied to the logits over the
    temperature in the order top-k, then top-p: top_k [batch] int32, the k highest scores
    (every score equal to the k-th kept too; 0: no limit); top_p [batch] fp32, the fewest
    highest scores whose probability, renormalised over what top-k kept, reaches p (a
    score is kept when the scores above it hold less than p; 1: no limit). Rows at
    temperature 0 take the argmax, which both keep."""

    top_k: Array
    top_p: Array


def _choosable(
    logits: Array,
    local_ids: Array,
    temperature: Array | None,
    keys: Array | None,
    mask_id: int,
    axis_name: str | None,
    vocab_local: int,
    filters: Filters | None = None,
) -> Array:
    """The scores a prediction maximises at this device's vocabulary ids `local_ids`
    [width] of `logits` [batch, positions, width]: the logits (the mask id at -inf), over
    the row's temperature plus Gumbel noise where it is above 0, -inf where the row's
    `filters` leave a score out (`local_ids` must then be this device's whole vocabulary)."""
    offset = _vocab_offset(vocab_local, axis_name)
    choosable = jnp.where(local_ids == mask_id - offset, NEG_INF, logits)
    if temperature is None:
        return choosable
    vocab_size = vocab_local * (1 if axis_name is None else jax.lax.axis_size(axis_name))
    positions = logits.shape[1]
    noise = jax.vmap(lambda key: gumbel_noise(key, positions, offset + local_ids, vocab_size))(keys)
    t = temperature[:, None, None]
    scaled = choosable / jnp.where(t > 0, t, 1.0)
    if filters is not None:  # rows at temperature 0 take the argmax: no passes for them
        sampled = temperature > 0
        filters = Filters(
            jnp.where(sampled, filters.top_k, 0), jnp.where(sampled, filters.top_p, 1.0)
        )
        scaled = filtered(scaled, filters, axis_name)
    return jnp.where(t > 0, scaled + noise, choosable)


# ---------------------------------------------------------------- top-k and top-p

# A pass of the threshold search counts (or sums) at this many thresholds at once, so the
# 2**32 float32 orders take ceil(32 / log2(17)) = 8 passes.
_SEARCH_WAYS = 16
_SEARCH_PASSES = 8
_SIGN = np.uint32(0x80000000)


def _order(x: Array) -> Array:
    """float32 -> uint32 that orders as the floats do (-inf lowest; no NaNs; -0 as +0,
    so that equal scores tie)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _highest_reaching(
    order: Array, weight: Array, target: Array, lo: Array, hi: Array, axis_name: str | None
) -> Array:
    """The largest u in [lo, hi) with sum(weight[order >= u]) >= target, per position.

    order [..., vocab] uint32 (`_order`), weight [..., vocab] fp32 >= 0, target [...] fp32;
    lo, hi [...] uint32 bounds where the sum at lo reaches `target` and the sum at hi does
    not (hi exclusive). Each pass sums the weight above `_SEARCH_WAYS` thresholds evenly inside
    [lo, hi) (over the mesh's vocabulary shards too) and keeps the sub-interval holding the
    boundary: exact after `_SEARCH_PASSES` passes."""
    ways = jnp.arange(1, _SEARCH_WAYS + 1, dtype=jnp.uint32)

    def one_pass(_, bounds):
        lo, hi = bounds
        width = hi - lo
        step = width // (_SEARCH_WAYS + 1) + (width % (_SEARCH_WAYS + 1) > 0)
        offset = step[..., None] * ways  # <= 16 * ceil(2**32 / 17) < 2**32
        t = jnp.where(offset < width[..., None], lo[..., None] + offset, hi[..., None])
        # the thresholds on the minor axis, summed over the vocabulary: of the forms
        # `bench.probes.filter_sums` compares, the one XLA's GPU kernels run fastest
        above = order[..., :, None] >= t[..., None, :]  # [..., vocab, ways]
        mass = jnp.sum(jnp.where(above, weight[..., :, None], 0), axis=-2)
        if axis_name is not None:
            mass = jax.lax.psum(mass, axis_name)
        # thresholds rise with j, so those that reach come first; hi never does (a
        # target of 0, top_p flushed to zero, would otherwise leave no score at all)
        reaches = (mass >= target[..., None]) & (t < hi[..., None])
        new_lo = jnp.max(jnp.where(reaches, t, lo[..., None]), axis=-1)
        new_hi = jnp.min(jnp.where(reaches, hi[..., None], t), axis=-1)
        return new_lo, new_hi

    lo, _ = jax.lax.fori_loop(0, _SEARCH_PASSES, one_pass, (lo, hi))
    return lo


def check_filters(filters: Filters | None, chunk: int | None) -> None:
    """Filters need a step's whole logits: a ValueError where the logits come in chunks."""
    if filters is not None and chunk is not None:
        raise ValueError(
            f"top_k/top_p need a step's whole logits; this program computes them {chunk} "
            "vocabulary ids at a time (logits_chunk): give logits_chunk=0"
        )


def filtered(scaled: Array, filters: Filters, axis_name: str | None = None) -> Array:
    """`scaled` [batch, positions, vocab_local] (logits over the temperature, -inf where a
    token may never be chosen) at -inf wherever the row's `filters` leave a token out;
    the vocabulary may be split over the mesh axis `axis_name`. The thresholds are found
    by counting (top-k) and summing probabilities (top-p) above candidate thresholds over
    the whole vocabulary, a few passes over the logits each, a search only when some row
    of the call asks for it."""
    top_k = filters.top_k[:, None]
    top_p = filters.top_p[:, None]
    order = _order(scaled)

    def thresholds() -> Array:
        finite = scaled > NEG_INF
        big = jnp.uint32(np.iinfo(np.uint32).max)
        lo = jnp.min(jnp.where(finite, order, big), axis=-1)
        hi = jnp.max(jnp.where(finite, order, jnp.uint32(0)), axis=-1)
        if axis_name is not None:
            lo = jax.lax.pmin(lo, axis_name)
            hi = jax.lax.pmax(hi, axis_name)
        hi = hi + (hi < big)  # exclusive (a +inf score keeps the whole range)

        def top_k_th() -> Array:  # the k-th highest score, counted over the whole vocabulary
            ones = finite.astype(jnp.float32)
            k = jnp.broadcast_to(jnp.where(top_k > 0, top_k, 1).astype(jnp.float32), lo.shape)
            return jnp.where(top_k > 0, _highest_reaching(order, ones, k, lo, hi, axis_name), lo)

        # top-p over what top-k kept: a score is kept when the scores strictly above it
        # hold less than p of the kept mass, i.e. when it is at or above the highest u
        # whose scores at or above it hold at least p of that mass
        def top_p_th(k_th: Array) -> Array:
            top = jnp.max(scaled, axis=-1)
            if axis_name is not None:
                top = jax.lax.pmax(top, axis_name)
            kept = order >= k_th[..., None]
            weight = jnp.where(kept & finite, jnp.exp(scaled - top[..., None]), 0.0)
            total = jnp.sum(weight, axis=-1)
            if axis_name is not None:
                total = jax.lax.psum(total, axis_name)
            reaching = _highest_reaching(order, weight, top_p * total, k_th, hi, axis_name)
            return jnp.where(top_p < 1, reaching, k_th)

        # each search runs only where some row asks for it (a client sending top_p alone
        # runs no top-k passes)
        k_th = jax.lax.cond(jnp.any(filters.top_k > 0), top_k_th, lambda: lo)
        return jax.lax.cond(jnp.any(filters.top_p < 1), top_p_th, lambda k_th: k_th, k_th)

    active = jnp.any((filters.top_k > 0) | (filters.top_p < 1))
    floor = jnp.zeros(scaled.shape[:-1], jnp.uint32)
    threshold = jax.lax.cond(active, thresholds, lambda: floor)
    return jnp.where(order >= threshold[..., None], scaled, NEG_INF)


def predict(
    logits: Array,
    temperature: Array | None,
    keys: Array | None,
    mask_id: int,
    axis_name: str | None = None,
    filters: Filters | None = None,
) -> tuple[Array, Array]:
    """Token and confidence at each position.

    logits: [batch, block, vocab_local] fp32; temperature: [batch] fp32 (0: argmax for that
    row), or None when every row takes the argmax; keys: [batch] PRNG keys, one per row, so
    a row's sample never depends on its batch-mates; filters: the rows' top-k and top-p
    (`Filters`), or None for none. Returns token [batch, block] int32 (never the mask id)
    and confidence = softmax(logits)[token] [batch, block] fp32 (of the logits as they
    are: the filters change which token is drawn, not its confidence).
    """
    vocab_local = logits.shape[-1]
    local_ids = jnp.arange(vocab_local)
    choosable = _choosable(
        logits, local_ids, temperature, keys, mask_id, axis_name, vocab_local, filters
    )
    token, logit, normaliser = _top_and_logsumexp(choosable, logits, axis_name)
    return token, jnp.exp(logit - normaliser)


def predict_chunked(
    logits_at: Callable[[Array], Array],
    vocab_local: int,
    chunk: int,
    temperature: Array | None,
    keys: Array | None,
    mask_id: int,
    axis_name: str | None = None,
) -> tuple[Array, Array]:
    """`predict`'s token and confidence with the logits made `chunk` ids at a time.

    logits_at(start): fp32 logits [batch, block, chunk] of this device's ids [start,
    start + chunk). Chunk c covers ids [c · chunk, (c + 1) · chunk); the last one starts at
    vocab_local - chunk instead, so that every chunk is whole, and its ids seen before are
    left out. Only the running `VocabStats` outlive a chunk. Given the logits `predict`
    gets, the token and the logit at it are its exactly (maxima do not depend on the
    order), the normaliser is summed in another order, so a confidence may differ in its
    last bits. (A chunk's product may round a logit differently from the whole head's,
    which can change a token only where two scores tie within that rounding.)
    """
    if not 0 < chunk <= vocab_local:
        raise ValueError(f"chunk={chunk}; expected 0 < chunk ≤ vocab_local={vocab_local}")

    def chunk_stats(c: Array | int) -> VocabStats:
        first = c * chunk
        start = jnp.minimum(first, vocab_local - chunk)
        logits = logits_at(start)
        local_ids = start + jnp.arange(chunk)
        new = local_ids >= first
        choosable = _choosable(
            logits, local_ids, temperature, keys, mask_id, axis_name, vocab_local
        )
        part = _vocab_pass(jnp.where(new, choosable, NEG_INF), jnp.where(new, logits, NEG_INF))
        return part._replace(arg=part.arg + start)

    n_chunks = -(-vocab_local // chunk)
    stats = jax.lax.fori_loop(
        1, n_chunks, lambda c, stats: _merge(stats, chunk_stats(c)), chunk_stats(0)
    )
    token, logit, normaliser = _token_and_logsumexp(stats, vocab_local, axis_name)
    return token, jnp.exp(logit - normaliser)


def probabilities(logits: Array, axis_name: str | None = None) -> Array:
    """softmax over the (possibly split) vocabulary: [..., vocab_local]."""
    return jnp.exp(logits - _logsumexp_global(logits, axis_name)[..., None])


# ---------------------------------------------------------------- commit rules


def _rank(score: Array, masked: Array) -> Array:
    """Each row's masked positions ranked from 0 by descending score (a NaN score as -inf),
    ties broken by the lower position; the unmasked positions after all of them."""
    key = jnp.where(jnp.isnan(score), jnp.inf, -score)
    key = jnp.where(masked, key, jnp.nan)  # a sort puts NaN keys last, in position order
    order = jnp.argsort(key, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def commit_top_k(score: Array, masked: Array, k: Array) -> Array:
    """The k highest-scoring masked positions of each row. score: [batch, block]; k: [batch]."""
    return masked & (_rank(score, masked) < k[:, None])


def most_confident(confidence: Array, masked: Array) -> Array:
    """The single most confident masked position of each row (ties, -inf ones included: the
    lower position); a NaN confidence is never chosen, so a row whose masked confidences
    are all NaN, or that holds no mask, gets none. [batch, block] -> [batch, block] bool."""
    choosable = masked & ~jnp.isnan(confidence)
    best = jnp.argmax(jnp.where(choosable, confidence, NEG_INF), axis=-1)
    # every choosable confidence -inf: argmax names position 0, maybe not a choosable one
    held = jnp.take_along_axis(choosable, best[:, None], axis=-1)[:, 0]
    best = jnp.where(held, best, jnp.argmax(choosable, axis=-1))
    return choosable & (jnp.arange(masked.shape[-1]) == best[:, None])


def commit_threshold(confidence: Array, masked: Array, threshold: Array | float) -> Array:
    """Masked positions with confidence ≥ τ, and the most confident one whatever its
    confidence (so a row with masks always commits)."""
    return (masked & (confidence >= threshold)) | most_confident(confidence, masked)


def commit_factor(confidence: Array, masked: Array, factor: float) -> Array:
    """Longest prefix of the descending masked confidences whose n-th element (1-based)
    satisfies (n + 1)(1 − p_n) < f; at least one."""
    score = jnp.where(masked, confidence, NEG_INF)
    ordered = -jnp.sort(-score, axis=-1)
    n = jnp.arange(1, score.shape[-1] + 1)
    passes = ((n + 1) * (1 - ordered) < factor) & (ordered > NEG_INF)
    count = jnp.sum(jnp.cumprod(passes, axis=-1), axis=-1)
    return commit_top_k(confidence, masked, jnp.maximum(count, 1))


def commit_hierarchy(confidence: Array, masked: Array, high: Array | float, low: float) -> Array:
    """Each maximal run of consecutive masked positions commits its most confident position
    if p > low; every position with p > high commits; the most confident always does."""
    block = masked.shape[-1]
    starts = masked & ~jnp.pad(masked, ((0, 0), (1, 0)))[:, :block]
    run = jnp.cumsum(starts, axis=-1)
    score = jnp.where(masked, confidence, NEG_INF)
    same_run = (run[:, :, None] == run[:, None, :]) & masked[:, :, None] & masked[:, None, :]
    idx = jnp.arange(block)
    # j beats i within a run: higher score, or equal score at a lower position.
    beats = (score[:, None, :] > score[:, :, None]) | (
        (score[:, None, :] == score[:, :, None]) & (idx[None, :] < idx[:, None])
    )
    run_best = masked & ~jnp.any(same_run & beats, axis=-1)
    commit = (run_best & (confidence > low)) | (masked & (confidence > high))
    return commit | most_confident(confidence, masked)


def fixed_schedule(masks_at_start: Array, steps: int, step: Array) -> Array:
    """LLaDA's schedule: M masks over s steps commit M // s per step, plus one in the
    first M % s steps. masks_at_start: [batch]; step: step index within the block."""
    return masks_at_start // steps + (step < masks_at_start % steps).astype(jnp.int32)


# ---------------------------------------------------------------- credit decoder


def credit_update(
    credit: Array,
    logits: Array,
    masked: Array,
    spec: DecoderSpec,
    first_step: Array,
    axis_name: str | None,
) -> tuple[Array, Array]:
    """Decay, accumulate and fuse the credit matrix.

    credit: [batch, block, vocab_local] fp32 (zero at block start). Each step after the
    first multiplies it by β; each masked position adds p1^γ at its top-1 token. Returns
    (new credit, fused logits z + α·log(1 + C)).
    """
    credit = jnp.where(first_step, credit, credit * spec.credit_beta)
    top_token, top_logit, normaliser = _top_and_logsumexp(logits, logits, axis_name)
    p1 = jnp.exp(top_logit - normaliser)
    local = top_token - _vocab_offset(logits.shape[-1], axis_name)
    hit = (jnp.arange(logits.shape[-1]) == local[..., None]) & masked[..., None]
    credit = credit + jnp.where(hit, (p1**spec.credit_gamma)[..., None], 0.0)
    return credit, logits + spec.credit_alpha * jnp.log1p(credit)


def decide(
    spec: DecoderSpec,
    confidence: Array,
    masked: Array,
    *,
    threshold: Array,
    k: Array | None = None,
    keys: Array | None = None,
) -> Array:
    """The commit mask [batch, block] of the configured rule.

    threshold: τ of each row this step, [batch, 1] (annealed under iteration smoothing;
    τ_high of `hierarchy`); k: tokens per row this step (fixed decoders); keys: [batch]
    PRNG keys of the `random` decoder.
    """
    if spec.name == "low_confidence":
        return commit_top_k(confidence, masked, k)
    if spec.name == "random":
        score = jax.vmap(lambda key: jax.random.uniform(key, confidence.shape[1:]))(keys)
        return commit_top_k(score, masked, k)
    if spec.name in ("threshold", "credit"):
        return commit_threshold(confidence, masked, threshold)
    if spec.name == "factor":
        return commit_factor(confidence, masked, spec.factor)
    if spec.name == "hierarchy":
        return commit_hierarchy(confidence, masked, threshold, spec.low_threshold)
    raise ValueError(f"decoder={spec.name!r}; expected one of {DECODERS}")
