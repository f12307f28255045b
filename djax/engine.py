"""`djax.generate`: prompts in, text and stats out.

Tokenises (optionally through the chat template), left-pads the batch to a bucketed prompt
length (few compiled shapes), picks the compiled program for (batch, bucket, plan), runs the
whole generation on the device, and detokenises up to the first stop token. The JAX
persistent compilation cache is on by default, so a second process does not recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from djax import program_cache, programs, prompt_io, xla_options
from djax.diffusion import Plan, Rows, row_keys, run_generation
from djax.generation import FIXED_DECODERS, GenerationConfig
from djax.model import Model
from djax.models.kernel_choice import KernelChoice
from djax.models.sparse_attention import plan_sparse

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


@dataclasses.dataclass
class GenerationStats:
    """forwards: model calls for the batch, refreshes (whole-sequence forwards, every forward
    under `cache="none"`) included; generated_tokens: over all rows, each counted up to its
    first stop token; tokens_per_forward = generated_tokens / forwards; seconds: wall time of
    the device program (compile excluded); compile_seconds: 0 when the program was cached."""

    forwards: int
    refreshes: int
    blocks: int
    generated_tokens: int
    tokens_per_forward: float
    seconds: float
    tokens_per_second: float
    compile_seconds: float


@dataclasses.dataclass
class GenerationOutput:
    """token_ids/texts: each row's answer up to (not including) its first stop token;
    answer_ids: the whole answer region [batch, gen_length]; notes: adjustments made to the
    request (e.g. gen_length rounded up)."""

    token_ids: list[list[int]]
    texts: list[str] | None
    answer_ids: np.ndarray
    stats: GenerationStats
    notes: list[str]


def enable_compile_cache(directory: str | None = None) -> None:
    """Turn on JAX's persistent compilation cache (default ~/.cache/djax/xla, or
    $DJAX_COMPILE_CACHE; set it to an empty string to turn the cache off). A local folder
    djax creates is private to the user (0700); XLA's executables in it are kept under
    `program_cache.max_bytes()`, the least recently used evicted first."""
    directory = directory or os.environ.get(
        "DJAX_COMPILE_CACHE", str(Path.home() / ".cache" / "djax" / "xla")
    )
    if not directory or jax.config.jax_compilation_cache_dir:
        return
    limit = program_cache.max_bytes()
    if "://" not in directory:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as err:
            warnings.warn(
                f"compile cache {directory}: {err}; compiling without a cache", stacklevel=3
            )
            return
    # The folder last: JAX sets its cache up at the first compile after it is named, reading
    # the size then (a thread compiling in between would get an unbounded cache).
    jax.config.update("jax_compilation_cache_max_size", limit)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_dir", directory)


def prompt_bucket(length: int, limit: int) -> int:
    """The compiled prompt length for a prompt of `length` tokens (≤ limit)."""
    bucket = next((b for b in PROMPT_BUCKETS if b >= length), 256 * math.ceil(length / 256))
    return min(bucket, limit) if bucket > length else length


class PromptError(ValueError):
    """A prompt that cannot be generated for: `index`, its place in the prompts given;
    `detail`, what is wrong with it (the message is `prompt {index} {detail}`), so a caller
    holding its own names for the prompts (`djax generate`'s record ids) can say which."""

    def __init__(self, index: int, detail: str):
        super().__init__(f"prompt {index} {detail}")
        self.index, self.detail = index, detail


def is_conversation(prompt: Any) -> bool:
    """Whether `prompt` is a chat conversation: a non-empty list of `{"role": ...,
    "content": ...}` messages (what the chat template takes)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    )


def tokenize(model: Model, prompts: Sequence[Any], chat: bool) -> list[list[int]]:
    """Each prompt's token ids: strings tokenised (through the chat template as one user
    message when `chat`), conversations (`is_conversation`) through the chat template
    always, token-id lists taken as they are."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a list of strings or a list of token-id lists; "
            f"got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is empty; expected at least one prompt")
    rows = []
    for i, prompt in enumerate(prompts):
        conversation = is_conversation(prompt)
        if isinstance(prompt, str) and not prompt:  # a chat template would wrap it in tokens
            raise PromptError(i, "is an empty string; expected text")
        if isinstance(prompt, str) or conversation:
            if model.tokenizer is None:
                raise ValueError(
                    f"{model.path}: has no tokenizer; pass token-id lists instead of strings"
                )
            if chat or conversation:
                messages = (
                    [_chat_turn(i, j, m) for j, m in enumerate(prompt)]
                    if conversation
                    else [{"role": "user", "content": prompt}]
                )
                try:
                    text = model.tokenizer.apply_chat_template(
                        list(messages), add_generation_prompt=True, tokenize=False
                    )
                except Exception as err:  # the model's own template code: any error it raises
                    detail = f"{type(err).__name__}: {err}"
                    raise PromptError(i, f"is refused by the chat template ({detail})") from None
                ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = model.tokenizer(prompt)["input_ids"]
        else:
            listed = isinstance(prompt, list | tuple) or (
                isinstance(prompt, np.ndarray) and prompt.ndim == 1
            )
            if not listed or not all(_is_token_id(t) for t in prompt):
                raise TypeError(
                    f"prompt {i} is {prompt!r:.60}; expected a string, a list of token ids "
                    '(ints) or a list of {"role", "content"} messages (one prompt\'s ids go '
                    "in a list of their own: prompts=[[id, ...]])"
                )
            if chat:
                raise PromptError(i, "is token ids; chat=True takes strings or messages")
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError(i, "is empty; expected at least one token")
        rows.append(list(ids))
    return rows


