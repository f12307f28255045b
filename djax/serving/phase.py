"""The phase-multiplexed scheduler (`--scheduler phase`): device calls of one forward
each, mixing some rows' refreshes with every other row's cached step (`djax.phase`).

Every running row owns a slot of the device `Pool`, which keeps its K/V between calls.
A row is either *decoding* (its block is on the device and takes a cached step each call)
or *pending* (just admitted, or its block has ended and it has blocks left): pending rows
refresh in the next call, first come first served, as many as the call's budget of
refresh tokens takes (a refresh row costs its sequence, and every slot's step its block:
`ServeConfig.phase_tokens` bounds the two together). A refresh decodes its block's first
step; the row then steps until its block holds no mask. A row's next refresh takes its
last block and keys from the slot it decoded them in (`phase.Stream.carry_at`,
`carry_from`), so it need not wait for the host to read them.

A new row takes the lowest free slot, a row entering a block moves to the lowest free slot
below its own (its refresh rewrites all of its K/V; its last block and keys are carried
from the slot it leaves), and a call steps only the leading slots that hold every decoding
row (the smallest of `halvings(max_batch, 1)` that does), so a call with few rows running
costs few rows' steps.

The engine queues a call before it reads the one before, so the device never waits for
the host. Under a fixed-steps decoder a block ends after a known number of calls, and
the row is pending from the next one; under the others the host learns of the end when it
reads the call, so the row steps idly once before its refresh. Every program (the
steps-only call and each stream size of `halvings`, each with each count of stepping
slots, in each served sampling variant) is compiled before the engine reports ready; the
pool (before it is allocated) and the largest call must fit the memory budget, or the
engine refuses to start, naming the sizes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from typing import Any

import jax
import numpy as np

from djax import engine as djax_engine
from djax import phase, xla_options
from djax.serving import layout, memory
from djax.serving.engine import STALL_SECONDS, ServingEngine, _mib, _Row
from djax.serving.requests import Failed

log = logging.getLogger("djax.serve")

# Refresh streams (and counts of stepping slots) compiled below the largest: the largest
# halved this many times (a call takes the smallest that holds its refresh rows, or its
# decoding slots).
HALVINGS = 2
# A stream of n tokens holds at most n / (this × block) rows (every one decodes a block,
# padding rows too), at least one.
REFRESH_ROW_BLOCKS = 8


def halvings(largest: int, unit: int, least: int = 2) -> tuple[int, ...]:
    """`largest` and its halves (`HALVINGS` of them, each rounded up to whole `unit`s and
    at least `least` of them), ascending: the refresh streams compiled (in blocks, at least
    two) and the counts of stepping slots (in slots, at least one)."""
    sizes = {largest}
    size = largest
    for _ in range(HALVINGS):
        size = max(least * unit, unit * math.ceil(size / 2 / unit))
        sizes.add(size)
    return tuple(sorted(sizes))


@dataclasses.dataclass
class _RowState:
    """A running row's blocks on the device. started: blocks refreshed so far; first: the
    call of its first refresh (None before it is taken for one); since: the call that
    refreshed its current block (None before its first); ends: the calls whose
    outputs hold a block of it that the host has not read, each with the slot the block
    decoded in, in order (a fixed-steps block's end is known when it is refreshed;
    others' are found by reading); decoding: its current block is still being decoded (as
    far as the host knows)."""

    started: int = 0
    first: int | None = None
    since: int | None = None
    ends: collections.deque = dataclasses.field(default_factory=collections.deque)
    decoding: bool = False


@dataclasses.dataclass
class _PhaseCall:
    """A queued phase call: its index, outputs and the rows it refreshed; when it was
    queued and when the host last saw it running."""

    index: int
    out: dict
    refreshed: list[_Row]
    queued: float
    seen_running: float

    @property
    def running(self) -> bool:
        return not self.out["block"].is_ready()


def refusal(model: Any, config: Any) -> str | None:
    """Why the phase scheduler cannot serve `config` on `model` (None: it can), naming the
    setting and what it needs."""
    cfg, g = model.config, config.generation
    if cfg.block_diffusion:
        return (
            f"scheduler='phase' serves bidirectional dLLMs; {cfg.family} decodes by block "
            "diffusion: use the continuous scheduler"
        )
    if g.decoder not in phase.PHASE_DECODERS:
        return (
            f"decoder={g.decoder!r} is not available to the phase scheduler; expected one of "
            f"{phase.PHASE_DECODERS}"
        )
    if g.attention_sparsity < 1:
        return (
            f"attention_sparsity={g.attention_sparsity} is not available to the phase "
            "scheduler; expected 1.0"
        )
    if g.cache != "dual":
        return f"cache={g.cache!r}; the phase scheduler keeps a dual cache"
    if g.refresh_every:
        return (
            f"refresh_every={g.refresh_every} is not available to the phase scheduler (a row "
            "refreshes once a block); expected 0"
        )
    try:
        phase.check_mesh(model.mesh)
    except ValueError as err:
        return str(err)
    return None


def pool_fits(model: Any, config: Any) -> bool:
    """Whether the phase scheduler's pool for `config` (`max_batch` slots of its longest
    sequence) fits the memory budget beside the weights (always, where the budget is not
    known)."""
    limit, _ = memory.budget_bytes(model, config.memory_fraction, config.memory_bytes)
    if limit is None:
        return True
    cfg, block = model.config, config.generation.block_length
    longest = layout.seq_buckets(config.max_seq_len or cfg.max_seq_len, block)[-1]
    shapes = phase.pool_shapes(cfg, config.max_batch, longest, block, model.dtype)
    return phase.pool_bytes(model, shapes) <= limit


class PhaseEngine(ServingEngine):
    """The engine of the `phase` scheduler (see the module docstring)."""

    def __init__(self, model, config, metrics):
        super().__init__(model, config, metrics)
        reason = refusal(model, config)
        if reason is not None:
            raise ValueError(reason)
        self.pool_len = self.seq_buckets[-1]
        slots, block = config.max_batch, self.block_length
        budget = config.phase_tokens or 2 * self.pool_len + slots * block
        largest = budget - slots * block
        if largest < self.pool_len:
            raise ValueError(
                f"phase_tokens={budget}: every call's steps take {slots * block} tokens "
                f"(max_batch {slots} × block {block}), which leaves {largest} refresh tokens, "
                f"fewer than the longest row ({self.pool_len}); expected at least "
                f"{slots * block + self.pool_len}"
            )
        self.streams = halvings(largest, block)
        self.steppings = halvings(slots, 1, least=1)
        self._pool: phase.Pool | None = None
        # by (stream, stepping slots, sampling)
        self._plans: dict[tuple[int, int, bool], phase.PhasePlan] = {}
        self._programs: dict[tuple[int, int, bool], Any] = {}
        self._pending: collections.deque[_Row] = collections.deque()  # to refresh, in order
        self._states: dict[int, _RowState] = {}  # id(row) -> where its blocks stand
        # Fixed-steps decoders finish a block in a known number of calls: its refresh's,
        # then a step a call (`djax.phase`); other decoders' ends are read from the calls.
        g = config.generation
        self._block_calls = (
            min(self.config.steps_per_block, block) if g.decoder_spec().fixed_steps else None
        )
        self._phase_calls: collections.deque[_PhaseCall] = collections.deque()
        self._next_call = 0
        self._last_read = 0.0  # when the host last finished waiting for a call

    # ------------------------------------------------------------ programs

    def _refresh_rows(self, stream: int) -> int:
        """The most refresh rows a stream of `stream` tokens holds."""
        block = self.block_length
        return max(1, min(self.config.max_batch, stream // (REFRESH_ROW_BLOCKS * block)))

    def _plan(self, stream: int, stepping: int, sampling: bool) -> phase.PhasePlan:
        g, cfg, block = self.config.generation, self.model.config, self.block_length
        return phase.PhasePlan(
            slots=self.config.max_batch,
            stepping=stepping,
            pool_len=self.pool_len,
            stream=stream,
            refresh_rows=self._refresh_rows(stream),
            block_len=block,
            steps_per_block=self.config.steps_per_block,
            decoder=g.decoder_spec(),
            mask_id=cfg.mask_token_id,
            sampling=sampling,
        )

    def _pool_size(self) -> tuple:
        """The pool's (model config, slots, positions, block length, dtype)."""
        cfg = self.model.config
        return cfg, self.config.max_batch, self.pool_len, self.block_length, self.model.dtype

    def _empty_pool(self) -> phase.Pool:
        return phase.place_pool(self.model, phase.empty_pool(*self._pool_size()))

    def _stream_arrays(self, plan: phase.PhasePlan, rows: list[_Row], sources: list[int]) -> Any:
        """The call's stream of `rows`, each carrying its last block from its `sources` slot."""
        refreshes = [self._refresh(row, source) for row, source in zip(rows, sources, strict=True)]
        return phase.place_stream(
            self.model, phase.pack_stream(plan, refreshes, self.model.config.pad_token_id)
        )

    def _refresh(self, row: _Row, carry_from: int) -> phase.Refresh:
        """A row laid out at its next block: the block first, then its context and later
        answer positions. After its first block, the last block decoded comes from its slot
        with its keys (`phase.Stream.carry_at`): the host may not have read it yet."""
        state, block = self._states[id(row)], self.block_length
        prompt = np.asarray(row.request.prompt_ids, np.int32)
        decoded = state.started * block  # answer tokens decoded before this block
        carry_at = -1
        if state.started:
            if len(row.committed) < decoded - block:  # the host reads every block but the last
                raise RuntimeError(
                    f"request {row.request.request_id}: {len(row.committed)} tokens read, "
                    f"{decoded - block} expected before its carried block"
                )
            known = np.asarray(row.committed[: decoded - block], np.int32)
            placeholder = np.full(block, self.layout.mask_id, np.int32)
            context = np.concatenate([prompt, known, placeholder])
            carry_at = len(context)  # the layout's block, then the context: its last block
        else:
            context = prompt
        later = row.answer_length - decoded - block
        arrays = self.layout.arrays(1, row.sequence)
        self.layout.fill(arrays, 0, context, later)
        return phase.Refresh(
            row.slot,
            arrays["tokens"][0],
            arrays["positions"][0],
            carry_at,
            carry_from,
            row.keys,
            row.threshold,
            row.request.temperature,
            row.request.top_k,
            row.request.top_p,
        )

    def _warm_up(self) -> None:
        """Compile every phase program (stream 0 and each stream size, each with each count
        of stepping slots, in each sampling variant; several at a time: tracing holds the
        GIL, XLA's compiler does not) and check that the pool (first, before it is
        allocated) and the largest call fit the memory budget."""
        start = time.perf_counter()
        pool_bytes = phase.pool_bytes(self.model, phase.pool_shapes(*self._pool_size()))
        if self.memory.limit is not None and pool_bytes > self.memory.limit:
            raise ValueError(  # before the pool is allocated and anything compiled
                f"the phase scheduler's pool ({self.config.max_batch} slots of "
                f"{self.pool_len} positions) takes {_mib(pool_bytes)}, more than the memory "
                f"budget of {_mib(self.memory.limit)} beside the weights "
                f"({_mib(self._weight_bytes)}); lower --max-batch or --max-seq-len, or raise "
                "--memory-fraction"
            )
        self._pool = self._empty_pool()
        shapes = [
            (stream, stepping, x)
            for x in self.memory.variants
            for stream in (0, *self.streams)
            for stepping in self.steppings
        ]

        def compile_one(shape: tuple[int, int, bool]) -> int | None:
            if self._stopping:  # stopped while warming up: compile no more
                return None
            plan = self._plan(*shape)
            kernels = phase.phase_kernels(self.model, plan)
            program = phase.phase_program(self.model, plan, kernels)
            stream = self._stream_arrays(plan, [], []) if plan.stream else None
            lowered = program.lower(self.model.params, self._pool, stream)
            # one forward, no loop: XLA's defaults, with the model's and the user's options
            options = djax_engine.compiler_options(self.model, kernels.products, loops=False)
            compiled = xla_options.compile_lowered(lowered, options)
            self.metrics.compiles.inc()
            self._plans[shape], self._programs[shape] = plan, compiled
            return memory.analysed_call_bytes(compiled, self._weight_bytes)

        workers = max(1, min(len(shapes), (os.cpu_count() or 2) // 2, 8))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            analysed = [n for n in pool.map(compile_one, shapes) if n is not None]
        if self._stopping:
            return
        largest = max(analysed, default=0)
        self._measured = True
        if self.memory.limit is not None and largest > self.memory.limit:
            raise ValueError(
                f"the phase scheduler's largest call ({_mib(largest)} with its pool of "
                f"{self.config.max_batch} slots of {self.pool_len} positions: "
                f"{_mib(pool_bytes)}) exceeds the memory budget of "
                f"{_mib(self.memory.limit)} beside the weights ({_mib(self._weight_bytes)}); "
                "lower --max-batch, --max-seq-len or --phase-tokens, or raise "
                "--memory-fraction"
            )
        self.metrics.call_bytes.set(max(largest, pool_bytes))
        log.info(
            "compiled %d phase programs (streams %s, stepping slots %s, pool %d × %d: %s) in "
            "%.1f s",
            len(self._programs),
            self.streams,
            self.steppings,
            self.config.max_batch,
            self.pool_len,
            _mib(pool_bytes),
            time.perf_counter() - start,
        )

    def _fits(self, rows: list[_Row]) -> bool:
        """Every row of the served length fits: the pool holds it (`submit` checks it)."""
        return True

    # ------------------------------------------------------------ the loop

    def _serve(self) -> None:
        """Queue a call (every slot's step and the refreshes that fit), then read the call
        before it while the device runs this one."""
        while True:
            with self._lock:
                self._admit()
                working = any(
                    state.decoding or state.started * self.block_length < row.answer_length
                    for row in self._running
                    if (state := self._states[id(row)])
                )
                if not working and not self._phase_calls:
                    if not self._wait_for_work():
                        return
                    continue
            if working:
                self._dispatch_phase()
                if len(self._phase_calls) > 1:
                    self._read_phase(self._phase_calls.popleft())
            else:
                self._read_phase(self._phase_calls.popleft())

    def _admit(self) -> None:
        """Free the slots of finished and cancelled rows, give free slots to waiting rows in
        the queue's order (`_enqueue`), and queue for refresh the rows whose block has ended
        (lock held)."""
        running = []
        for row in self._running:
            if row.cancelled or row.done:
                self._free_slots.append(row.slot)
                self._states.pop(id(row), None)
                if row in self._pending:
                    self._pending.remove(row)
            else:
                running.append(row)
        for row in self._take_waiting(self.config.max_batch - len(running)):
            row.slot = min(self._free_slots)  # the lowest: calls step the leading slots
            self._free_slots.remove(row.slot)
            running.append(row)
            self._states[id(row)] = _RowState()
            self._pending.append(row)
        self._running = running
        self.metrics.running_rows.set(len(running))
        now = self._next_call
        for row in running:
            state = self._states[id(row)]
            if state.decoding and state.ends and state.ends[-1][0] < now:
                state.decoding = False  # its block ended in a queued call
            more = state.started * self.block_length < row.answer_length
            if not state.decoding and more and state.since is not None and row not in self._pending:
                self._pending.append(row)

    def _move_down(self, row: _Row) -> int:
        """A row about to refresh moves to the lowest free slot if that is below its own,
        freeing its own; returns the slot it leaves, where its last block and keys stay for
        the refresh to carry (lock held)."""
        source = row.slot
        lowest = min(self._free_slots, default=source)
        if lowest < source:
            self._free_slots.remove(lowest)
            self._free_slots.append(source)
            row.slot = lowest
        return source

    def _stepping_slots(self, slots: list[int]) -> int:
        """The leading slots a call steps: the fewest of `steppings` that hold `slots`, the
        decoding rows' (the smallest where none decodes)."""
        return next(n for n in self.steppings if n > max(slots, default=0))

    def _take_refreshes(self) -> tuple[int, list[_Row]]:
        """The pending rows this call refreshes, first come first served while they fit the
        largest stream and its rows, and the smallest stream that holds them (0: none)."""
        rows, tokens = [], 0
        while self._pending and len(rows) < self._refresh_rows(self.streams[-1]):
            row = self._pending[0]
            if tokens + row.sequence > self.streams[-1]:
                break
            rows.append(self._pending.popleft())
            tokens += row.sequence
        if not rows:
            return 0, []
        stream = next(s for s in self.streams if s >= tokens)
        if len(rows) > self._refresh_rows(stream):
            stream = self.streams[-1]
        return stream, rows

    def _dispatch_phase(self) -> None:
        index = self._next_call
        with self._lock:
            stream, rows = self._take_refreshes()
            for row in rows:
                if self._states[id(row)].first is None:
                    self._states[id(row)].first = index
            sources = [self._move_down(row) for row in rows]
            stepping = [r for r in self._running if self._states[id(r)].decoding and r not in rows]
        sampling = any(r.request.temperature > 0 for r in [*rows, *stepping])
        shape = (stream, self._stepping_slots([r.slot for r in stepping]), sampling)
        plan, program = self._plans[shape], self._programs[shape]
        last = self._phase_calls[-1] if self._phase_calls else None
        try:
            packed = self._stream_arrays(plan, rows, sources) if stream else None
        except Exception as err:  # these rows cannot be laid out: they fail, the rest go on
            self._fail_rows(rows, err)
            return
        queued = time.perf_counter()
        try:
            out = program(self.model.params, self._pool, packed)
        except Exception as err:  # the pool may have gone with the call
            self._restart(err, index)
            return
        self._pool = out["pool"]
        self._next_call += 1
        with self._lock:
            for row in rows:
                state = self._states[id(row)]
                state.started += 1
                state.since, state.decoding = index, True
                if self._block_calls is not None:
                    state.ends.append((index + self._block_calls - 1, row.slot))
        if last is not None:  # the device waited at most since the host saw `last` running
            gap = 0.0 if last.running else queued - last.seen_running
            self.metrics.host_gap.observe(gap)
            if gap > STALL_SECONDS:
                log.info("the device waited up to %.0f ms for the host", 1e3 * gap)
        self._phase_calls.append(_PhaseCall(index, out, rows, queued, queued))

    def _read_phase(self, call: _PhaseCall) -> None:
        """Wait for a call, commit the blocks that ended in it and send their events."""
        self._see_running()
        try:
            block, steps = jax.device_get((call.out["block"], call.out["step_in_block"]))
        except Exception as err:
            self._restart(err, call.index)
            return
        ended = time.perf_counter()  # the device ran it after the call before it ended
        self._see_running()  # a tighter bound on the device's wait for the next call
        seconds = ended - max(call.queued, self._last_read)
        self._last_read = ended
        self.metrics.block_call.observe(seconds)
        self._calls += 1
        self._call_seconds += seconds
        events = []
        mask_id = self.model.config.mask_token_id
        with self._lock:
            for row in list(self._running):
                state = self._states.get(id(row))
                if state is None or row.cancelled or row.done or state.since is None:
                    continue
                if self._block_calls is None and state.decoding and state.since <= call.index:
                    if (block[row.slot] == mask_id).any():
                        if steps[row.slot] >= self.block_length:  # no step commits: NaN logits
                            row.done = True
                            events.append((row, Failed(STALLED)))
                        continue
                    state.decoding = False
                    state.ends.append((call.index, row.slot))
                while state.ends and state.ends[0][0] == call.index and not row.done:
                    _, slot = state.ends.popleft()  # the slot it decoded in then
                    events += self._block_events(row, block[slot].tolist())
        self._send(events)
        self._note_memory()

    def _see_running(self) -> None:
        """Note the time on the queued calls still running: the device cannot have waited
        for the host before then (the host gap's bound)."""
        now = time.perf_counter()
        for later in self._phase_calls:
            if later.running:
                later.seen_running = now

    def _restart(self, err: Exception, failed: int) -> None:
        """After call `failed` failed on the device: every call queued after it fed on its
        pool, so the pool starts anew and those calls are dropped unread. The rows refreshed
        in or before the failed call fail (their K/V went with the pool, and their keys
        with it). A row first refreshed in a call queued behind it starts again from its
        prompt and the host's keys, as if it had just been admitted (none of its calls was
        read), so it gets the tokens it would have had; rows not yet refreshed wait as
        before, in their order."""
        log.exception("a device call failed")
        self._phase_calls.clear()
        with self._lock:
            again = []
            for row in self._running:
                state = self._states[id(row)]
                if row.done or state.first is None:
                    continue
                if state.first <= failed:
                    self._finish(row, Failed(f"the device call failed: {err}"))
                else:
                    self._states[id(row)] = _RowState()
                    again.append(row)
            waiting = [row for row in self._pending if not row.done and row not in again]
            self._pending = collections.deque([*again, *waiting])
        self._pool = self._empty_pool()


STALLED = (
    "the block stalled with masks left: the model's logits are not finite (check the "
    "weights and dtype for NaN/inf)"
)
