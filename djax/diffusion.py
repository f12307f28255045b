"""The diffusion iteration manager: a whole generation as one device program.

Outer `lax.while_loop` over blocks (stops when every row has hit a stop token), inner
`lax.while_loop` over denoising steps (stops when the block has no masks, or after
`block_len` steps: every decoder commits at least one masked position of a row per step, so
only non-finite logits reach that bound, and the masks left behind are the caller's error to
raise, `engine.stalled_rows`). A block's first
step is a refresh (a whole-sequence forward that also fills the K/V buffers); later steps
are cached window forwards per the `CachePolicy`, or whole-sequence forwards under `none`.
The carry holds the tokens, the K/V buffers, the RNG key, counters and decoder state, so
nothing waits on the host between steps.

`run_block_call` is the serving engine's program: one block for every row, each row laid
out with its current block at the front (`djax.serving.layout`), so rows of different
requests at different blocks share one call.

Both are written for one device's share: inside `shard_map` they see their rows (data
axis) and their weight shards (model axis, `axis_name`). Randomness is per row (`Rows`), so
a row's tokens never depend on its batch-mates.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from djax import decoders
from djax.decoders import DecoderSpec
from djax.kv_cache import CachePolicy, init_buffers
from djax.models import sparse_attention
from djax.models.layers import TransformerLM, Window
from djax.models.sparse_attention import KeptKV, SparseAttention

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one compiled generation program.

    prompt_len: the (bucketed, left-padded) prompt length P; the answer region is
    `[P, P + gen_length)`, split into blocks of `block_len`. steps_per_block: used by the
    fixed-steps decoders. stop_ids: ids that end a row (early stop); fill_id: what the rest
    of a stopped row becomes (EOS). sampling: some row may have a temperature above 0 (the
    Gumbel noise is drawn only then). sparse: the reuse steps' sparse attention
    (`djax.models.sparse_attention`: each refresh chooses every head's keys and gathers
    those outside the cached window once; the block's cached steps attend to those only),
    None for dense attention.
    """

    batch: int
    prompt_len: int
    gen_length: int
    block_len: int
    steps_per_block: int
    decoder: DecoderSpec
    cache: CachePolicy
    mask_id: int
    fill_id: int
    stop_ids: tuple[int, ...]
    early_stop: bool = True
    smoothing: bool = False
    sampling: bool = False
    sparse: SparseAttention | None = None

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_length

    @property
    def n_blocks(self) -> int:
        return self.gen_length // self.block_len

    def describe(self) -> str:
        """The program's shape in one line (`djax generate --explain`)."""
        sparse = (
            f", sparse attention: at most {self.sparse.keys} of {self.seq_len} keys per head"
            if self.sparse
            else ""
        )
        return (
            f"batch {self.batch}, prompt {self.prompt_len}, gen {self.gen_length}, "
            f"block {self.block_len}, cache {self.cache.name}{sparse}"
        )

    @property
    def forward_window(self) -> int:
        """The positions a cached forward feeds: the cache policy's window (the whole
        sequence without a cache: every forward is then a refresh)."""
        if not self.cache.cached:
            return self.seq_len
        return self.cache.window_length(self.prompt_len, self.block_len, self.seq_len)


class Rows(NamedTuple):
    """Per-row values of a program. keys: [batch, 2] uint32 PRNG key data, one stream per
    row; threshold: [batch] fp32 τ (τ_high of `hierarchy`); temperature: [batch] fp32, 0 for
    the argmax; block_steps: [batch] int32, each row's steps a block where the server sets
    them (block diffusion's fixed-steps decoders), else None; top_k [batch] int32 and top_p
    [batch] fp32: each row's limits on its sampled tokens (`decoders.Filters`; 0 and 1: none),
    or both None for a program that samples unfiltered."""

    keys: Array
    threshold: Array
    temperature: Array
    block_steps: Any = None
    top_k: Any = None
    top_p: Any = None

    def filters(self, sampling: bool) -> decoders.Filters | None:
        """The rows' `decoders.Filters` in a program that samples (`Plan.sampling`), else None."""
        if not sampling or self.top_k is None:
            return None
        return decoders.Filters(self.top_k, self.top_p)


class Slots(NamedTuple):
    """Where each row of a block call stands in the `Carried` table. index: [batch] int32,
    the row's slot (≥ the table's size for an empty row); carry_at: [batch] int32, the
    column of the row's tokens where its slot's block goes, or -1 when the row's last
    block and keys come from the host instead."""

    index: Array
    carry_at: Array


