"""Decoding strategies: which masked positions of the current block to commit this step.

Every function works on a whole batch at once (`[batch, block]` arrays) and inside the
compiled loop. Logits may be split over the vocabulary across the mesh axis `axis_name`;
the (token, confidence) reduction then combines per-device maxima and sums with
`pmax`/`psum` instead of gathering full logits, and stays exact.

Semantics: confidence is softmax(clean logits)[token]; the
prediction is argmax at temperature 0, a Gumbel-max sample of softmax(logits / T) above;
the mask id is never predicted, so it is never committed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from djax.generation import DECODERS, FIXED_DECODERS

Array = jax.Array
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The decoder and its static parameters (part of the compiled program's key).

    low_threshold: τ_low of `hierarchy`; factor: f of `factor`; credit_*: α, γ, β of
    `credit`. The threshold (τ of `threshold` and `credit`, τ_high of `hierarchy`) and the
    temperature are per-row values of the program (`djax.diffusion.Rows`), so rows of one
    batch may differ in them.
    """

    name: str = "threshold"
    low_threshold: float = 0.4
    factor: float = 1.0
    credit_alpha: float = 0.7
    credit_gamma: float = 0.2
    credit_beta: float = 0.8

    @property
    def fixed_steps(self) -> bool:
        return self.name in FIXED_DECODERS


# ---------------------------------------------------------------- vocabulary reductions


def _vocab_offset(local_vocab: int, axis_name: str | None) -> Array | int:
    return 0 if axis_name is None else jax.lax.axis_index(axis_name) * local_vocab


def _vocab_pass(choosable: Array, logits: Array) -> tuple[Array, ...]:
    """One pass over this device's part of the vocabulary (the last axis of both).

    Returns, each [...]: the max of `choosable`, its first index, `logits` at that index,
    and the max of `logits` with the sum of exp(logits - that max). One variadic reduction
    in place of three over fp32 logits of [batch, block, vocab] (a LLaDA-8B block's are
    16 MB): XLA ran the arg-max, the max and the sum of exps as three reductions of two
    kernels each, 18 µs per forward on an H200 (`profile_…_20261123_182352`).
    """
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)

    def combine(a: tuple[Array, ...], b: tuple[Array, ...]) -> tuple[Array, ...]:
        best_a, arg_a, at_a, top_a, sum_a = a
        best_b, arg_b, at_b, top_b, sum_b = b
        take_b = (best_b > best_a) | ((best_b == best_a) & (arg_b < arg_a))
        top = jnp.maximum(top_a, top_b)

        def rescaled(part_top: Array, part_sum: Array) -> Array:  # empty parts stay 0
            return jnp.where(part_top == top, part_sum, part_sum * jnp.exp(part_top - top))

        return (
            jnp.where(take_b, best_b, best_a),
            jnp.where(take_b, arg_b, arg_a),
            jnp.where(take_b, at_b, at_a),
            top,
            rescaled(top_a, sum_a) + rescaled(top_b, sum_b),
        )

    operands = (choosable, index, logits, logits, jnp.ones_like(logits))
    init = (NEG_INF, jnp.iinfo(jnp.int32).max, 0.0, NEG_INF, 0.0)
    init = tuple(jnp.asarray(v, x.dtype) for v, x in zip(init, operands, strict=True))
    return jax.lax.reduce(operands, init, combine, (logits.ndim - 1,))


def _top_and_logsumexp(
    choosable: Array, logits: Array, axis_name: str | None
) -> tuple[Array, Array, Array]:
    """The first arg-max of `choosable` over the (possibly split) vocabulary as a global
    token id, `logits` at it, and logsumexp(logits); each [...]."""
    best, arg, at, top, total = _vocab_pass(choosable, logits)
    if axis_name is None:
        return arg, at, top + jnp.log(total)
    candidate = arg + _vocab_offset(logits.shape[-1], axis_name)
    is_best = best == jax.lax.pmax(best, axis_name)
    big = jnp.iinfo(jnp.int32).max
    token = jax.lax.pmin(jnp.where(is_best, candidate, big), axis_name)
    at = jax.lax.psum(jnp.where(candidate == token, at, 0.0), axis_name)
    global_top = jax.lax.pmax(top, axis_name)
    total = jax.lax.psum(total * jnp.exp(top - global_top), axis_name)
    return token, at, global_top + jnp.log(total)


