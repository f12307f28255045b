"""`GenerationConfig`, how to generate, and the names of its decoders and cache policies.

Imports nothing heavy (no jax), so the CLI can build its options from the dataclass without
paying for jax at `--help`. Every field is checked when a config is made; the checks that
need the model (stop ids inside its vocabulary) are `djax.engine.make_plan`'s.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

FIXED_DECODERS = ("low_confidence", "random")
DECODERS = (*FIXED_DECODERS, "threshold", "factor", "credit", "hierarchy")
THRESHOLD_DECODERS = ("threshold", "credit", "hierarchy")  # those whose commits τ sets
POLICIES = ("none", "prefix", "dual", "vicinity")
SEED_LIMIT = 2**32  # seeds are in [0, SEED_LIMIT): what `jax.random.key` takes on every backend


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to generate (frozen: hashable, part of the compiled program's key).

    gen_length: answer positions (rounded up to a multiple of block_length, reported in the
    output's notes). steps: total denoising steps of the fixed-steps decoders
    (`low_confidence`, `random`), split evenly over the blocks; default gen_length (one
    token per step). decoder: one of `DECODERS`; threshold: τ of `threshold`/`credit`, τ_high
    of `hierarchy`; low_threshold: τ_low of `hierarchy`; factor: f of `factor`; credit_*: α,
    γ, β of `credit`. cache: one of `POLICIES`; refresh_every: extra refresh every k steps
    within a block (0: never); vicinity_*: window and warm-up of `vicinity`. temperature: 0 is
    argmax (so is any below `GREEDY_BELOW`, held as 0), else finite and > 0. top_k: a sampled
    token is one of the k most likely (ties with the k-th kept; 0: any); top_p: one of the
    fewest most likely tokens whose probability, after top_k, reaches p (in (0, 1]; 1: any);
    both act on the distribution at `temperature` (above 0) and need the whole vocabulary's
    logits at once (`logits_chunk` 0). seed: in [0, 2**32). stop_ids: ids that end an answer
    (default: the model's EOS and end-of-turn). early_stop: stop a row after the block holding
    its first stop token. smoothing: iteration smoothing (soft embeddings of masked positions).
    logits_chunk: a step computes its logits this many vocabulary ids at a time, keeping only
    running statistics (`djax.decoders.predict_chunked`); 0 computes them
    whole. `credit` and smoothing always take the whole vocabulary. attention_sparsity: the
    fraction in (0, 1] of a row's own key positions (its prompt and answer, whatever its
    batch-mates) each attention head keeps, by the attention mass the block put on them at
    its refresh, for the block's cached steps (1: dense attention; below 1 it needs a cache
    policy other than `none`); attention_window: the
    positions before the block every head keeps besides (`djax.models.sparse_attention`).
    """

    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None
    decoder: str = "threshold"
    threshold: float = 0.9
    low_threshold: float = 0.4
    factor: float = 1.0
    credit_alpha: float = 0.7
    credit_gamma: float = 0.2
    credit_beta: float = 0.8
    cache: str = "dual"
    refresh_every: int = 0
    vicinity_before: int = 16
    vicinity_after: int = 16
    vicinity_warmup: int = 4
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None
    early_stop: bool = True
    smoothing: bool = False
    logits_chunk: int = 0
    attention_sparsity: float = 1.0
    attention_window: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):  # numpy scalars as the Python values they hold
            value = getattr(self, field.name)
            if isinstance(value, np.generic):
                object.__setattr__(self, field.name, value.item())
            elif isinstance(value, tuple) and any(isinstance(v, np.generic) for v in value):
                plain = tuple(v.item() if isinstance(v, np.generic) else v for v in value)
                object.__setattr__(self, field.name, plain)
        _check_options(self)
        if self.temperature < GREEDY_BELOW:  # greedy, as vLLM takes such temperatures
            object.__setattr__(self, "temperature", 0.0)

    @property
    def filters_sampling(self) -> bool:
        """Whether top_k or top_p limits the sampled tokens (`samples_filtered`)."""
        return samples_filtered(self.temperature, self.top_k, self.top_p)

    def decoder_spec(self):
        """The `djax.decoders.DecoderSpec` of this config."""
        from djax.decoders import DecoderSpec

        return DecoderSpec(
            self.decoder,
            self.low_threshold,
            self.factor,
            self.credit_alpha,
            self.credit_gamma,
            self.credit_beta,
            self.logits_chunk,
        )

    def cache_policy(self):
        """The `djax.kv_cache.CachePolicy` of this config."""
        from djax.kv_cache import CachePolicy

        return CachePolicy(
            self.cache,
            self.refresh_every,
            self.vicinity_before,
            self.vicinity_after,
            self.vicinity_warmup,
        )


# A temperature below this decodes greedily (`GenerationConfig` and the server's requests
# take it as 0): dividing logits by less overflows them, and the largest logits' tie then
# picks the lowest id instead of the most likely.
GREEDY_BELOW = 1e-5