def _chat_turn(i: int, j: int, message: Mapping) -> dict[str, str]:
    """Message `j` of prompt `i` as the chat template takes it, as the CLI and the server
    give it: its content text (a string, or a list of text parts joined), `developer` as
    `system`; a PromptError for a role that is not a string or content that is not text."""
    role, content = message["role"], message["content"]
    text = prompt_io.turn_text(content)
    if not isinstance(role, str) or text is None:
        raise PromptError(
            i,
            f"has message {j} with role {role!r:.40} and content {content!r:.60}; expected a "
            'role string and text content (a string or a list of {"type": "text", "text"} '
            "parts)",
        )
    return prompt_io.template_turn(role, text)


def plan_stop_ids(model: Model, config: GenerationConfig) -> tuple[int, ...]:
    """The ids that end an answer (`config.stop_ids`, default the model's); a ValueError for
    one outside the vocabulary or the mask id (never an answer's token under LLaDA, and a
    block diffusion block may keep it: as a stop it would cut the answer there)."""
    cfg = model.config
    stop_ids = config.stop_ids if config.stop_ids is not None else cfg.stop_token_ids
    outside = [t for t in stop_ids if not 0 <= t < cfg.vocab_size]
    if outside:
        raise ValueError(f"stop_ids {outside} outside the model's vocabulary [0, {cfg.vocab_size})")
    if cfg.mask_token_id in stop_ids:
        raise ValueError(
            f"stop_ids holds the mask id {cfg.mask_token_id}; expected ids an answer can end on"
        )
    return tuple(stop_ids)


