"""Block diffusion (LLaDA2): generation block by block under a block-causal mask, as one
device program.

Blocks are `block_length` positions aligned at each row's position 0, so the prompt's tail
shares the first generated block. Block b sees blocks ≤ b (bidirectionally inside its own),
so a finished block's K/V never change and an append-only cache is exact, like an
autoregressive cache at block granularity.

Buffer layout (`layout`): every row's first generated block starts at the same buffer
position S (a multiple of the block length); row r's prompt of L_r tokens starts at
`S - (L_r // B) * B`, after padding (invalid keys). Its whole prompt blocks, [0, S), are
prefilled once into the K/V buffers; each generated block is then denoised with only its B
tokens fed against the cache, and the next block's first step also feeds it (2B tokens,
block-causal) to write its final K/V.
Under `cache="none"` every step is a whole-sequence block-causal forward instead.

Per row: its generated blocks n_r = ceil(((L_r mod B) + gen_length) / B) (the last block may
reach past the answer; those positions are decoded and then cut, as the original does);
steps per block s_r = steps / n_r (default B), at most gen_length; step i commits k_i masked
positions, the block length split over the s_r steps with the remainder first, capped at the
masks left. Decoders: `low_confidence` (the k_i most confident), `random` (k_i at random),
`threshold` (every masked position with p > τ when there are at least k_i of them, else the
k_i most confident), `factor` and `hierarchy` (their own rules, at most B steps a block).
A prediction is the argmax over the whole vocabulary at temperature 0 (Gumbel-max sampling
above), the mask id included as in the original: committing it leaves the position masked,
and a block whose steps run out keeps its masks. A row stops after the block holding its
first stop token in the answer, or after its n_r blocks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from djax import decoders, engine
from djax.diffusion import Plan, Rows, block_call
from djax.generation import GenerationConfig
from djax.kv_cache import init_buffers
from djax.model import Model
from djax.models.layers import TransformerLM, Window

Array = jax.Array
FIXED_STEP_DECODERS = ("low_confidence", "random", "threshold")
DECODERS = (*FIXED_STEP_DECODERS, "factor", "hierarchy")
CACHES = ("dual", "none")  # the block cache (the default policy's name), or none


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Everything static about one block-diffusion program.

    prefix_len: S, the whole prompt blocks, after padding (a multiple of block_len; under
    the cache at least one block, which the first step feeds beside the first generated
    one); prefill: whether a prompt has a whole block (S is then prefilled); n_blocks:
    generated block slots after S; steps: the total steps of each row (None: block_len per
    block); cached: the append-only block cache (else whole-sequence forwards). A row's
    `Rows.block_steps`, where given, replace its share of `steps` (the server's batches).
    """

    batch: int
    prefix_len: int
    prefill: bool
    n_blocks: int
    block_len: int
    gen_length: int
    steps: int | None
    decoder: decoders.DecoderSpec
    cached: bool
    mask_id: int
    fill_id: int
    stop_ids: tuple[int, ...]
    early_stop: bool = True
    sampling: bool = False

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.n_blocks * self.block_len

    def describe(self) -> str:
        """The program's shape in one line (`djax generate --explain`)."""
        return (
            f"batch {self.batch}, prompt blocks {self.prefix_len}, gen {self.gen_length} in "
            f"{self.n_blocks} blocks of {self.block_len} (block diffusion), cache "
            f"{'dual' if self.cached else 'none'}"
        )

    @property
    def forward_window(self) -> int:
        """The positions a block forward feeds (the kernels' block shapes): a block under
        the cache, whose steps after the block's first feed it alone; the whole sequence
        without the cache. A block's first step also feeds the block before it (whose final
        K/V it writes), a block-causal forward on the whole-sequence forwards' kernels."""
        return self.block_len if self.cached else self.seq_len


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    """The loop carry: tokens [b, seq]; kv per layer or None; keys [b]; done [b] (stopped or
    past its blocks); counters."""

    tokens: Array
    kv: Any
    keys: Array
    done: Array
    block: Array
    step: Array
    forwards: Array