def samples_filtered(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether a row at `temperature` with these `top_k` and `top_p` draws from a filtered
    distribution (at temperature 0 the filters change nothing)."""
    return temperature > 0 and (top_k > 0 or top_p < 1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_options(c: GenerationConfig) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    need(c.decoder in DECODERS, f"decoder={c.decoder!r}; expected one of {DECODERS}")
    need(c.cache in POLICIES, f"cache={c.cache!r}; expected one of {POLICIES}")
    need(
        _is_int(c.gen_length) and c.gen_length > 0,
        f"gen_length={c.gen_length!r}; expected a positive int",
    )
    need(
        _is_int(c.block_length) and c.block_length > 0,
        f"block_length={c.block_length!r}; expected a positive int",
    )
    need(
        c.steps is None or (_is_int(c.steps) and c.steps > 0),
        f"steps={c.steps!r}; expected a positive int or None",
    )
    for name in (
        "threshold",
        "low_threshold",
        "factor",
        "credit_alpha",
        "credit_gamma",
        "credit_beta",
    ):
        value = getattr(c, name)
        need(
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
            f"{name}={value!r}; expected a finite number",
        )
    for name in ("early_stop", "smoothing"):
        value = getattr(c, name)
        need(isinstance(value, bool), f"{name}={value!r}; expected True or False")
    for name in ("threshold", "low_threshold"):
        value = getattr(c, name)
        need(0 < value <= 1, f"{name}={value}; expected a value in (0, 1]")
    need(c.factor > 0, f"factor={c.factor}; expected > 0")
    need(
        c.credit_alpha >= 0 and c.credit_gamma > 0 and 0 < c.credit_beta <= 1,
        f"credit (alpha, gamma, beta)=({c.credit_alpha}, {c.credit_gamma}, {c.credit_beta});"
        " expected alpha ≥ 0, gamma > 0, beta in (0, 1]",
    )
    need(
        isinstance(c.temperature, int | float)
        and not isinstance(c.temperature, bool)
        and math.isfinite(c.temperature)
        and c.temperature >= 0,
        f"temperature={c.temperature!r}; expected a finite number ≥ 0",
    )
    need(_is_int(c.top_k) and c.top_k >= 0, f"top_k={c.top_k!r}; expected an int ≥ 0 (0: off)")
    need(
        isinstance(c.top_p, int | float) and not isinstance(c.top_p, bool) and 0 < c.top_p <= 1,
        f"top_p={c.top_p!r}; expected a number in (0, 1] (1: off)",
    )
    need(
        not c.filters_sampling or c.logits_chunk == 0,
        f"top_k={c.top_k}, top_p={c.top_p} need a step's whole logits; logits_chunk="
        f"{c.logits_chunk} computes them in chunks: give logits_chunk=0",
    )
    need(
        _is_int(c.seed) and 0 <= c.seed < SEED_LIMIT,
        f"seed={c.seed!r}; expected an int in [0, 2**32)",
    )
    need(
        c.stop_ids is None
        or (isinstance(c.stop_ids, tuple) and all(_is_int(t) and t >= 0 for t in c.stop_ids)),
        f"stop_ids={c.stop_ids!r}; expected a tuple of token ids (ints ≥ 0) or None",
    )
    need(
        _is_int(c.logits_chunk) and c.logits_chunk >= 0,
        f"logits_chunk={c.logits_chunk!r}; expected an int ≥ 0 (0: the whole vocabulary)",
    )
    need(
        _is_int(c.refresh_every) and c.refresh_every >= 0,
        f"refresh_every={c.refresh_every!r}; expected an int ≥ 0",
    )
    for name in ("vicinity_before", "vicinity_after", "vicinity_warmup"):
        value = getattr(c, name)
        need(_is_int(value) and value >= 0, f"{name}={value!r}; expected an int ≥ 0")
    keep = c.attention_sparsity
    need(
        isinstance(keep, int | float) and not isinstance(keep, bool) and 0 < keep <= 1,
        f"attention_sparsity={keep!r}; expected the fraction of key positions kept, in (0, 1]",
    )
    need(
        keep == 1 or c.cache != "none",
        f"attention_sparsity={keep} needs a cache policy with cached steps; cache='none' has "
        "none (every step attends densely)",
    )
    need(
        _is_int(c.attention_window) and c.attention_window >= 0,
        f"attention_window={c.attention_window!r}; expected an int ≥ 0",
    )
    for field in dataclasses.fields(c):  # the device holds them as int32 (the seed: uint32)
        value = getattr(c, field.name)
        need(
            field.name == "seed" or not _is_int(value) or value < 2**31,
            f"{field.name}={value}; expected an int below 2**31",
        )


GENERATION_FILE = "generation_config.json"


def generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The `GenerationConfig` fields a model folder's `generation_config.json` sets (the HF
    file; its other keys are ignored); {} when the folder has none. A file that is not a
    JSON object, or sets a field to an invalid value, raises `ConfigError` naming it."""
    from djax.config import ConfigError, read_json_object

    path = Path(folder) / GENERATION_FILE
    if not path.is_file():
        return {}
    stored = read_json_object(path)
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    defaults = {k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k in fields}
    try:
        GenerationConfig(**defaults)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path}: {err}") from err
    return defaults