def _is_token_id(value: Any) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_prompts(model: Model, rows: list[list[int]], gen_length: int) -> None:
    """A `PromptError` for the first prompt (token ids) holding the mask id or an id outside
    the vocabulary, or too long for `gen_length` answer positions in the model's longest
    sequence."""
    cfg = model.config
    for i, ids in enumerate(rows):
        if cfg.mask_token_id in ids:
            raise PromptError(
                i,
                f"contains the mask id {cfg.mask_token_id} at position "
                f"{ids.index(cfg.mask_token_id)}; masks are only for the answer",
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(i, f"has token id {bad[0]} outside [0, {cfg.vocab_size})")
        if len(ids) + gen_length > cfg.max_seq_len:
            raise PromptError(
                i,
                f"({len(ids)} tokens) + gen_length ({gen_length}) = {len(ids) + gen_length} "
                f"exceeds the model's maximum sequence length {cfg.max_seq_len}",
            )


def answer_length(config: GenerationConfig) -> int:
    """The answer positions a generation runs: `gen_length` rounded up to whole blocks."""
    return config.block_length * math.ceil(config.gen_length / config.block_length)


def make_plan(
    model: Model, config: GenerationConfig, batch: int, prompt_len: int
) -> tuple[Plan, list[str]]:
    """The static plan for a request, and notes on adjustments made to it."""
    notes = []
    block = config.block_length
    gen = answer_length(config)
    if gen != config.gen_length:
        notes.append(
            f"gen_length {config.gen_length} is not a multiple of block_length "
            f"{block}; rounded up to {gen}"
        )
    n_blocks = gen // block
    steps = config.steps or gen
    if config.decoder in FIXED_DECODERS and steps % n_blocks:
        raise ValueError(
            f"steps={steps} must be a multiple of the number of blocks "
            f"{n_blocks} (gen_length {gen} / block_length {block})"
        )
    limit = model.config.max_seq_len
    if prompt_len + gen > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + gen_length ({gen}) = "
            f"{prompt_len + gen} exceeds the model's maximum sequence length "
            f"{limit}"
        )
    bucket = prompt_bucket(prompt_len, limit - gen)
    stop_ids = plan_stop_ids(model, config)
    plan = Plan(
        batch=batch,
        prompt_len=bucket,
        gen_length=gen,
        block_len=block,
        steps_per_block=max(steps // n_blocks, 1),
        decoder=config.decoder_spec(),
        cache=config.cache_policy(),
        mask_id=model.config.mask_token_id,
        fill_id=model.config.eos_token_id,
        stop_ids=stop_ids,
        early_stop=config.early_stop,
        smoothing=config.smoothing,
        sampling=config.temperature > 0,
        sparse=plan_sparse(config.attention_sparsity, config.attention_window, bucket + gen, block),
    )
    return plan, notes


def build_inputs(rows: list[list[int]], plan: Plan, pad_id: int) -> dict[str, np.ndarray]:
    """Left-padded tokens (prompt then masks), key validity and RoPE positions."""
    batch, seq = len(rows), plan.seq_len
    tokens = np.full((batch, seq), pad_id, np.int32)
    valid = np.zeros((batch, seq), bool)
    for i, ids in enumerate(rows):
        tokens[i, plan.prompt_len - len(ids) : plan.prompt_len] = ids
        valid[i, plan.prompt_len - len(ids) :] = True
    tokens[:, plan.prompt_len :] = plan.mask_id
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    return {"tokens": tokens, "key_valid": valid, "positions": positions}


RowProgram = Callable[..., dict[str, jax.Array]]


def kernel_choice(model: Model, plan: Plan) -> KernelChoice:
    """What the model's kernel options resolve to for a program of `plan`."""
    return model.kernel_choice(programs.plan_shapes(plan, model.mesh))


_EXECUTABLES: dict[tuple, Any] = {}


def program_args(
    model: Model, plan: Plan, rows: list[list[int]], config: GenerationConfig
) -> tuple:
    """The generation program's arguments: (params, tokens, key_valid, positions, `Rows`),
    the row arrays placed on the model's mesh when it has one. The program donates the
    tokens. Row i draws from `fold_in(key(config.seed), i)`."""
    inputs = build_inputs(rows, plan, model.config.pad_token_id)
    per_row = row_values(config, len(rows))
    placed = place(model, [inputs["tokens"], inputs["key_valid"], inputs["positions"]])
    return (model.params, *placed, place(model, per_row))


def row_values(config: GenerationConfig, batch: int) -> Rows:
    """`config`'s per-row values for `batch` rows: row i's key `fold_in(key(config.seed),
    i)`, its threshold and temperature, and its top_k and top_p where they filter (else
    none: a program without filters)."""
    filters = {}
    if config.filters_sampling:
        filters = {
            "top_k": np.full(batch, config.top_k, np.int32),
            "top_p": np.full(batch, config.top_p, np.float32),
        }
    return Rows(
        keys=row_keys(config.seed, batch),
        threshold=np.full(batch, config.threshold, np.float32),
        temperature=np.full(batch, config.temperature, np.float32),
        **filters,
    )


def place(model: Model, arrays: Any) -> Any:
    """Host row arrays (a pytree of [batch, ...] arrays) on the model's devices: split over
    the mesh's `data` axis when it has one."""
    if model.mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    from djax.sharding import place_rows

    return jax.tree.map(functools.partial(place_rows, model.mesh), arrays)


def place_replicated(model: Model, arrays: Any) -> Any:
    """Host arrays (a pytree) whole on every one of the model's devices."""
    if model.mesh is None:
        return jax.tree.map(jnp.asarray, arrays)
    from djax.sharding import place_whole

    return jax.tree.map(functools.partial(place_whole, model.mesh), arrays)


def programs_folder() -> str | None:
    """Where generation programs are saved: the persistent compilation cache's folder."""
    return jax.config.jax_compilation_cache_dir


def lower(
    model: Model,
    plan: Plan,
    args: tuple,
    run: RowProgram = run_generation,
    kernels: KernelChoice | None = None,
) -> jax.stages.Lowered:
    """The row program following `kernels` (default: `kernel_choice(model, plan)`), lowered
    for these arguments: traced and lowered here, or read back from the programs saved in
    the persistent compilation cache's folder (`program_cache`)."""
    kernels = kernels or kernel_choice(model, plan)
    description = (run.__name__, model.config, str(model.dtype), kernels, repr(model.mesh), plan)
    return program_cache.lower(
        programs.row_program(model, plan, run, kernels),
        args,
        description,
        programs_folder(),
        donate_argnums=programs.donated(run, model.mesh),
    )


def compiler_options(
    model: Model, kernels: KernelChoice, platform: str | None = None, loops: bool = True
) -> dict:
    """The XLA options a program of `model` resolved to `kernels` compiles with on
    `platform` (default: JAX's backend), with forward `loops` or not: by the path of the
    fp8 products it leaves to XLA and whether the model has expert layers
    (`xla_options.compiler_options`)."""
    platform = platform or jax.default_backend()
    experts = any(model.config.moe_layers)
    return xla_options.compiler_options(platform, kernels.xla_fp8, experts, loops)


def executable_key(model: Model, plan: Plan, args: tuple, run: RowProgram) -> tuple:
    """What identifies a compiled program in this process. Its XLA options
    (`compiler_options`) follow from the model and the kernel choice its other parts fix,
    and from what `xla_options.tables` holds, which the key holds too."""
    shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args[1:]))
    key = (run.__name__, model.config, str(model.dtype), model.weights, model.k_major)
    key += (model.options, id(model.mesh), plan, program_cache.config_values())
    return key + (shapes, xla_options.tables(jax.default_backend()))