class Carried(NamedTuple):
    """What the block calls leave on the device for the next one, by slot: each slot's
    last block [slots, block_len] int32 and its keys after it [slots, 2] uint32. A block
    call that follows another before the host has read it takes its continuing rows' last
    blocks and keys from here (`carry_in`), so the host never waits between calls."""

    blocks: Array
    keys: Array


# Saved programs (`djax.program_cache`) take `Rows` (and block calls `Slots` and
# `Carried`) as arguments.
for _kind in (Rows, Slots, Carried):
    jax.export.register_namedtuple_serialization(
        _kind, serialized_name=f"djax.diffusion.{_kind.__name__}"
    )


def carry_in(tokens: Array, rows: Rows, slots: Slots, carried: Carried) -> tuple[Array, Rows]:
    """The call's tokens with each carried row's last block written at `carry_at`, and its
    rows with those rows' keys taken from the table."""
    batch, seq = tokens.shape
    n_slots, block_len = carried.blocks.shape
    carried_row = slots.carry_at >= 0
    index = jnp.minimum(slots.index, n_slots - 1)
    columns = slots.carry_at[:, None] + jnp.arange(block_len, dtype=jnp.int32)
    columns = jnp.where(carried_row[:, None], columns, seq)  # out of range: not written
    tokens = tokens.at[jnp.arange(batch)[:, None], columns].set(carried.blocks[index], mode="drop")
    keys = jnp.where(carried_row[:, None], carried.keys[index], rows.keys)
    return tokens, rows._replace(keys=keys)


def carry_out(carried: Carried, slots: Slots, block: Array, keys: Array) -> Carried:
    """The table with this call's blocks [batch, block_len] and keys [batch, 2] in their
    rows' slots (empty rows write nothing)."""
    return Carried(
        carried.blocks.at[slots.index].set(block, mode="drop"),
        carried.keys.at[slots.index].set(keys, mode="drop"),
    )


def block_call(run: Any) -> Any:
    """Mark a row program as a block call: `programs.row_program` runs it `chained`."""
    run.is_block_call = True
    return run


def chained(block_call: Any) -> Any:
    """A block-call program `(params, tokens, key_valid, positions, rows) -> outputs` as
    one that also takes the rows' `Slots` and the `Carried` table, carries the continuing
    rows in first, and returns the updated table as `carried`."""

    def call(params, tokens, key_valid, positions, rows, slots, carried):
        tokens, rows = carry_in(tokens, rows, slots, carried)
        out = block_call(params, tokens, key_valid, positions, rows)
        return {**out, "carried": carry_out(carried, slots, out["block"], out["keys"])}

    return call


def row_keys(seed: int, rows: int) -> np.ndarray:
    """Key data [rows, 2] uint32 for rows 0..rows-1 of a batch seeded with `seed` (in
    [0, 2**32)): row i's stream is `fold_in(key(seed), i)`, a function of the seed and its
    index alone. Drawn on the host's CPU device, so it never waits behind a program running
    on an accelerator, by one compiled program per row count (the server draws a row's
    keys on the API's thread for every request it takes)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(_row_keys(np.uint32(seed), rows))


@functools.partial(jax.jit, static_argnums=1)
def _row_keys(seed: Array, rows: int) -> Array:
    fold = jax.vmap(functools.partial(jax.random.fold_in, jax.random.key(seed)))
    return jax.random.key_data(fold(jnp.arange(rows, dtype=jnp.uint32)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    """The loop carry. keys: [batch] PRNG keys; kv: per-layer (keys, values) or None
    (`none` policy); credit:
    [batch, block, vocab_local] or None; soft: expected embeddings of the block's masked
    positions from the previous step [batch, block, model] or None; row_steps: under
    iteration smoothing, the steps each row has taken as it would alone [batch] int32 (every
    block's first step, then the steps its block held masks), which set its smoothing weight
    and annealed threshold, else None; kept: per layer, the
    keys its kv heads attend to in the block's cached steps (`KeptKV`: the last refresh's
    choice, its rows outside the cached window gathered, the window's rows in its last
    slots, rewritten by each cached step), or None (dense attention). Under sparse
    attention a cached step writes its window's K/V there, and `kv` holds the last
    refresh's."""

    tokens: Array
    kv: Any
    keys: Array
    step: Array
    step_in_block: Array
    block: Array
    forwards: Array
    refreshes: Array
    stopped: Array
    block_masks: Array
    credit: Any
    soft: Any
    row_steps: Any
    kept: tuple[KeptKV, ...] | None = None


