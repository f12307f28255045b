"""Phase-multiplexed denoising: one device program that runs, in a single forward, the
refreshes of some rows and the cached steps of the others.

Diffusion decoding alternates two kinds of forward: a row's refresh (its whole sequence,
rewriting every K/V: compute-bound) and its cached steps (only its block against the cached
K/V: bound by reading the weights). Here the rows' K/V live in a `Pool` that outlives each
call, so the two kinds need not wait for each other: every call is one forward whose
products (q/k/v, output, MLP or experts) run over the refresh rows' tokens and every
stepping slot's block together, while each group attends in its own shape
(`TransformerLM.forward_groups`). A refresh row then decodes its block's first step from
its refresh, like a block call's first step (`djax.diffusion`); a stepping slot decodes its
next step, and a slot whose block is decoded keeps it (and its keys) for its row's next
refresh to carry in. The host (`djax.serving.phase`) decides which rows refresh in each
call, under a budget of refresh tokens. How each group attends is chosen once, with the
products' kernels (`PhaseKernels`).

Shapes are fixed per `PhasePlan`: the pool holds `slots` rows of `pool_len` K/V positions,
of which the first `stepping` take a cached step (the host keeps every decoding row in
them, so a call with few rows running steps few slots); the refresh rows of a call are
packed one after the other into a stream of `stream` tokens (`pack_stream`), each
attending only to its own tokens. A slot's layout is the block
calls' (`djax.serving.layout`): its block at positions `[0, block_len)` of its pool row,
its context and later answer positions after it, so a cached step writes its block's K/V
at the front of the row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from djax import decoders, programs, sharding
from djax.config import ModelConfig
from djax.decoders import DecoderSpec
from djax.models.kernel_choice import KernelChoice, Shapes
from djax.models.layers import AttentionGroup, LayerKV, TransformerLM, Window

Array = jax.Array

# Decoders whose state outlives a step beyond the block's tokens (`credit`'s matrix) are
# not served by this program.
PHASE_DECODERS = tuple(d for d in decoders.DECODERS if d != "credit")


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """Everything static about one phase program.

    slots: the pool's rows; stepping: the leading slots that take a cached step this call
    (1 to `slots`: a slot past them keeps its block, keys and step count); pool_len: K/V
    positions per slot; stream: refresh tokens this call (0: cached steps only);
    refresh_rows: the most refresh rows a stream holds.
    """

    slots: int
    stepping: int
    pool_len: int
    stream: int
    refresh_rows: int
    block_len: int
    steps_per_block: int
    decoder: DecoderSpec
    mask_id: int
    sampling: bool = False

    def __post_init__(self):
        if self.decoder.name not in PHASE_DECODERS:
            raise ValueError(
                f"decoder={self.decoder.name!r} is not available to the phase scheduler; "
                f"expected one of {PHASE_DECODERS}"
            )
        if not 1 <= self.stepping <= self.slots:
            raise ValueError(f"stepping={self.stepping}; expected 1 to slots={self.slots}")
        if self.stream and self.refresh_rows < 1:
            raise ValueError(f"refresh_rows={self.refresh_rows}; a stream needs at least 1")
        if self.pool_len <= self.block_len:
            raise ValueError(f"pool_len={self.pool_len}; expected above {self.block_len}")


class Decoding(NamedTuple):
    """Rows' decoding state, by row. block: [rows, block_len] int32, the block's tokens (no
    mask id once it is decoded); keys: [rows, 2] uint32; threshold, temperature: [rows]
    fp32; step_in_block: [rows] int32, steps the block has taken; block_masks: [rows] int32,
    its masks when it started (the fixed-steps schedule); top_k [rows] int32 and top_p
    [rows] fp32: the limits on its sampled tokens (`decoders.Filters`)."""

    block: Array
    keys: Array
    threshold: Array
    temperature: Array
    step_in_block: Array
    block_masks: Array
    top_k: Array
    top_p: Array

    def concat(self, other: Decoding) -> Decoding:
        return Decoding(
            *(jnp.concatenate([a, b], axis=0) for a, b in zip(self, other, strict=True))
        )


class Pool(NamedTuple):
    """What the phase calls keep on the device, by slot. kv: per layer (keys, values)
    [slots, pool_len, kv_heads, head_dim]; key_valid: [slots, pool_len] bool; positions:
    [slots, block_len] int32, the block's; rows: each slot's `Decoding`."""

    kv: tuple[LayerKV, ...]
    key_valid: Array
    positions: Array
    rows: Decoding


class Stream(NamedTuple):
    """A call's refresh rows, packed. tokens, positions: [stream] int32, each row's layout
    (its block first) one after the other, then padding; row: [stream] int32, the refresh
    row each token belongs to (`refresh_rows` on padding); column: [stream] int32, its
    position in its slot's pool row; start: [refresh_rows] int32, where each row begins;
    slot: [refresh_rows] int32, its slot (≥ slots: no row); carry_at: [refresh_rows] int32,
    where in the stream the row's last decoded block goes, taken with the row's keys from
    the slot `carry_from` [refresh_rows] int32 names (the one it decoded in, which the host
    may move it from: the refresh rewrites every K/V of the row) before the call's writes
    (the host may not have read them yet), or -1 (a new row: the host's tokens and keys);
    keys [refresh_rows, 2] uint32, threshold and temperature [refresh_rows] fp32, top_k
    [refresh_rows] int32 and top_p [refresh_rows] fp32."""

    tokens: Array
    positions: Array
    row: Array
    column: Array
    start: Array
    slot: Array
    carry_at: Array
    carry_from: Array
    keys: Array
    threshold: Array
    temperature: Array
    top_k: Array
    top_p: Array


class Refresh(NamedTuple):
    """One row entering a block, on the host: its layout (`layout.RowLayout.fill` of one
    row: block first, then context and later answer positions), where in it the row's last
    decoded block goes (-1: a new row; else the block and the keys come from the slot
    `carry_from`, where it decoded them) and per-row values."""

    slot: int
    tokens: np.ndarray
    positions: np.ndarray
    carry_at: int
    carry_from: int
    keys: np.ndarray
    threshold: float
    temperature: float
    top_k: int = 0
    top_p: float = 1.0


for _kind in (Decoding, Pool, Stream):
    jax.tree_util.register_pytree_node(
        _kind, lambda t: (tuple(t), None), lambda _, c, kind=_kind: kind(*c)
    )


def pool_shapes(config: ModelConfig, slots: int, pool_len: int, block_len: int, dtype: Any) -> Pool:
    """The shapes and dtypes of a pool (`jax.ShapeDtypeStruct`s) for a model of `config`:
    `slots` rows of `pool_len` K/V positions in `dtype`, blocks of `block_len`."""
    of = jax.ShapeDtypeStruct
    kv = of((slots, pool_len, config.n_kv_heads, config.head_dim), dtype)
    per_slot = lambda kind: of((slots,), kind)  # noqa: E731
    rows = Decoding(
        of((slots, block_len), np.int32),
        of((slots, 2), np.uint32),
        per_slot(np.float32),
        per_slot(np.float32),
        per_slot(np.int32),
        per_slot(np.int32),
        per_slot(np.int32),
        per_slot(np.float32),
    )
    kvs = tuple((kv, kv) for _ in range(config.n_layers))
    return Pool(kvs, of((slots, pool_len), bool), of((slots, block_len), np.int32), rows)


def empty_pool(config: ModelConfig, slots: int, pool_len: int, block_len: int, dtype: Any) -> Pool:
    """A pool of empty slots on the host (`pool_shapes`): no masks (pad tokens: nothing to
    decode), one valid key each so attention stays finite, thresholds 1."""
    shapes = pool_shapes(config, slots, pool_len, block_len, dtype)
    pool = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    pool.key_valid[:, 0] = True
    pool.rows.block[:] = config.pad_token_id
    pool.rows.threshold[:] = 1.0
    pool.rows.top_p[:] = 1.0
    return pool


def pack_stream(plan: PhasePlan, rows: list[Refresh], pad_id: int) -> Stream:
    """The call's refresh rows packed into a `Stream` of `plan.stream` tokens, on the host.
    Each row's layout must fit its pool row and the stream its rows."""
    if len(rows) > plan.refresh_rows:
        raise ValueError(f"{len(rows)} refresh rows; this stream holds {plan.refresh_rows}")
    total = sum(len(r.tokens) for r in rows)
    if total > plan.stream:
        raise ValueError(f"refresh rows of {total} tokens; this stream holds {plan.stream}")
    n, r_max = plan.stream, plan.refresh_rows
    tokens = np.full(n, pad_id, np.int32)
    positions = np.zeros(n, np.int32)
    row = np.full(n, r_max, np.int32)
    column = np.full(n, plan.pool_len, np.int32)
    start = np.zeros(r_max, np.int32)
    slot = np.full(r_max, plan.slots, np.int32)
    carry_at = np.full(r_max, -1, np.int32)
    carry_from = np.full(r_max, plan.slots, np.int32)
    keys = np.zeros((r_max, 2), np.uint32)
    threshold = np.ones(r_max, np.float32)
    temperature = np.zeros(r_max, np.float32)
    top_k = np.zeros(r_max, np.int32)
    top_p = np.ones(r_max, np.float32)
    at = 0
    for i, r in enumerate(rows):
        length = len(r.tokens)
        if length > plan.pool_len or length < plan.block_len:
            raise ValueError(
                f"a refresh row of {length} tokens; expected {plan.block_len} to "
                f"{plan.pool_len} (the pool's row)"
            )
        tokens[at : at + length] = r.tokens
        positions[at : at + length] = r.positions
        row[at : at + length] = i
        column[at : at + length] = np.arange(length)
        start[i], slot[i], keys[i] = at, r.slot, r.keys
        carry_at[i] = -1 if r.carry_at < 0 else at + r.carry_at
        carry_from[i] = r.carry_from
        threshold[i], temperature[i] = r.threshold, r.temperature
        top_k[i], top_p[i] = r.top_k, r.top_p
        at += length
    return Stream(
        tokens,
        positions,
        row,
        column,
        start,
        slot,
        carry_at,
        carry_from,
        keys,
        threshold,
        temperature,
        top_k,
        top_p,
    )


def run_phase_call(
    module: TransformerLM,
    params: dict,
    plan: PhasePlan,
    kernels: PhaseKernels,
    pool: Pool,
    stream: Stream | None,
    axis_name: str | None = None,
) -> dict[str, Any]:
    """One phase call: the stream's rows refresh into their slots and decode their block's
    first step; every other slot of the first `plan.stepping` with masks left takes a
    cached step. Returns the new `pool` and, for the host, each slot's `block` [slots,
    block_len] and `step_in_block` [slots] after the call."""
    slots, n, block = plan.slots, plan.stepping, plan.block_len
    apply = lambda *a, **k: module.apply({"params": params}, *a, **k)  # noqa: E731
    step_group = AttentionGroup(
        pool.positions[:n], pool.key_valid[:n], Window(start=0), kernels.steps
    )
    x = apply(pool.rows.block[:n], method="embed").reshape(1, n * block, -1)
    # The stepping slots' block K/V are written at the front of their pool rows, in place;
    # they attend to the pool's leading rows where they lie.
    groups, kv = (step_group,), tuple((layer,) for layer in pool.kv)
    if stream is not None:
        stream = _carry_in(stream, pool, plan)
        r_max = plan.refresh_rows
        own = (stream.row[:, None] == stream.row[None, :]) & (stream.row < r_max)[None, :]
        refresh_group = AttentionGroup(stream.positions[None], own[None], attention=kernels.stream)
        x = jnp.concatenate([apply(stream.tokens[None], method="embed"), x], axis=1)
        groups = (refresh_group, step_group)
        kv = tuple((None, layer) for layer in pool.kv)
    hidden, new_kv = apply(x, groups, kv, method="forward_groups")
    pool_kv = tuple(layer[-1] for layer in new_kv)
    if stream is not None:
        # The stream's K/V are scattered into the pool after the forward. Tied to its
        # output, the scatters follow every layer's reads of the pool, so XLA writes them in
        # place; unordered with those reads, it copied each layer's pool K/V first.
        hidden, pool_kv = jax.lax.optimization_barrier((hidden, pool_kv))
    hidden = hidden[0]
    step_hidden = hidden[-n * block :].reshape(n, block, -1)

    refreshing = jnp.zeros(slots, bool)
    rows = Decoding(*(a[:n] for a in pool.rows))
    if stream is not None:
        within = stream.start[:, None] + jnp.arange(block)  # [r_max, block]
        refresh_hidden = hidden[within]
        r_block = stream.tokens[within]
        refreshing = refreshing.at[stream.slot].set(True, mode="drop")
        r_masks = jnp.sum(r_block == plan.mask_id, axis=1, dtype=jnp.int32)
        r_zero = jnp.zeros_like(r_masks)
        rows = rows.concat(
            Decoding(
                r_block,
                stream.keys,
                stream.threshold,
                stream.temperature,
                r_zero,
                r_masks,
                stream.top_k,
                stream.top_p,
            )
        )
        step_hidden = jnp.concatenate([step_hidden, refresh_hidden], axis=0)
        pool_kv, key_valid = _write_stream(pool, pool_kv, new_kv, stream, plan)
        positions = pool.positions.at[stream.slot].set(stream.positions[within], mode="drop")
    else:
        key_valid, positions = pool.key_valid, pool.positions
    active = jnp.any(rows.block == plan.mask_id, axis=1)
    active = active.at[:n].set(active[:n] & ~refreshing[:n])
    decoded = _decode(module, params, plan, step_hidden, rows, active, axis_name)

    def merge(old: Array, new: Array) -> Array:
        """Per-slot values: the stepping slots' new rows over the pool's, then each refresh
        row's in its slot."""
        merged = old.at[:n].set(new[:n])
        if stream is not None:
            merged = merged.at[stream.slot].set(new[n:], mode="drop")
        return merged

    merged = Decoding(*(merge(old, new) for old, new in zip(pool.rows, decoded, strict=True)))
    new_pool = Pool(pool_kv, key_valid, positions, merged)
    return {"pool": new_pool, "block": merged.block, "step_in_block": merged.step_in_block}


def _carry_in(stream: Stream, pool: Pool, plan: PhasePlan) -> Stream:
    """The stream with each carried row's last block (from its `carry_from` slot, as the
    call found the pool) written at its `carry_at`, and its keys taken from that slot."""
    carried = stream.carry_at >= 0
    slot = jnp.minimum(stream.carry_from, plan.slots - 1)
    columns = stream.carry_at[:, None] + jnp.arange(plan.block_len, dtype=jnp.int32)
    columns = jnp.where(carried[:, None], columns, plan.stream)  # out of range: not written
    tokens = stream.tokens.at[columns].set(pool.rows.block[slot], mode="drop")
    keys = jnp.where(carried[:, None], pool.rows.keys[slot], stream.keys)
    return stream._replace(tokens=tokens, keys=keys)


def _write_stream(
    pool: Pool, pool_kv: tuple, new_kv: tuple, stream: Stream, plan: PhasePlan
) -> tuple[tuple, Array]:
    """The refresh rows' K/V written into their slots' pool rows (from column 0), and
    those slots' valid keys reset to their rows' tokens."""
    r_max = plan.refresh_rows
    slot_of = jnp.where(
        stream.row < r_max, stream.slot[jnp.minimum(stream.row, r_max - 1)], plan.slots
    )
    written = []
    for (keys, values), (fresh, _) in zip(pool_kv, new_kv, strict=True):
        fresh_keys, fresh_values = fresh
        keys = keys.at[slot_of, stream.column].set(fresh_keys[0].astype(keys.dtype), mode="drop")
        values = values.at[slot_of, stream.column].set(
            fresh_values[0].astype(values.dtype), mode="drop"
        )
        written.append((keys, values))
    key_valid = pool.key_valid.at[stream.slot].set(False, mode="drop")
    key_valid = key_valid.at[slot_of, stream.column].set(True, mode="drop")
    return tuple(written), key_valid


def _decode(
    module: TransformerLM,
    params: dict,
    plan: PhasePlan,
    hidden: Array,
    rows: Decoding,
    active: Array,
    axis_name: str | None,
) -> Decoding:
    """One decoding step of every active row from its block's hidden states [rows,
    block_len, model]; an inactive row keeps its block, keys and step count."""
    spec = plan.decoder
    masked = rows.block == plan.mask_id
    keys = jax.vmap(lambda key: jax.random.split(key, 3))(jax.random.wrap_key_data(rows.keys))
    temperature = rows.temperature if plan.sampling else None
    vocab_local = params["lm_head"].shape[1]
    chunk = spec.chunk_for(vocab_local)
    # the server refuses filters where the logits come in chunks
    filters = decoders.Filters(rows.top_k, rows.top_p) if plan.sampling and chunk is None else None
    logits_at = lambda start, width: module.apply(  # noqa: E731
        {"params": params}, hidden, start, width, method="logits"
    )
    if chunk is not None:
        token, confidence = decoders.predict_chunked(
            lambda start: logits_at(start, chunk),
            vocab_local,
            chunk,
            temperature,
            keys[:, 1],
            plan.mask_id,
            axis_name,
        )
    else:
        token, confidence = decoders.predict(
            logits_at(0, None), temperature, keys[:, 1], plan.mask_id, axis_name, filters
        )
    k = None
    if spec.fixed_steps:
        k = decoders.fixed_schedule(rows.block_masks, plan.steps_per_block, rows.step_in_block)
    commit = decoders.decide(
        spec, confidence, masked, threshold=rows.threshold[:, None], k=k, keys=keys[:, 2]
    )
    commit = commit & active[:, None]
    return rows._replace(
        block=jnp.where(commit, token, rows.block),
        keys=jnp.where(active[:, None], jax.random.key_data(keys[:, 0]), rows.keys),
        step_in_block=rows.step_in_block + active.astype(jnp.int32),
    )


@dataclasses.dataclass(frozen=True)
class PhaseKernels:
    """The kernel choice of a phase program, made once. products: the choice whose
    whole-sequence paths every product of the mixed forward takes (its weight format is
    the params'); steps: how the cached steps attend to the pool (`attend`'s impl); stream:
    how the refresh stream attends (each row to its own tokens: a per-query mask)."""

    products: KernelChoice
    steps: str
    stream: str

    def explain(self) -> str:
        return (
            f"{self.products.explain()}\nphase attention: steps={self.steps}, stream={self.stream}"
        )


def phase_kernels(model: Any, plan: PhasePlan) -> PhaseKernels:
    """The model's kernel options resolved for a phase program: its products as one forward
    over every row of the call (the stream's tokens and every stepping slot's block); the
    steps' attention as a block forward of `stepping` rows against the pool's positions; the
    stream's cuDNN's on a GPU in a 16-bit dtype unless `attention_impl` says `xla` (a
    per-query mask is what neither XLA's fused paths nor djax's kernel take), else XLA's."""
    rows = plan.stream + plan.stepping * plan.block_len
    products = model.kernel_choice(Shapes.whole_sequence(1, rows))
    steps = model.kernel_choice(
        Shapes(plan.stepping, plan.block_len, plan.pool_len, plan.block_len)
    )
    gpu = programs.device_of(model.mesh).platform == "gpu"
    half = jnp.dtype(model.dtype).itemsize == 2
    cudnn = gpu and half and model.options.attention_impl != "xla"
    return PhaseKernels(products, steps.block.layers.attention, "cudnn" if cudnn else "xla")


def check_mesh(mesh: Any) -> None:
    """The phase program runs on one device or on a mesh whose `data` axis has size 1 (its
    pool's rows are not split over devices)."""
    if mesh is not None and mesh.shape[sharding.DATA] != 1:
        raise ValueError(
            f"data_parallel={mesh.shape[sharding.DATA]}: the phase scheduler runs its pool "
            "on the model axis alone; expected data_parallel=1 (or the continuous scheduler)"
        )


def pool_specs(n_layers: int, mesh: Any) -> Pool:
    """`PartitionSpec`s of a pool on `mesh`: K/V split by kv head over the model axis as
    every K/V buffer is (`djax.sharding`), the rest whole on every device."""
    kv = P(None, None, sharding.model_axis(mesh), None)
    return Pool(tuple((kv, kv) for _ in range(n_layers)), P(), P(), Decoding(*(P(),) * 8))


def pool_bytes(model: Any, shapes: Pool) -> int:
    """A pool's bytes on one device once placed (`place_pool`), from its `pool_shapes`: on a
    mesh, each device's share of the K/V heads and the rest whole."""
    if model.mesh is None:
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    specs = pool_specs(len(shapes.kv), model.mesh)
    shards = jax.tree.map(
        lambda s, spec: (
            math.prod(NamedSharding(model.mesh, spec).shard_shape(s.shape)) * s.dtype.itemsize
        ),
        shapes,
        specs,
    )
    return sum(jax.tree.leaves(shards))


def place_pool(model: Any, pool: Pool) -> Pool:
    """A host pool on the model's devices (`pool_specs` on a mesh)."""
    if model.mesh is None:
        return jax.tree.map(jnp.asarray, pool)
    specs = pool_specs(len(pool.kv), model.mesh)
    return jax.tree.map(
        lambda a, spec: jax.device_put(a, NamedSharding(model.mesh, spec)),
        pool,
        specs,
        is_leaf=lambda x: isinstance(x, np.ndarray),
    )


def phase_program(model: Any, plan: PhasePlan, kernels: PhaseKernels) -> Any:
    """`run_phase_call` for `model` and `plan` following `kernels`, jitted, the pool
    donated: `(params, pool, stream) -> outputs` (`stream` None when `plan.stream` is 0).
    On a mesh it is one `shard_map`, its pool kept in `pool_specs`."""
    check_mesh(model.mesh)
    module = programs.local_module(model.config, model.dtype, kernels.products, model.mesh)
    if model.mesh is None:

        def program(params, pool, stream):
            return run_phase_call(module, params, plan, kernels, pool, stream)

        return jax.jit(program, donate_argnums=(1,))
    mesh = model.mesh
    axis = sharding.model_axis(mesh)
    products = kernels.products
    params = sharding.param_specs(
        model.config, model.dtype, mesh, products.weights, products.k_major
    )
    pool = pool_specs(model.config.n_layers, mesh)
    outputs = {"pool": pool, "block": P(), "step_in_block": P()}

    def local(params, pool, stream):
        return run_phase_call(module, params, plan, kernels, pool, stream, axis)

    program = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(params, pool, None if not plan.stream else P()),
        out_specs=outputs,
        check_vma=False,
    )
    return jax.jit(program, donate_argnums=(1,))


def place_stream(model: Any, stream: Stream) -> Stream:
    """A host stream as the phase program takes it: on one device the host arrays
    themselves (the call sends them with its arguments, cheaper than a transfer of each);
    on a mesh, whole on every device."""
    if model.mesh is None:
        return stream
    replicated = NamedSharding(model.mesh, P())
    return jax.tree.map(lambda a: jax.device_put(a, replicated), stream)