def _logsumexp_global(logits: Array, axis_name: str | None) -> Array:
    local_max = jnp.max(logits, axis=-1)
    global_max = local_max if axis_name is None else jax.lax.pmax(local_max, axis_name)
    total = jnp.sum(jnp.exp(logits - global_max[..., None]), axis=-1)
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
    return global_max + jnp.log(total)


def gumbel_noise(key: Array, shape: tuple[int, ...], axis_name: str | None) -> Array:
    """Gumbel noise over the *full* vocabulary, sliced to this device's part, so a split
    vocabulary samples exactly what one device would."""
    if axis_name is None:
        return jax.random.gumbel(key, shape, jnp.float32)
    n = jax.lax.axis_size(axis_name)
    full = jax.random.gumbel(key, shape[:-1] + (shape[-1] * n,), jnp.float32)
    return jax.lax.dynamic_slice_in_dim(
        full, _vocab_offset(shape[-1], axis_name), shape[-1], axis=-1
    )


def predict(
    logits: Array,
    temperature: Array | None,
    keys: Array | None,
    mask_id: int,
    axis_name: str | None = None,
) -> tuple[Array, Array]:
    """Token and confidence at each position.

    logits: [batch, block, vocab_local] fp32; temperature: [batch] fp32 (0: argmax for that
    row), or None when every row takes the argmax; keys: [batch] PRNG keys, one per row, so
    a row's sample never depends on its batch-mates. Returns token [batch, block] int32
    (never the mask id) and confidence = softmax(logits)[token] [batch, block] fp32.
    """
    local_mask = mask_id - _vocab_offset(logits.shape[-1], axis_name)
    vocab_ids = jnp.arange(logits.shape[-1])
    choosable = jnp.where(vocab_ids == local_mask, NEG_INF, logits)
    if temperature is not None:
        noise = jax.vmap(lambda key: gumbel_noise(key, logits.shape[1:], axis_name))(keys)
        t = temperature[:, None, None]
        sampled = choosable / jnp.where(t > 0, t, 1.0) + noise
        choosable = jnp.where(t > 0, sampled, choosable)
    token, logit, normaliser = _top_and_logsumexp(choosable, logits, axis_name)
    return token, jnp.exp(logit - normaliser)


def probabilities(logits: Array, axis_name: str | None = None) -> Array:
    """softmax over the (possibly split) vocabulary: [..., vocab_local]."""
    return jnp.exp(logits - _logsumexp_global(logits, axis_name)[..., None])


# ---------------------------------------------------------------- commit rules


def _rank(score: Array) -> Array:
    """0 for the highest score of each row, ties broken by lower position."""
    order = jnp.argsort(-score, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def commit_top_k(score: Array, masked: Array, k: Array) -> Array:
    """The k highest-scoring masked positions of each row. score: [batch, block]; k: [batch]."""
    ranked = _rank(jnp.where(masked, score, NEG_INF))
    return masked & (ranked < k[:, None])


def commit_threshold(confidence: Array, masked: Array, threshold: Array | float) -> Array:
    """Masked positions with confidence ≥ τ; if none, the single most confident one."""
    best = jnp.max(jnp.where(masked, confidence, NEG_INF), axis=-1, keepdims=True)
    return masked & (confidence >= jnp.minimum(threshold, best - 1e-5))


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
    return commit | commit_top_k(confidence, masked, jnp.ones(masked.shape[0], jnp.int32))


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