class _Generation:
    """Closes over the module, params and static plan; its methods build the loop bodies."""

    def __init__(
        self,
        module: TransformerLM,
        params: dict,
        plan: Plan,
        key_valid: Array,
        positions: Array,
        rows: Rows,
        axis_name: str | None,
    ):
        self.module, self.params, self.plan = module, params, plan
        self.key_valid, self.positions, self.axis_name = key_valid, positions, axis_name
        self.threshold = rows.threshold[:, None]
        self.temperature = rows.temperature if plan.sampling else None
        self.filters = rows.filters(plan.sampling)
        self.vocab_local = params["lm_head"].shape[1]
        self.chunk = plan.decoder.chunk_for(self.vocab_local, plan.smoothing)
        decoders.check_filters(self.filters, self.chunk)

    def _apply(self, *args, **kwargs):
        return self.module.apply({"params": self.params}, *args, **kwargs)

    def block_start(self, state: State) -> Array:
        return self.plan.prompt_len + state.block * self.plan.block_len

    def block_tokens(self, tokens: Array, block_start: Array) -> Array:
        return jax.lax.dynamic_slice_in_dim(tokens, block_start, self.plan.block_len, axis=1)

    def _inputs(self, state: State, start: Array, width: int, block_start: Array) -> Array:
        """Embeddings of `width` positions from `start`, smoothed at the block's masks."""
        ids = jax.lax.dynamic_slice_in_dim(state.tokens, start, width, axis=1)
        x = self._apply(ids, method="embed")
        if not self.plan.smoothing:
            return x
        offset = block_start - start
        weight = jnp.minimum(0.15 + 0.02 * state.row_steps, 0.3).astype(x.dtype)[:, None, None]
        block_x = jax.lax.dynamic_slice_in_dim(x, offset, self.plan.block_len, axis=1)
        masked = self.block_tokens(state.tokens, block_start) == self.plan.mask_id
        block_x = jnp.where(masked[..., None], block_x + weight * state.soft, block_x)
        return jax.lax.dynamic_update_slice_in_dim(x, block_x, offset, axis=1)

    def step(self, state: State, refresh: bool) -> State:
        """One denoising step: a forward (refresh or cached window) and a decode."""
        plan = self.plan
        bs = self.block_start(state)
        if refresh:
            with jax.named_scope("refresh"):
                x = self._inputs(state, 0, plan.seq_len, bs)
                out = self._apply(
                    x,
                    self.positions,
                    self.key_valid,
                    None,
                    Window(),
                    bs,
                    plan.block_len,
                    sparse=plan.sparse,
                )
            hidden, kv = out[:2]
            kv = kv if plan.cache.cached else None
            if plan.sparse is not None:
                state = dataclasses.replace(state, kept=self.gather_kept(out[2], kv, bs))
        else:
            window = plan.cache.window(bs, plan.prompt_len, plan.block_len, plan.seq_len)
            width = plan.cache.window_length(plan.prompt_len, plan.block_len, plan.seq_len)
            with jax.named_scope("block_forward"):
                x = self._inputs(state, window.start, width, bs)
                pos = jax.lax.dynamic_slice_in_dim(self.positions, window.start, width, axis=1)
                out = self._apply(
                    x,
                    pos,
                    self.key_valid,
                    state.kv,
                    window,
                    bs - window.start,
                    plan.block_len,
                    block_forward=True,
                    kept_kv=state.kept,
                )
            hidden, kv = out[:2]
            if plan.sparse is not None:  # the window's K/V went to the kept rows' slots
                state = dataclasses.replace(state, kept=out[2])
        with jax.named_scope("decoder"):
            state = self.decode(state, hidden, bs)
        return dataclasses.replace(
            state, kv=kv, forwards=state.forwards + 1, refreshes=state.refreshes + int(refresh)
        )

    def gather_kept(self, chosen: Array, kv: Any, bs: Array) -> tuple[KeptKV, ...]:
        """Every layer's kept rows for the block's cached steps: `chosen` [n_layers, batch,
        kv_heads, keys] from the refresh, gathered from its K/V `kv` outside the window the
        cached steps of the block starting at `bs` feed."""
        plan = self.plan
        start = plan.cache.window(bs, plan.prompt_len, plan.block_len, plan.seq_len).start
        width = plan.forward_window
        return tuple(
            sparse_attention.compact(
                chosen[i], keys, values, self.key_valid, start, plan.block_len, width
            )
            for i, (keys, values) in enumerate(kv)
        )

    def predict(self, hidden: Array, keys: Array) -> tuple[Array, Array]:
        """`decoders.predict_chunked`'s token and confidence [batch, block] from the block's
        final hidden states, the logits made a vocabulary chunk at a time."""
        return decoders.predict_chunked(
            lambda start: self._apply(hidden, start, self.chunk, method="logits"),
            self.vocab_local,
            self.chunk,
            self.temperature,
            keys,
            self.plan.mask_id,
            self.axis_name,
        )

    def decode(self, state: State, hidden: Array, bs: Array) -> State:
        plan, spec = self.plan, self.plan.decoder
        block = self.block_tokens(state.tokens, bs)
        masked = block == plan.mask_id
        keys = jax.vmap(lambda key: jax.random.split(key, 3))(state.keys)
        credit, soft = state.credit, state.soft
        if self.chunk is not None:
            token, confidence = self.predict(hidden, keys[:, 1])
        else:
            logits = self._apply(hidden, method="logits")
            decode_logits = logits
            if spec.name == "credit":
                credit, decode_logits = decoders.credit_update(
                    state.credit, logits, masked, spec, state.step_in_block == 0, self.axis_name
                )
            token, confidence = decoders.predict(
                decode_logits,
                self.temperature,
                keys[:, 1],
                plan.mask_id,
                self.axis_name,
                self.filters,
            )
            if plan.smoothing:
                soft = self._apply(
                    decoders.probabilities(logits, self.axis_name), method="embed_distribution"
                )
        threshold = self.threshold
        if plan.smoothing:
            threshold = jnp.maximum(1.0 - 0.02 * state.row_steps[:, None], threshold)
        k = None
        if spec.fixed_steps:
            k = decoders.fixed_schedule(
                state.block_masks, plan.steps_per_block, state.step_in_block
            )
        commit = decoders.decide(
            spec, confidence, masked, threshold=threshold, k=k, keys=keys[:, 2]
        )
        tokens = jax.lax.dynamic_update_slice_in_dim(
            state.tokens, jnp.where(commit, token, block), bs, axis=1
        )
        # A row whose block holds no mask takes no step of its own: its keys stay, as they
        # would alone, so its draws never depend on how many steps its batch-mates take.
        stepped = jnp.any(masked, axis=1)
        row_steps = state.row_steps
        if row_steps is not None:  # alone, a row takes each block's first step and those
            row_steps = row_steps + (stepped | (state.step_in_block == 0))  # with masks
        return dataclasses.replace(
            state,
            tokens=tokens,
            keys=jnp.where(stepped, keys[:, 0], state.keys),
            credit=credit,
            soft=soft,
            row_steps=row_steps,
            step=state.step + 1,
            step_in_block=state.step_in_block + 1,
        )

    def later_step(self, state: State) -> State:
        cache = self.plan.cache
        if not cache.cached:
            return self.step(state, refresh=True)
        if not cache.conditional_refresh:
            return self.step(state, refresh=False)
        return jax.lax.cond(
            cache.refresh_now(state.step_in_block, state.step),
            lambda s: self.step(s, refresh=True),
            lambda s: self.step(s, refresh=False),
            state,
        )

    def run_block(self, state: State) -> State:
        plan = self.plan
        bs = self.block_start(state)
        masked = self.block_tokens(state.tokens, bs) == plan.mask_id
        state = dataclasses.replace(
            state,
            step_in_block=jnp.zeros((), jnp.int32),
            block_masks=jnp.sum(masked, axis=1, dtype=jnp.int32),
            credit=None if state.credit is None else jnp.zeros_like(state.credit),
            soft=None if state.soft is None else jnp.zeros_like(state.soft),
        )
        state = self.step(state, refresh=True)

        def go_on(s: State) -> Array:
            masks_left = jnp.any(self.block_tokens(s.tokens, bs) == plan.mask_id)
            return masks_left & (s.step_in_block < plan.block_len)

        state = jax.lax.while_loop(go_on, self.later_step, state)
        return self.finish_block(state, bs)

    def finish_block(self, state: State, bs: Array) -> State:
        """Early stop: a row whose block holds a stop token gets EOS everywhere after it."""
        plan = self.plan
        stopped = state.stopped
        tokens = state.tokens
        if plan.early_stop:
            block = self.block_tokens(tokens, bs)
            has_stop = jnp.any(jnp.isin(block, jnp.asarray(plan.stop_ids)), axis=1)
            later = jnp.arange(plan.seq_len) >= bs + plan.block_len
            tokens = jnp.where(has_stop[:, None] & later[None, :], plan.fill_id, tokens)
            stopped = stopped | has_stop
        return dataclasses.replace(state, tokens=tokens, stopped=stopped, block=state.block + 1)