def executable(
    model: Model, plan: Plan, args: tuple, run: RowProgram = run_generation
) -> tuple[Any, float]:
    """The compiled program for these arguments' shapes, and the seconds spent compiling it
    now (0 when this process compiled it before; from the persistent cache it is small).

    Where kernels that `auto` chose fail to lower or compile (on a GPU they were not built
    for), the program is compiled again with XLA's paths in their place
    (`KernelOptions.auto_as_xla`), and a warning names the error."""
    key = executable_key(model, plan, args, run)
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    start = time.perf_counter()
    kernels = kernel_choice(model, plan)
    try:
        compiled = _compile(model, plan, args, run, kernels)
    except Exception as err:
        fallback = kernel_choice(
            dataclasses.replace(model, options=model.options.auto_as_xla()), plan
        )
        if fallback == kernels:
            raise
        warnings.warn(
            f"djax's kernels do not compile on {programs.device_of(model.mesh)} "
            f"({type(err).__name__}: {err}); running XLA's paths where the kernel options "
            "are auto",
            stacklevel=2,
        )
        compiled = _compile(model, plan, args, run, fallback)
    _EXECUTABLES[key] = compiled
    return compiled, time.perf_counter() - start


def _compile(model: Model, plan: Plan, args: tuple, run: RowProgram, kernels: KernelChoice) -> Any:
    options = compiler_options(model, kernels)
    return xla_options.compile_lowered(lower(model, plan, args, run, kernels), options)


def explain(model: Model, plan: Any) -> str:
    """The device, the kernel options and what they resolve to for a program of `plan`
    (a `Plan`, or block diffusion's `BlockPlan`), as lines of text (`djax generate
    --explain`)."""
    options = ", ".join(f"{name}={value}" for name, value in model.options.items())
    return "\n".join(
        [
            f"device: {programs.device_of(model.mesh)}",
            f"kernel options: {options}",
            plan.describe(),
            kernel_choice(model, plan).explain(),
        ]
    )