def generated_blocks(prompt_len: Any, gen_length: int, block_len: int) -> Any:
    """The blocks a row generates: from the one holding its prompt's end to the one holding
    its answer's last position."""
    return -(-(prompt_len % block_len + gen_length) // block_len)


def block_causal(key_valid: Array, query_start: Any, n_queries: int, block_len: int) -> Array:
    """[b, n_queries, seq]: the valid keys of each query's own block and the earlier ones
    (buffer blocks are aligned with every row's blocks), and itself: a padding query, which
    sees no valid key, then attends to something (its output is never used)."""
    key_at = jnp.arange(key_valid.shape[1])
    query_at = query_start + jnp.arange(n_queries)
    earlier = key_at[None, :] // block_len <= query_at[:, None] // block_len
    return (key_valid[:, None, :] & earlier[None]) | (key_at[None, :] == query_at[:, None])[None]


def commit_at_least(confidence: Array, masked: Array, threshold: Array, k: Array) -> Array:
    """LLaDA2's threshold rule: every masked position with confidence > τ when there are at
    least k of them, else the k most confident masked ones. threshold: [b, 1]; k: [b]."""
    high = masked & (confidence > threshold)
    enough = jnp.sum(high, axis=1) >= k
    return jnp.where(enough[:, None], high, decoders.commit_top_k(confidence, masked, k))


def predict(
    apply: Any,
    hidden: Array,
    vocab_local: int,
    chunk: int | None,
    temperature: Array | None,
    keys: Array,
    axis_name: str | None,
    filters: decoders.Filters | None = None,
) -> tuple[Array, Array]:
    """Token and confidence [b, B] from a block's final hidden states, the logits made whole
    or a vocabulary chunk at a time (`DecoderSpec.chunk_for`; `filters` need them whole).
    Mask id -1: no vocabulary entry is excluded, so the mask token may be predicted.
    `apply` runs a module method."""
    decoders.check_filters(filters, chunk)
    if chunk is None:
        logits = apply(hidden, method="logits")
        return decoders.predict(logits, temperature, keys, -1, axis_name, filters)
    return decoders.predict_chunked(
        lambda start: apply(hidden, start, chunk, method="logits"),
        vocab_local,
        chunk,
        temperature,
        keys,
        -1,
        axis_name,
    )


def choose(
    decoder: decoders.DecoderSpec,
    confidence: Array,
    masked: Array,
    threshold: Array,
    k: Array,
    keys: Array,
) -> Array:
    """[b, B]: the masked positions a step commits: `threshold` by LLaDA2's rule (at least k),
    `factor`/`hierarchy` by their own, the others k of them (k: [b], from the schedule;
    keys: [b] for `random`)."""
    if decoder.name == "threshold":
        return commit_at_least(confidence, masked, threshold, k)
    if decoder.name in ("factor", "hierarchy"):
        return decoders.decide(decoder, confidence, masked, threshold=threshold)
    return decoders.decide(decoder, confidence, masked, threshold=threshold, k=k, keys=keys)


def _select_keys(which: Array, new: Array, old: Array) -> Array:
    """[b] PRNG keys: `new` where `which`, else `old`."""
    data = jnp.where(which[:, None], jax.random.key_data(new), jax.random.key_data(old))
    return jax.random.wrap_key_data(data)


class _Blocks:
    """Closes over the module, params, plan and per-row values; builds the loop bodies."""

    def __init__(self, module, params, plan, key_valid, positions, rows, answer_start, axis):
        self.module, self.params, self.plan = module, params, plan
        self.key_valid, self.positions, self.axis_name = key_valid, positions, axis
        self.threshold = rows.threshold[:, None]
        self.temperature = rows.temperature if plan.sampling else None
        self.filters = rows.filters(plan.sampling)
        self.vocab_local = params["lm_head"].shape[1]
        self.chunk = plan.decoder.chunk_for(self.vocab_local)
        self.answer_start = answer_start
        blocks = generated_blocks(answer_start - plan.prefix_len, plan.gen_length, plan.block_len)
        self.row_blocks = blocks
        if rows.block_steps is not None:  # the server's, each row's own
            steps = rows.block_steps
        elif plan.steps is None:
            steps = jnp.full_like(blocks, plan.block_len)
        else:
            steps = plan.steps // blocks
        self.row_steps = jnp.minimum(steps, plan.gen_length)
        if plan.decoder.name in FIXED_STEP_DECODERS:
            self.step_bound = self.row_steps
        else:
            self.step_bound = jnp.full_like(blocks, plan.block_len)

    def _apply(self, *args, **kwargs):
        return self.module.apply({"params": self.params}, *args, **kwargs)

    def prefill(self, tokens: Array, kv: Any) -> Any:
        """The whole prompt blocks' K/V, [0, S), written into the buffers."""
        s = self.plan.prefix_len
        x = self._apply(tokens[:, :s], method="embed")
        mask = block_causal(self.key_valid, 0, s, self.plan.block_len)
        _, kv = self._apply(x, self.positions[:, :s], mask, kv, Window(0), 0, 1)
        return kv

    def forward(self, state: State, start: Array, with_previous: bool) -> tuple[Array, Any]:
        """The current block's final hidden states [b, B, model] and the K/V buffers. With
        the cache, only the block is fed (a block forward: the kernels' block paths), and
        `with_previous` feeds the finished block before it too, so that its final K/V are
        written by the same forward (block-causal within it: the whole-sequence paths)."""
        plan, b = self.plan, self.plan.block_len
        if not plan.cached:
            x = self._apply(state.tokens, method="embed")
            mask = block_causal(self.key_valid, 0, plan.seq_len, b)
            hidden, _ = self._apply(x, self.positions, mask, None, Window(), start, b)
            return hidden, None
        lo = start - b if with_previous else start
        width = 2 * b if with_previous else b
        x = self._apply(
            jax.lax.dynamic_slice_in_dim(state.tokens, lo, width, axis=1), method="embed"
        )
        pos = jax.lax.dynamic_slice_in_dim(self.positions, lo, width, axis=1)
        if with_previous:
            visible = block_causal(self.key_valid, lo, width, b)
            return self._apply(x, pos, visible, state.kv, Window(lo), b, b)
        visible = self.key_valid & (jnp.arange(plan.seq_len) < start + b)[None, :]
        return self._apply(x, pos, visible, state.kv, Window(start), block_forward=True)

    def live(self, state: State) -> Array:
        """[b]: rows that decode in this step."""
        return ~state.done & (state.step < self.step_bound)

    def predict(self, hidden: Array, keys: Array) -> tuple[Array, Array]:
        return predict(
            self._apply,
            hidden,
            self.vocab_local,
            self.chunk,
            self.temperature,
            keys,
            self.axis_name,
            self.filters,
        )

    def step(self, state: State, with_previous: bool = False) -> State:
        plan, b = self.plan, self.plan.block_len
        start = plan.prefix_len + state.block * b
        hidden, kv = self.forward(state, start, with_previous)
        block = jax.lax.dynamic_slice_in_dim(state.tokens, start, b, axis=1)
        # a row decodes (and its keys advance) while it is live with masks left, so its
        # tokens are those it gets alone whatever its batch-mates do
        active = self.live(state) & jnp.any(block == plan.mask_id, axis=1)
        masked = (block == plan.mask_id) & active[:, None]
        keys = jax.vmap(lambda key: jax.random.split(key, 3))(state.keys)
        token, confidence = self.predict(hidden, keys[:, 1])
        k = decoders.fixed_schedule(jnp.full_like(self.row_steps, b), self.row_steps, state.step)
        commit = choose(plan.decoder, confidence, masked, self.threshold, k, keys[:, 2])
        tokens = jax.lax.dynamic_update_slice_in_dim(
            state.tokens, jnp.where(commit, token, block), start, axis=1
        )
        return dataclasses.replace(
            state,
            tokens=tokens,
            kv=kv if plan.cached else state.kv,
            keys=_select_keys(active, keys[:, 0], state.keys),
            step=state.step + 1,
            forwards=state.forwards + 1,
        )

    def run_block(self, state: State) -> State:
        """Denoise the current block. Under the cache its first step also feeds the block
        before it (a generated block's final K/V are written so; a prompt block's are
        rewritten as they were). Every row not done has masks in the block, so that first
        step always runs."""
        plan, b = self.plan, self.plan.block_len
        start = plan.prefix_len + state.block * b
        state = dataclasses.replace(state, step=jnp.zeros((), jnp.int32))
        state = self.step(state, with_previous=plan.cached)

        def go_on(s: State) -> Array:
            block = jax.lax.dynamic_slice_in_dim(s.tokens, start, b, axis=1)
            return jnp.any(self.live(s) & jnp.any(block == plan.mask_id, axis=1))

        state = jax.lax.while_loop(go_on, self.step, state)
        return self.finish_block(state, start)

    def finish_block(self, state: State, start: Array) -> State:
        """Rows whose answer in this block holds a stop token stop (EOS after the block);
        rows past their blocks are done."""
        plan, b = self.plan, self.plan.block_len
        tokens, done = state.tokens, state.done
        if plan.early_stop:
            block = jax.lax.dynamic_slice_in_dim(tokens, start, b, axis=1)
            in_answer = (start + jnp.arange(b))[None, :] >= self.answer_start[:, None]
            stop = in_answer & jnp.isin(block, jnp.asarray(plan.stop_ids))
            has_stop = ~done & jnp.any(stop, axis=1)
            later = jnp.arange(plan.seq_len) >= start + b
            tokens = jnp.where(has_stop[:, None] & later[None, :], plan.fill_id, tokens)
            done = done | has_stop
        block = state.block + 1
        done = done | (block >= self.row_blocks)
        return dataclasses.replace(state, tokens=tokens, done=done, block=block)


def run_block_diffusion(
    module: TransformerLM,
    params: dict,
    plan: BlockPlan,
    tokens: Array,
    key_valid: Array,
    positions: Array,
    rows: Rows,
    axis_name: str | None = None,
) -> dict[str, Array]:
    """Generate every row's answer block by block (see the module docstring).

    tokens: [batch, seq] int32 in the `layout` (padding, prompt, then mask ids); key_valid:
    [batch, seq] bool (False on padding); positions: [batch, seq] int32, 0 at each row's
    first prompt token. Returns the final tokens, each row's answer [batch, gen_length] and
    the counters (forwards, refreshes: whole-sequence forwards and the prefill, blocks).
    """
    answer_start = jnp.sum(key_valid & (tokens != plan.mask_id), axis=1, dtype=jnp.int32)
    answer_start = answer_start + plan.seq_len - jnp.sum(key_valid, axis=1, dtype=jnp.int32)
    gen = _Blocks(module, params, plan, key_valid, positions, rows, answer_start, axis_name)
    kv = None
    if plan.cached:
        batch = tokens.shape[0]  # this data shard's rows
        kv = init_buffers(params, module.config.n_layers, batch, plan.seq_len, module.dtype)
        if plan.prefill:
            kv = gen.prefill(tokens, kv)
    zero = jnp.zeros((), jnp.int32)
    state = State(
        tokens=tokens,
        kv=kv,
        keys=jax.random.wrap_key_data(rows.keys),
        done=jnp.zeros(tokens.shape[:1], bool),
        block=zero,
        step=zero,
        forwards=zero,
    )
    more = lambda s: (s.block < plan.n_blocks) & ~jnp.all(s.done)
    state = jax.lax.while_loop(more, gen.run_block, state)
    at = answer_start[:, None] + jnp.arange(plan.gen_length)[None, :]
    prefills = int(plan.cached and plan.prefill)
    return {
        "tokens": state.tokens,
        "answers": jnp.take_along_axis(state.tokens, at, axis=1),
        "forwards": state.forwards + prefills,
        "refreshes": state.forwards + prefills if not plan.cached else zero + prefills,
        "blocks": state.block,
    }


@block_call
def run_causal_block_call(
    module: TransformerLM,
    params: dict,
    plan: Plan,
    tokens: Array,
    key_valid: Array,
    positions: Array,
    rows: Rows,
    axis_name: str | None = None,
) -> dict[str, Array]:
    """The serving engine's block call for block diffusion: denoise one block of every row.

    Layout (`djax.serving.layout`, block-causal rows): a row's current block at `[0, B)`
    (the prompt's tail where the block holds one, then mask ids), then every whole block
    before it (prompt and committed answer), then padding; positions are explicit, blocks
    aligned at position 0. Attention is block-causal by position: a query sees the valid
    keys of its own block and the earlier ones. The call's first forward feeds the whole row
    and writes every K/V; under the cache the block's other steps feed the block alone
    against them (exact: the earlier blocks' K/V do not depend on it), as block forwards
    (the kernels' block paths), under `none` every step is a whole-row forward. Steps follow
    `run_block_diffusion`'s rules with each row's `rows.block_steps` steps a block
    (fixed-steps decoders; the others at most `block_len`); a row whose block holds no mask
    (an empty slot) commits nothing, and a row's keys advance only on the steps it decodes.
    `plan.prompt_len` is 0 and `plan.gen_length` the sequence. Returns the block [batch, B],
    the keys after it [batch, 2] and the call's forwards.
    """
    b, seq = plan.block_len, plan.seq_len
    batch = tokens.shape[0]

    def apply(*args, **kwargs):
        return module.apply({"params": params}, *args, **kwargs)

    causal = key_valid[:, None, :] & (positions[:, None, :] // b <= positions[:, :, None] // b)
    vocab_local = params["lm_head"].shape[1]
    chunk = plan.decoder.chunk_for(vocab_local)
    temperature = rows.temperature if plan.sampling else None
    filters = rows.filters(plan.sampling)
    threshold = rows.threshold[:, None]
    steps = rows.block_steps
    bound = steps if plan.decoder.name in FIXED_STEP_DECODERS else jnp.full_like(steps, b)

    def whole_row(tokens: Array, kv: Any) -> tuple[Array, Any]:
        x = apply(tokens, method="embed")
        return apply(x, positions, causal, kv, Window(0) if kv is not None else Window(), 0, b)

    def decode(tokens: Array, hidden: Array, keys: Array, step: Array) -> tuple[Array, Array]:
        block = tokens[:, :b]
        active = (step < bound) & jnp.any(block == plan.mask_id, axis=1)
        masked = (block == plan.mask_id) & active[:, None]
        split = jax.vmap(lambda key: jax.random.split(jax.random.wrap_key_data(key), 3))(keys)
        token, confidence = predict(
            apply, hidden, vocab_local, chunk, temperature, split[:, 1], axis_name, filters
        )
        k = decoders.fixed_schedule(jnp.full_like(steps, b), steps, step)
        commit = choose(plan.decoder, confidence, masked, threshold, k, split[:, 2])
        tokens = tokens.at[:, :b].set(jnp.where(commit, token, block))
        keys = jnp.where(active[:, None], jax.random.key_data(split[:, 0]), keys)
        return tokens, keys

    def go_on(carry: tuple) -> Array:
        tokens, _, _, step, _ = carry
        return jnp.any((step < bound) & jnp.any(tokens[:, :b] == plan.mask_id, axis=1))

    def cached_step(carry: tuple) -> tuple:
        tokens, kv, keys, step, forwards = carry
        if plan.cache.cached:
            x = apply(tokens[:, :b], method="embed")
            hidden, kv = apply(x, positions[:, :b], key_valid, kv, Window(0), block_forward=True)
        else:
            hidden, _ = whole_row(tokens, None)
        tokens, keys = decode(tokens, hidden, keys, step)
        return tokens, kv, keys, step + 1, forwards + 1

    kv = None
    if plan.cache.cached:
        kv = init_buffers(params, module.config.n_layers, batch, seq, module.dtype)
    hidden, kv = whole_row(tokens, kv)
    zero = jnp.zeros((), jnp.int32)
    tokens, keys = decode(tokens, hidden, rows.keys, zero)
    carry = (tokens, kv if plan.cache.cached else None, keys, zero + 1, zero + 1)
    tokens, _, keys, _, forwards = jax.lax.while_loop(go_on, cached_step, carry)
    return {"block": tokens[:, :b], "keys": keys, "forwards": forwards}


def make_plan(
    model: Model, config: GenerationConfig, rows: list[list[int]]
) -> tuple[BlockPlan, list[str]]:
    """The static plan for a request (its options checked for block diffusion), and notes."""
    if config.decoder not in DECODERS:
        raise ValueError(
            f"decoder={config.decoder!r} is not available for block diffusion "
            f"({model.config.family}); expected one of {DECODERS}"
        )
    if config.cache not in CACHES or config.refresh_every:
        raise ValueError(
            f"cache={config.cache!r}, refresh_every={config.refresh_every}: block diffusion "
            f"takes cache='dual' (the exact append-only block cache) or 'none', and no "
            "refreshes"
        )
    if config.smoothing:
        raise ValueError("smoothing=True is not available for block diffusion")
    if config.attention_sparsity < 1:
        raise ValueError(
            f"attention_sparsity={config.attention_sparsity} is not available for block "
            "diffusion (its cached steps read an exact append-only cache); expected 1.0"
        )
    b, gen = config.block_length, config.gen_length
    lengths = [len(r) for r in rows]
    limit = model.config.max_seq_len
    if max(lengths) + gen > limit:
        raise ValueError(
            f"prompt ({max(lengths)} tokens) + gen_length ({gen}) = {max(lengths) + gen} "
            f"exceeds the model's maximum sequence length {limit}"
        )
    blocks = [generated_blocks(n, gen, b) for n in lengths]
    if config.steps is not None:
        uneven = [(i, n) for i, n in enumerate(blocks) if config.steps % n]
        if uneven:
            i, n = uneven[0]
            raise engine.PromptError(
                i,
                f"generates {n} blocks, over which steps={config.steps} (the total over each "
                "row's generated blocks) does not split evenly (a row generates "
                f"ceil((prompt_len % block_length + gen_length) / block_length) blocks: "
                f"{lengths[i]} prompt tokens here)",
            )
    prefix = max(n // b for n in lengths) * b
    prefill = prefix > 0 and config.cache != "none"
    if prefix:
        prefix = b * math.ceil(engine.prompt_bucket(prefix, max(limit - gen, prefix)) / b)
    if config.cache != "none":
        prefix = max(prefix, b)
    stop_ids = engine.plan_stop_ids(model, config)
    plan = BlockPlan(
        batch=len(rows),
        prefix_len=prefix,
        prefill=prefill,
        n_blocks=max(blocks),
        block_len=b,
        gen_length=gen,
        steps=config.steps,
        decoder=config.decoder_spec(),
        cached=config.cache != "none",
        mask_id=model.config.mask_token_id,
        fill_id=model.config.eos_token_id,
        stop_ids=stop_ids,
        early_stop=config.early_stop,
        sampling=config.temperature > 0,
    )
    return plan, []


def layout(rows: list[list[int]], plan: BlockPlan, pad_id: int) -> dict[str, np.ndarray]:
    """Tokens (padding, prompt, mask ids), key validity and positions: row r's prompt starts
    at S - (L_r // B) * B, so every row's first generated block starts at S."""
    batch, seq, b = len(rows), plan.seq_len, plan.block_len
    tokens = np.full((batch, seq), plan.mask_id, np.int32)
    valid = np.ones((batch, seq), bool)
    positions = np.zeros((batch, seq), np.int32)
    for i, ids in enumerate(rows):
        start = plan.prefix_len - len(ids) // b * b
        tokens[i, :start] = pad_id
        tokens[i, start : start + len(ids)] = ids
        valid[i, :start] = False
        positions[i, start:] = np.arange(seq - start)
    return {"tokens": tokens, "key_valid": valid, "positions": positions}


def generate(
    model: Model, prompts: Sequence[Any], config: GenerationConfig, *, chat: bool = False
) -> engine.GenerationOutput:
    """`djax.generate` for a block-diffusion family (same arguments and result)."""
    engine.enable_compile_cache()
    rows, plan, notes = engine.plan_prompts(model, prompts, config, chat)
    inputs = layout(rows, plan, model.config.pad_token_id)
    batch = len(rows)
    per_row = engine.row_values(config, batch)
    placed = engine.place(model, [inputs["tokens"], inputs["key_valid"], inputs["positions"]])
    args = (model.params, *placed, engine.place(model, per_row))
    program, compile_seconds = engine.executable(model, plan, args, run_block_diffusion)
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    seconds = time.perf_counter() - start
    return _output(model, plan, out, seconds, compile_seconds, notes)


def _output(
    model: Model, plan: BlockPlan, out: dict, seconds: float, compile_seconds: float, notes: list
) -> engine.GenerationOutput:
    answers = np.asarray(out["answers"])
    vocab = model.config.vocab_size
    broken = {i: int(n) for i, n in enumerate(((answers < 0) | (answers >= vocab)).sum(1)) if n}
    if broken:
        raise RuntimeError(
            f"generation failed: rows {broken} (row: positions) hold ids outside the "
            f"vocabulary [0, {vocab}): the model's logits are not finite (check the weights "
            "and dtype for NaN/inf)"
        )
    kept = np.arange(answers.shape[1]) < engine.answer_lengths(answers, plan.stop_ids)[:, None]
    masked = {i: int(n) for i, n in enumerate(((answers == plan.mask_id) & kept).sum(1)) if n}
    if masked:  # in the answers returned, cut at their stops
        notes = [
            *notes,
            f"rows {masked} (row: positions) kept the mask id: the model predicted the mask "
            "token there until its block's steps ran out",
        ]
    return engine.generation_output(
        model, answers, plan.stop_ids, out, seconds, compile_seconds, notes
    )