def initial_state(
    module: TransformerLM, params: dict, plan: Plan, tokens: Array, keys: Array, dtype: Any
) -> State:
    batch = tokens.shape[0]
    zero = jnp.zeros((), jnp.int32)
    kv = None
    if plan.cache.cached:
        kv = init_buffers(params, module.config.n_layers, batch, plan.seq_len, dtype)
    credit = soft = row_steps = None
    if plan.decoder.name == "credit":
        vocab_local = params["lm_head"].shape[1]
        credit = jnp.zeros((batch, plan.block_len, vocab_local), jnp.float32)
    if plan.smoothing:
        soft = jnp.zeros((batch, plan.block_len, module.config.d_model), dtype)
        row_steps = jnp.zeros((batch,), jnp.int32)
    kept = None
    if plan.sparse is not None:  # a cached policy: `kv` holds every layer's buffers
        n, width = plan.sparse.keys, plan.forward_window
        kept = tuple(sparse_attention.no_kept(buffer, n, plan.block_len, width) for buffer, _ in kv)
    return State(
        tokens=tokens,
        kv=kv,
        keys=jax.random.wrap_key_data(keys),
        step=zero,
        step_in_block=zero,
        block=zero,
        forwards=zero,
        refreshes=zero,
        stopped=jnp.zeros((batch,), bool),
        block_masks=jnp.zeros((batch,), jnp.int32),
        credit=credit,
        soft=soft,
        row_steps=row_steps,
        kept=kept,
    )