def generate(
    model: Model,
    prompts: Sequence[Any],
    config: GenerationConfig | None = None,
    *,
    chat: bool = False,
) -> GenerationOutput:
    """Generate an answer for each prompt.

    prompts: strings (tokenised; `chat=True` applies the tokenizer's chat template),
    conversations (lists of `{"role", "content"}` messages, always through the chat
    template; content a string or a list of text parts, `developer` given as `system`) or
    lists of token ids. Rows of different lengths are left-padded, padding keys masked.
    """
    config = config or GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise TypeError(
            f"config is a {type(config).__name__}; expected a djax.GenerationConfig "
            "(GenerationConfig(**fields) from a dict)"
        )
    if model.config.block_diffusion:  # LLaDA2: block by block, block-causal
        from djax import block_diffusion

        return block_diffusion.generate(model, prompts, config, chat=chat)
    enable_compile_cache()
    rows, plan, notes = plan_prompts(model, prompts, config, chat)
    args = program_args(model, plan, rows, config)
    program, compile_seconds = executable(model, plan, args)
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    seconds = time.perf_counter() - start
    return _output(model, plan, out, seconds, compile_seconds, notes)


def plan_prompts(
    model: Model, prompts: Sequence[Any], config: GenerationConfig, chat: bool = False
) -> tuple[list[list[int]], Any, list[str]]:
    """The prompts as token rows (`tokenize`), checked against the model's length, and the
    plan `generate` runs them with (a `Plan`, or block diffusion's `BlockPlan` for its
    families) with its notes; `djax generate --explain` plans through it too."""
    rows = tokenize(model, prompts, chat)
    if model.config.block_diffusion:
        from djax import block_diffusion

        check_prompts(model, rows, config.gen_length)
        plan, notes = block_diffusion.make_plan(model, config, rows)
    else:
        check_prompts(model, rows, answer_length(config))
        plan, notes = make_plan(model, config, len(rows), max(len(r) for r in rows))
    return rows, plan, notes


def stalled_rows(answers: np.ndarray, mask_id: int, vocab_size: int) -> dict[int, int]:
    """Rows whose answer still holds mask ids or ids outside the vocabulary after the
    generation, each with how many: what a denoising step leaves when its logits are not
    finite (the threshold rules never commit a NaN confidence, and a position another rule
    commits gets the mask id back: an arg-max over NaNs names no token).
    answers: [batch, gen_length] int. Returns {row: bad positions}, empty when all is well."""
    bad = (answers == mask_id) | (answers < 0) | (answers >= vocab_size)
    return {int(row): int(n) for row, n in enumerate(bad.sum(axis=1)) if n}


def _output(
    model: Model, plan: Plan, out: dict, seconds: float, compile_seconds: float, notes: list[str]
) -> GenerationOutput:
    answers = np.asarray(out["tokens"])[:, plan.prompt_len :]
    stalled = stalled_rows(answers, plan.mask_id, model.config.vocab_size)
    if stalled:
        raise RuntimeError(
            f"generation stalled: rows {stalled} (row: positions) still hold mask or "
            f"out-of-vocabulary ids after {plan.block_len} denoising steps per block; every "
            "decoder commits at least one position per step unless the model's logits are "
            "not finite (check the weights and dtype for NaN/inf)"
        )
    return generation_output(model, answers, plan.stop_ids, out, seconds, compile_seconds, notes)


def answer_lengths(answers: np.ndarray, stop_ids: Sequence[int]) -> np.ndarray:
    """Each row's answer length [batch]: the positions of `answers` [batch, gen] before its
    first stop id (all of them where it has none)."""
    stops = np.isin(answers, stop_ids)
    return np.where(stops.any(axis=1), stops.argmax(axis=1), answers.shape[1])


def generation_output(
    model: Model,
    answers: np.ndarray,
    stop_ids: Sequence[int],
    out: dict,
    seconds: float,
    compile_seconds: float,
    notes: list[str],
) -> GenerationOutput:
    """A finished generation as `generate` returns it: each row's answer [batch, gen] cut
    before its first stop id, decoded when the model has a tokenizer, and the counters of
    the program's `out` (forwards, refreshes, blocks: the most of any shard)."""
    lengths = answer_lengths(answers, stop_ids)
    token_ids = [answers[i, :n].tolist() for i, n in enumerate(lengths)]
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(ids, skip_special_tokens=True) for ids in token_ids]
    forwards = int(np.max(out["forwards"]))
    generated = int(lengths.sum())
    stats = GenerationStats(
        forwards=forwards,
        refreshes=int(np.max(out["refreshes"])),
        blocks=int(np.max(out["blocks"])),
        generated_tokens=generated,
        tokens_per_forward=generated / max(forwards, 1),
        seconds=seconds,
        tokens_per_second=generated / seconds if seconds > 0 else 0.0,
        compile_seconds=compile_seconds,
    )
    return GenerationOutput(token_ids, texts, answers, stats, notes)