def run_generation(
    module: TransformerLM,
    params: dict,
    plan: Plan,
    tokens: Array,
    key_valid: Array,
    positions: Array,
    rows: Rows,
    axis_name: str | None = None,
) -> dict[str, Array]:
    """Denoise the answer region of `tokens` block by block.

    tokens: [batch, seq] int32 — left-padded prompts, then `gen_length` mask ids;
    key_valid: [batch, seq] bool (False on padding); positions: [batch, seq] int32 RoPE
    positions. Returns the final tokens and counters (forwards, refreshes, blocks).
    """
    gen = _Generation(module, params, plan, key_valid, positions, rows, axis_name)
    state = initial_state(module, params, plan, tokens, rows.keys, module.dtype)
    more = lambda s: (s.block < plan.n_blocks) & ~jnp.all(s.stopped)
    state = jax.lax.while_loop(more, gen.run_block, state)
    return {
        "tokens": state.tokens,
        "forwards": state.forwards,
        "refreshes": state.refreshes,
        "blocks": state.block,
    }


@block_call
def run_block_call(
    module: TransformerLM,
    params: dict,
    plan: Plan,
    tokens: Array,
    key_valid: Array,
    positions: Array,
    rows: Rows,
    axis_name: str | None = None,
) -> dict[str, Array]:
    """Denoise one block of every row: a refresh, then denoising steps until no row's block
    holds a mask.

    `plan.prompt_len` is 0 and `plan.gen_length` the sequence: each row's current block sits
    at `[0, block_len)` (all masks), followed by its context and later answer positions in
    any order (attention is bidirectional and positions are explicit), then padding. A row
    whose block holds no mask (an empty slot) commits nothing. tokens/key_valid/positions:
    [batch, seq]; rows: per-row keys, thresholds, temperatures. Returns the block's tokens
    [batch, block_len], the rows' keys after the call [batch, 2] (the next call's) and the
    call's forwards.
    """
    gen = _Generation(module, params, plan, key_valid, positions, rows, axis_name)
    state = initial_state(module, params, plan, tokens, rows.keys, module.dtype)
    state = gen.run_block(state)
    return {
        "block": state.tokens[:, : plan.block_len],
        "keys": jax.random.key_data(state.keys),
        "forwards": state.forwards,
    }
