"""The serving engine: a thread that turns queued requests into device calls.

Three schedulers share the queue, the events and the metrics (`ServeConfig.scheduler`,
default `continuous`):

- `continuous`: one device call per block (`diffusion.run_block_call`, or
  `block_diffusion.run_causal_block_call` for a block-diffusion family). Every running row
  gets its block's refresh and denoising steps; rows may belong to different requests at
  different blocks (`layout`). Requests join at the next call and leave when their last
  block is done, so nobody waits for a whole batch. When the running rows' sequences differ
  enough, the shorter and the longer ones run as two calls, so short rows are not padded
  to the longest (`ServingEngine._groups`). The host state of a row is its context
  (prompt and committed tokens) and its key; each call's inputs are rebuilt from it. The
  engine queues a round (every running row's next block, in one or two calls) before it
  reads the round before it: a row whose last block the host has not read yet takes it,
  and its keys, from the table the calls leave on the device (`diffusion.Carried`), so the
  device runs one round while the host reads the last and prepares the next, and never
  waits for it. A row that turns out to have stopped in the unread round has decoded one
  block in vain.
- `phase`: one forward per device call, mixing some rows' refreshes with every other row's
  cached step over K/V kept on the device (`djax.serving.phase`, which builds on this
  module).
- `static`: batches of up to `max_batch` requests in the queue's order, each run to
  completion as one whole-generation program (`diffusion.run_generation`, as
  `djax.generate` runs it); the baseline continuous batching is measured against.

Waiting requests are admitted by arrival, or under `ServeConfig.scheduling_policy="priority"`
by their priority, lower first, then arrival; a running request keeps its row (no
preemption).

Every program the continuous scheduler can need is compiled before the engine reports
ready; the static scheduler compiles a batch shape the first time it meets it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from djax import block_diffusion
from djax import engine as djax_engine
from djax.diffusion import Carried, Plan, Rows, Slots, row_keys, run_block_call, run_generation
from djax.generation import GenerationConfig, samples_filtered
from djax.model import Model
from djax.models.sparse_attention import plan_sparse
from djax.serving import layout, memory
from djax.serving.metrics import ServerMetrics
from djax.serving.requests import (
    BlockCommitted,
    EngineRequest,
    EngineStopped,
    Event,
    Failed,
    Finished,
    OverBudget,
    QueueFull,
)

log = logging.getLogger("djax.serve")

# A wait of the device for the host this long is logged (INFO) with the queue it met.
STALL_SECONDS = 0.02

SCHEDULERS = ("continuous", "phase", "static")
# The order waiting requests are admitted in: `fcfs` by arrival (priorities are not read; the
# API refuses any but 0), `priority` by priority, lower first, then by arrival (vLLM's
# `--scheduling-policy`).
SCHEDULING_POLICIES = ("fcfs", "priority")


# How long an idle engine waits for requests arriving together to join the first one: up
# to `limit` seconds, while each new arrival comes within `quiet` seconds of the last. The
# continuous scheduler's next call is never far off; a static batch runs to completion, so
# it gathers longer.
@dataclasses.dataclass(frozen=True)
class ArrivalWindow:
    quiet: float
    limit: float


ARRIVAL_WINDOWS = {
    "continuous": ArrivalWindow(quiet=0.005, limit=0.05),
    "phase": ArrivalWindow(quiet=0.005, limit=0.05),
    "static": ArrivalWindow(quiet=0.025, limit=0.5),
}
# Cache policies whose cached steps need nothing but the block's place: the layout moves
# the block to the front, so `prefix` and `vicinity` windows would mean other positions.
SERVED_CACHES = ("dual", "none")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How a server decodes and batches.

    generation: the server-wide decoding settings (decoder, block_length, cache, steps,
    threshold and temperature defaults; gen_length is the default max_tokens, and with
    `steps` it sets the fixed-steps decoders' steps per block). scheduler: one of
    `SCHEDULERS`: `continuous` (the default) answered sooner below saturation on the serve
    benchmark, `phase` serves more at saturation (the README's serve figures). max_batch:
    rows per device call;
    max_queue: requests waiting beyond them. scheduling_policy: one of
    `SCHEDULING_POLICIES`, the order waiting requests are admitted in; a running request
    keeps its row whatever arrives (no preemption).
    max_seq_len: the longest prompt + answer served (None: the model's maximum); it bounds
    the compiled shapes. sampling: whether temperature > 0 is served (its programs are
    compiled at warm-up too). memory_fraction: the share of the memory JAX may allocate
    on each device that the server may use, weights included (`djax.serving.memory`);
    memory_bytes: those bytes given outright instead (None: from memory_fraction, where
    the device reports its memory). The continuous scheduler runs only block calls that fit
    beside the weights.
    phase_tokens: the phase scheduler's tokens a call (every slot's block plus the rows
    refreshing in it; 0: room for two rows of the longest sequence beside the steps).
    """

    generation: GenerationConfig = GenerationConfig()
    scheduler: str = "continuous"
    scheduling_policy: str = "fcfs"
    max_batch: int = 32
    max_queue: int = 1024
    max_seq_len: int | None = None
    sampling: bool = True
    memory_fraction: float = 0.9
    memory_bytes: int | None = None
    phase_tokens: int = 0

    def __post_init__(self):
        g = self.generation
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r}; expected one of {SCHEDULERS}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r}; expected one of "
                f"{SCHEDULING_POLICIES}"
            )
        for name in ("max_batch", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if not isinstance(self.phase_tokens, int) or self.phase_tokens < 0:
            raise ValueError(f"phase_tokens={self.phase_tokens!r}; expected an int ≥ 0")
        if self.phase_tokens and self.scheduler != "phase":
            raise ValueError(
                f"phase_tokens={self.phase_tokens} applies to scheduler='phase'; got "
                f"scheduler={self.scheduler!r}"
            )
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len <= g.block_length
        ):
            raise ValueError(
                f"max_seq_len={self.max_seq_len!r}; expected an int above block_length "
                f"{g.block_length}"
            )
        fraction = self.memory_fraction
        if not (
            isinstance(fraction, int | float)
            and not isinstance(fraction, bool)
            and 0 < fraction <= 1
        ):
            raise ValueError(f"memory_fraction={fraction!r}; expected a number in (0, 1]")
        if self.memory_bytes is not None and (
            not isinstance(self.memory_bytes, int)
            or isinstance(self.memory_bytes, bool)
            or self.memory_bytes < 1
        ):
            raise ValueError(f"memory_bytes={self.memory_bytes!r}; expected a positive int or None")
        if g.cache not in SERVED_CACHES:
            raise ValueError(f"cache={g.cache!r}; the server supports {SERVED_CACHES}")
        if g.smoothing:
            raise ValueError("smoothing=True is not served; it needs the whole generation")
        if g.temperature > 0 and not self.sampling:
            raise ValueError(f"temperature={g.temperature} needs sampling=True")
        if g.logits_chunk and self.sampling and (g.top_k > 0 or g.top_p < 1):
            raise ValueError(  # else every sampled request left at the defaults is refused
                f"top_k={g.top_k}, top_p={g.top_p} (the requests' defaults) need a step's "
                f"whole logits; logits_chunk={g.logits_chunk} computes them in chunks"
            )

    @property
    def steps_per_block(self) -> int:
        """Steps per block of the fixed-steps decoders (as `djax.generate` splits them)."""
        g = self.generation
        blocks = math.ceil(g.gen_length / g.block_length)
        return max((g.steps or blocks * g.block_length) // blocks, 1)


@dataclasses.dataclass
class _Call:
    """A dispatched block call: its rows, its device outputs, and host times: when it was
    queued, when the device can have started it, when the host last saw it running."""

    rows: list[_Row]
    out: dict
    queued: float
    started: float
    seen_running: float

    @property
    def running(self) -> bool:
        return not self.out["block"].is_ready()


@dataclasses.dataclass(eq=False)  # a row is itself: `in` and `==` by identity
class _Row:
    """A request on the host: what it has committed and where its randomness stands."""

    request: EngineRequest
    on_event: Callable[[Event], None]
    answer_length: int
    keys: np.ndarray  # [2] uint32, carried from call to call
    threshold: float
    committed: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1  # its place in the carried table while it runs
    in_flight: int = 0  # blocks dispatched whose tokens the host has not read (0 or 1)
    done: bool = False  # the engine has finished it (its last events may still be unsent)
    cancelled: bool = False  # the client dropped it: no more events
    submitted: float = dataclasses.field(default_factory=time.monotonic)  # when it queued

    @property
    def context(self) -> np.ndarray:
        return np.asarray(self.request.prompt_ids + tuple(self.committed), np.int32)

    @property
    def sequence(self) -> int:
        return len(self.request.prompt_ids) + self.answer_length


class ServingEngine:
    """The engine thread, its queue and its programs (see the module docstring). Implements
    `djax.serving.requests.Engine`."""

    def __init__(self, model: Model, config: ServeConfig, metrics: ServerMetrics):
        # Its programs compile through the persistent compile cache, as `djax.generate`'s do,
        # so that a later engine reads them back; a bad cache setting fails here, before
        # anything is served (`serve` builds the engine before it opens its socket).
        djax_engine.enable_compile_cache()
        cfg = model.config
        g = config.generation
        if cfg.block_diffusion:
            if g.decoder not in block_diffusion.DECODERS:
                raise ValueError(
                    f"decoder={g.decoder!r} is not available for block diffusion "
                    f"({cfg.family}); expected one of {block_diffusion.DECODERS}"
                )
            if g.attention_sparsity < 1:
                raise ValueError(
                    f"attention_sparsity={g.attention_sparsity} is not available for block "
                    "diffusion; expected 1.0"
                )
            if g.refresh_every:
                raise ValueError(
                    f"refresh_every={g.refresh_every} is not available for block diffusion "
                    "(its block cache is exact); expected 0"
                )
        self.model, self.config, self.metrics = model, config, metrics
        self.block_length = config.generation.block_length
        if config.max_seq_len is not None and config.max_seq_len > cfg.max_seq_len:
            raise ValueError(
                f"max_seq_len={config.max_seq_len} exceeds the model's maximum sequence "
                f"{cfg.max_seq_len}"
            )
        self._max_sequence = config.max_seq_len or cfg.max_seq_len
        if self._max_sequence <= self.block_length:
            raise ValueError(
                f"the model's maximum sequence {cfg.max_seq_len} leaves no room for a prompt "
                f"beside a block of {self.block_length}"
            )
        self.stop_ids = frozenset(
            config.generation.stop_ids
            if config.generation.stop_ids is not None
            else cfg.stop_token_ids
        )
        self.layout = layout.RowLayout(
            self.block_length, cfg.mask_token_id, cfg.pad_token_id, causal=cfg.block_diffusion
        )
        # The block call, chosen once by the family: block-causal rows or bidirectional.
        self.run_block = (
            block_diffusion.run_causal_block_call if cfg.block_diffusion else run_block_call
        )
        data = 1 if model.mesh is None else model.mesh.shape["data"]
        self.batch_buckets = layout.batch_buckets(config.max_batch, data)
        self.seq_buckets = layout.seq_buckets(self._max_sequence, self.block_length)
        limit, self._weight_bytes = memory.budget_bytes(
            model, config.memory_fraction, config.memory_bytes
        )
        self.memory = memory.MemoryBudget(limit, (False, True) if config.sampling else (False,))
        self._measured = False  # continuous: every served call's bytes are known
        self._estimated = False  # some call's bytes are estimated (no memory analysis)
        metrics.memory_budget.set(limit or 0)
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Row] = collections.deque()
        self._by_id: dict[str, _Row] = {}
        self._running: list[_Row] = []
        self._stopping = False
        self._ready = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # why the engine's thread ended, if it failed
        self._last_ready: float | None = None  # static: when the device finished the last call
        self._queued: collections.deque[_Call] = collections.deque()  # continuous: unread calls
        self._free_slots = list(range(config.max_batch))
        self._carried: Carried | None = None
        self._calls, self._call_seconds = 0, 0.0
        self.call_cost = (config.steps_per_block + 1) * weight_read_tokens(model)

    # ------------------------------------------------------------ the Engine protocol

    @property
    def ready(self) -> bool:
        return self._ready and not self._stopping

    @property
    def max_sequence(self) -> int:
        return self._max_sequence

    def answer_length(self, max_tokens: int, prompt_length: int) -> int:
        """Whole blocks of `max_tokens` after the prompt; under block diffusion the first
        block also holds the prompt's tail, so those blocks less the tail."""
        tail = self.layout.tail(prompt_length)
        return self.block_length * math.ceil((tail + max_tokens) / self.block_length) - tail

    def submit(self, request: EngineRequest, on_event: Callable[[Event], None]) -> None:
        row = self._row(request, on_event)
        with self._lock:
            if self._stopping:
                raise EngineStopped("the engine is stopping or has stopped")
            if request.request_id in self._by_id:
                raise ValueError(f"request_id={request.request_id!r} is already queued")
            if len(self._waiting) - self._free_rows() >= self.config.max_queue:
                raise QueueFull(len(self._waiting), self._retry_after())
            self._enqueue(row)
            self._by_id[request.request_id] = row
            self.metrics.queue_depth.set(len(self._waiting))
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            row = self._by_id.pop(request_id, None)
            if row is None:
                return
            row.cancelled = True
            if row in self._waiting:
                self._waiting.remove(row)
                self.metrics.queue_depth.set(len(self._waiting))
            self._count_running()
            self._lock.notify()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Compile every program and start serving, in the engine's thread."""
        self._thread = threading.Thread(target=self._main, name="djax-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Refuse new requests; with `drain`, finish the queued and running ones first,
        otherwise fail them. Returns when the engine thread has ended (or after
        `timeout` seconds)."""
        with self._lock:
            self._stopping = True
            if not drain:
                self._fail_pending("the server is shutting down")
            self._lock.notify()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine's thread to end (after `stop`, or when it fails: `failure`)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until warm-up is done (True) or `timeout` passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            if self._thread is not None and not self._thread.is_alive():
                return False
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # ------------------------------------------------------------ requests

    def _row(self, request: EngineRequest, on_event: Callable[[Event], None]) -> _Row:
        """Check a request against what this engine serves; the message names the field."""
        cfg = self.model.config
        if not request.prompt_ids:
            raise ValueError("prompt is empty; expected at least one token")
        bad = [t for t in request.prompt_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt has token id {bad[0]} outside [0, {cfg.vocab_size})")
        if cfg.mask_token_id in request.prompt_ids:
            raise ValueError(f"prompt contains the mask id {cfg.mask_token_id}")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens!r}; expected a positive int")
        if not isinstance(request.priority, int) or isinstance(request.priority, bool):
            raise ValueError(f"priority={request.priority!r}; expected an int")
        answer = self.answer_length(request.max_tokens, len(request.prompt_ids))
        if len(request.prompt_ids) + answer > self._max_sequence:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens {request.max_tokens} "
                f"(in blocks of {self.block_length}: {answer}) exceeds the maximum sequence "
                f"{self._max_sequence}"
            )
        if not (math.isfinite(request.temperature) and request.temperature >= 0):
            raise ValueError(f"temperature={request.temperature}; expected a finite value ≥ 0")
        if request.temperature > 0 and not self.config.sampling:
            raise ValueError(f"temperature={request.temperature}; this server serves only 0")
        check_filters(request, self.config.generation.logits_chunk)
        threshold = self.config.generation.threshold
        if request.threshold is not None:
            if not 0 < request.threshold <= 1:
                raise ValueError(f"threshold={request.threshold}; expected a value in (0, 1]")
            threshold = request.threshold
        row = _Row(request, on_event, answer, row_keys(request.seed, 1)[0], threshold)
        if self._measured and not self._fits([row]):
            raise self._over_budget(row)
        return row

    def _fits(self, rows: list[_Row]) -> bool:
        """Whether one block call of these rows fits the memory budget."""
        batch = layout.bucket(len(rows), self.batch_buckets)
        seq = layout.bucket(max(r.sequence for r in rows), self.seq_buckets)
        return self.memory.fits(batch, seq)

    def _round_fits(self, rows: list[_Row]) -> bool:
        """Whether these rows can run as a round within the memory budget: as one call, or
        as two (the shorter sequences, then the longer; the device runs them one after the
        other), each of which fits."""
        if self._fits(rows):
            return True
        rows = sorted(rows, key=lambda r: r.sequence)
        return any(self._fits(rows[:k]) and self._fits(rows[k:]) for k in range(1, len(rows)))

    def _over_budget(self, row: _Row) -> OverBudget:
        """The refusal of a request whose block call does not fit even alone, naming the
        sizes."""
        batch, seq = self.batch_buckets[0], layout.bucket(row.sequence, self.seq_buckets)
        nbytes = self.memory.call_bytes(batch, seq)
        takes = "" if nbytes is None else f" takes {_mib(nbytes)}, which"
        served = [s for s in self.seq_buckets if self.memory.fits(batch, s)]
        longest = f"the longest that fits is {served[-1]} tokens" if served else "none fits at all"
        request = row.request
        return OverBudget(
            f"prompt ({len(request.prompt_ids)} tokens) + max_tokens {request.max_tokens} "
            f"(in blocks of {self.block_length}: {row.answer_length}) = {row.sequence} "
            f"tokens: its block call (batch {batch}, sequence {seq}){takes} exceeds this "
            f"server's memory budget of {_mib(self.memory.limit or 0)} beside the weights "
            f"({_mib(self._weight_bytes)}); {longest}"
        )

    def _retry_after(self) -> float:
        """A guess, in whole seconds, at when a queue slot frees: a device call's mean time
        for each batch waiting ahead."""
        batches = len(self._waiting) / self.config.max_batch + 1
        mean_call = self._call_seconds / max(self._calls, 1)
        return float(max(1, math.ceil(batches * mean_call)))

    def _emit(self, row: _Row, event: Event) -> None:
        if row.cancelled:
            return
        try:
            row.on_event(event)
        except Exception:  # a broken consumer must not stop the engine
            log.exception("event handler of %s failed", row.request.request_id)

    def _finish(self, row: _Row, event: Event) -> None:
        """Forget a request, then send its last event (lock held): its id is free again,
        and it no longer counts as running, by the time the client hears it is done (its
        slot frees at the scheduler's next admission)."""
        row.done = True
        self._count_running()
        if self._by_id.get(row.request.request_id) is row:
            del self._by_id[row.request.request_id]
        self._emit(row, event)

    def _live_rows(self) -> int:
        """The running rows neither finished nor cancelled (lock held): a row stops counting
        when it ends, not when the scheduler next frees its slot."""
        return sum(not (r.done or r.cancelled) for r in self._running)

    def _free_rows(self) -> int:
        """Batch rows no live row holds (lock held): queued rows up to this many are about to
        start, not waiting beyond the rows (`ServeConfig.max_queue`)."""
        return max(0, self.config.max_batch - self._live_rows())

    def _count_running(self) -> None:
        """Set the running-rows gauge to the live rows (lock held)."""
        self.metrics.running_rows.set(self._live_rows())

    def _timed_call(self, program: Any, args: tuple) -> dict:
        """Run a static batch's call and wait for it; its host outputs."""
        if self._last_ready is not None:
            self.metrics.host_gap.observe(time.perf_counter() - self._last_ready)
        started = time.perf_counter()
        out = jax.device_get(program(*args))
        self._last_ready = time.perf_counter()
        self._note_memory()
        seconds = self._last_ready - started
        self.metrics.block_call.observe(seconds)
        self._calls += 1
        self._call_seconds += seconds
        return out

    def _fail_pending(self, reason: str) -> None:
        """Fail every waiting and running row not yet done with `reason` and empty the
        queue (the lock held)."""
        for row in [*self._waiting, *self._running]:
            if not row.done:
                self._finish(row, Failed(reason))
        self._waiting.clear()

    def _fail_rows(self, rows: list[_Row], err: Exception) -> None:
        log.exception("a device call failed")
        with self._lock:
            for row in rows:
                if not row.done:
                    self._finish(row, Failed(f"the device call failed: {err}"))

    # ------------------------------------------------------------ the thread

    def _main(self) -> None:
        try:
            self._warm_up()
            if self._stopping:  # stopped while warming up: end without serving
                log.info("stopped before ready: the warm-up ended at the stop")
                with self._lock:
                    self._fail_pending("the server stopped before it was ready")
                return
            self._ready = True
            log.info("ready: %s scheduler", self.config.scheduler)
            self._serve()
        except BaseException as err:  # noqa: BLE001 - the thread's last word: fail everyone
            log.exception("the engine stopped")
            self.failure = err
            with self._lock:
                self._stopping = True
                self._fail_pending(f"the engine stopped: {err}")
                self._running.clear()
                self.metrics.queue_depth.set(0)
                self.metrics.running_rows.set(0)

    def _serve(self) -> None:
        if self.config.scheduler == "continuous":
            self._serve_continuous()
        else:
            self._serve_static()

    def _enqueue(self, row: _Row) -> None:
        """Put `row` in the waiting queue, which holds rows in the order they are admitted
        (lock held): by arrival under `fcfs`; under `priority` after every waiting row of
        the same or a lower priority value, before the first of a higher one."""
        if self.config.scheduling_policy == "fcfs":
            self._waiting.append(row)
            return
        priority = row.request.priority
        at = next(
            (i for i, w in enumerate(self._waiting) if w.request.priority > priority),
            len(self._waiting),
        )
        self._waiting.insert(at, row)

    def _take_waiting(
        self, free: int, fits: Callable[[list[_Row]], bool] | None = None
    ) -> list[_Row]:
        """Up to `free` waiting rows, in the queue's order (`_enqueue`), while `fits` the
        rows taken with the next one (lock held)."""
        rows: list[_Row] = []
        while self._waiting and len(rows) < free:
            if fits is not None and not fits([*rows, self._waiting[0]]):
                break
            rows.append(self._waiting.popleft())
        self.metrics.queue_depth.set(len(self._waiting))
        self._observe_queue_time(rows)
        return rows

    def _observe_queue_time(self, rows: list[_Row]) -> None:
        """Record how long each of `rows`, just given a batch row, waited for it."""
        now = time.monotonic()
        for row in rows:
            self.metrics.queue_time.observe(now - row.submitted)

    def _wait_for_work(self) -> bool:
        """Sleep until a request waits, then let the requests arriving with it join it (the
        scheduler's `ARRIVAL_WINDOWS`, until a batch is full); False when the engine should
        end (lock held)."""
        while not self._waiting:
            if self._stopping:
                return False
            self._lock.wait(0.5)
        window = ARRIVAL_WINDOWS[self.config.scheduler]
        deadline = time.monotonic() + window.limit
        while len(self._waiting) < self.config.max_batch and time.monotonic() < deadline:
            seen = len(self._waiting)
            self._lock.wait(window.quiet)
            if len(self._waiting) == seen:
                break
        return True

    # ------------------------------------------------------------ continuous

    def _block_plan(self, batch: int, seq: int, sampling: bool) -> Plan:
        g, cfg = self.config.generation, self.model.config
        return Plan(
            batch=batch,
            prompt_len=0,
            gen_length=seq,
            block_len=self.block_length,
            steps_per_block=self.config.steps_per_block,
            decoder=g.decoder_spec(),
            cache=g.cache_policy(),
            mask_id=cfg.mask_token_id,
            fill_id=cfg.eos_token_id,
            stop_ids=(),
            early_stop=False,
            sampling=sampling,
            sparse=plan_sparse(g.attention_sparsity, g.attention_window, seq, self.block_length),
        )

    def _block_args(self, rows: list[_Row], batch: int, seq: int) -> tuple:
        """The call's arguments. A row with a block in flight gets mask ids where that
        block goes, and the call carries the block and the keys after it in from the
        device table (`Slots.carry_at`)."""
        block = self.block_length
        arrays = self.layout.arrays(batch, seq)
        keys = np.zeros((batch, 2), np.uint32)
        threshold = np.ones(batch, np.float32)
        temperature = np.zeros(batch, np.float32)
        top_k = np.zeros(batch, np.int32)
        top_p = np.ones(batch, np.float32)
        index = np.full(batch, self.config.max_batch, np.int32)
        carry_at = np.full(batch, -1, np.int32)
        for i, row in enumerate(rows):
            context = row.context
            if row.in_flight:  # its block starts at the context's last block boundary
                context = context[: len(context) - self.layout.tail(len(context))]
                carry_at[i] = block + len(context)
                context = np.concatenate([context, np.full(block, self.layout.mask_id, np.int32)])
            later = row.answer_length - len(row.committed) - (row.in_flight + 1) * block
            self.layout.fill(arrays, i, context, 0 if self.layout.causal else later)
            keys[i], threshold[i], temperature[i] = row.keys, row.threshold, row.request.temperature
            top_k[i], top_p[i] = row.request.top_k, row.request.top_p
            index[i] = row.slot
        inputs = [arrays["tokens"], arrays["key_valid"], arrays["positions"]]
        steps = self._block_steps(rows, batch) if self.layout.causal else None
        per_row = Rows(keys, threshold, temperature, steps, *self._filters(top_k, top_p))
        return (
            self.model.params,
            *djax_engine.place(self.model, inputs),
            djax_engine.place(self.model, per_row),
            djax_engine.place(self.model, Slots(index, carry_at)),
            self._carried,
        )

    def _filters(self, top_k: np.ndarray, top_p: np.ndarray) -> tuple:
        """The rows' top_k and top_p for `Rows`, or none (None, None) where the server's
        logits come in chunks (their requests are refused filters, `check_filters`): every
        sampling call of a server passes the same, so one program serves all its rows."""
        if self.config.generation.logits_chunk:
            return None, None
        return top_k, top_p

    def _block_steps(self, rows: list[_Row], batch: int) -> np.ndarray:
        """[batch] int32: each row's steps a block under block diffusion, the server's
        capped at the row's max_tokens as `djax.generate` caps them at gen_length (empty
        rows: the server's)."""
        steps = np.full(batch, self.config.steps_per_block, np.int32)
        for i, row in enumerate(rows):
            steps[i] = min(steps[i], row.request.max_tokens)
        return steps

    def _empty_table(self) -> Carried:
        """A carried table of `max_batch` slots, on every device of the model."""
        n = self.config.max_batch
        table = Carried(np.zeros((n, self.block_length), np.int32), np.zeros((n, 2), np.uint32))
        return djax_engine.place_replicated(self.model, table)

    def _block_program(self, rows: list[_Row]) -> tuple[Any, tuple]:
        batch = layout.bucket(len(rows), self.batch_buckets)
        seq = layout.bucket(max(r.sequence for r in rows), self.seq_buckets)
        sampling = any(r.request.temperature > 0 for r in rows)
        plan = self._block_plan(batch, seq, sampling)
        args = self._block_args(rows, batch, seq)
        program, seconds = djax_engine.executable(self.model, plan, args, self.run_block)
        nbytes = self.memory.calls.get((batch, seq, sampling))
        if nbytes is None:
            nbytes = self._call_bytes(program, batch, seq)
            self.memory.record(batch, seq, sampling, nbytes)
        self.metrics.call_bytes.set(nbytes)
        if seconds:
            log.warning(
                "compiled a block program while serving (batch %d, seq %d): %.1f s",
                batch,
                seq,
                seconds,
            )
            self.metrics.compiles.inc()
        return program, args

    def call_bytes(self, batch: int, seq: int, sampling: bool = False) -> int:
        """A block call's bytes beside the weights (`djax.serving.memory`), its program
        compiled (or taken from those compiled before) and its bytes recorded."""
        if self._carried is None:
            self._carried = self._empty_table()
        plan = self._block_plan(batch, seq, sampling)
        args = self._block_args([], batch, seq)
        program, _ = djax_engine.executable(self.model, plan, args, self.run_block)
        nbytes = self._call_bytes(program, batch, seq)
        self.memory.record(batch, seq, sampling, nbytes)
        return nbytes

    def _call_bytes(self, program: Any, batch: int, seq: int) -> int:
        """The program's analysed bytes, or the estimate where the backend gives none."""
        nbytes = memory.analysed_call_bytes(program, self._weight_bytes)
        if nbytes is None:
            if not self._estimated:
                log.warning(
                    "the backend gives no memory analysis of a program: block calls' bytes "
                    "are estimated (K/V buffers and logits, no other activation)"
                )
                self._estimated = True
            chunk = self.config.generation.logits_chunk or None
            nbytes = memory.estimate_call_bytes(self.model, batch, seq, self.block_length, chunk)
        return nbytes

    def _warm_up(self) -> None:
        """Compile every block program (continuous) that fits the memory budget, and record
        each one's bytes, before reporting ready. Each (sequence, sampling) compiles its
        batch buckets from the smallest up and stops at the first over the budget; a bucket
        that a smaller one over the budget rules out is not compiled. Several compile at a
        time (the shorter sequences first): tracing holds the GIL, XLA's compiler does
        not."""
        if self.config.scheduler != "continuous":
            return
        self._carried = self._empty_table()
        chains = [(s, x) for s in self.seq_buckets for x in self.memory.variants]
        table = threading.Lock()
        compiled = []
        start = time.perf_counter()

        def compile_chain(chain: tuple[int, bool]) -> None:
            seq, sampling = chain
            for batch in self.batch_buckets:
                if self._stopping:  # stopped while warming up: compile no more
                    return
                with table:
                    if self.memory.never_fits(batch, seq):
                        return
                plan = self._block_plan(batch, seq, sampling)
                args = self._block_args([], batch, seq)
                program, _ = djax_engine.executable(self.model, plan, args, self.run_block)
                nbytes = self._call_bytes(program, batch, seq)
                self.metrics.compiles.inc()
                with table:
                    compiled.append(chain)
                    self.memory.record(batch, seq, sampling, nbytes)

        workers = max(1, min(len(chains), (os.cpu_count() or 2) // 2, 8))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(compile_chain, chains))
        if self._stopping:
            return
        self._measured = True
        smallest = (self.batch_buckets[0], self.seq_buckets[0])
        if not self.memory.fits(*smallest):
            raise ValueError(
                f"the memory budget of {_mib(self.memory.limit or 0)} beside the weights "
                f"({_mib(self._weight_bytes)}) holds no block call: the smallest (batch "
                f"{smallest[0]}, sequence {smallest[1]}) takes "
                f"{_mib(self.memory.call_bytes(*smallest) or 0)}; raise --memory-fraction"
            )
        log.info(
            "compiled %d block programs (batches %s, sequences %s) in %.1f s",
            len(compiled),
            self.batch_buckets,
            self.seq_buckets,
            time.perf_counter() - start,
        )
        if self.memory.limit is not None:
            largest = {
                s: max((b for b in self.batch_buckets if self.memory.fits(b, s)), default=0)
                for s in self.seq_buckets
            }
            log.info(
                "memory budget %s beside the weights (%s): the largest batch of each sequence %s",
                _mib(self.memory.limit),
                _mib(self._weight_bytes),
                largest,
            )

    def _serve_continuous(self) -> None:
        """Rounds of block calls: queue a round (every row with a block left, in one or two
        calls), then read the round before it while the device runs this one."""
        while True:
            with self._lock:
                rows = self._next_rows()
            if rows:
                previous = len(self._queued)
                for group in self._groups(rows):
                    self._dispatch(group)
                self._read_calls(previous)
            elif self._queued:  # every running row's last block is queued
                self._read_calls(len(self._queued))
            else:
                with self._lock:
                    if not self._wait_for_work():
                        return

    def _next_rows(self) -> list[_Row]:
        """Drop the finished and cancelled rows (their slots free), admit waiting ones into
        free slots while the running rows' round fits the memory budget (`_round_fits`; in
        the queue's order: a request that does not fit waits for rows to finish); the
        rows with a block left to queue (lock held)."""
        running = []
        for row in self._running:
            if row.cancelled or row.done:
                self._free_slots.append(row.slot)
            else:
                running.append(row)
        while self._waiting and not self._fits([self._waiting[0]]):  # queued before warm-up
            row = self._waiting.popleft()
            self._finish(row, Failed(str(self._over_budget(row))))
        free = self.config.max_batch - len(running)
        for row in self._take_waiting(free, lambda rows: self._round_fits([*running, *rows])):
            row.slot = self._free_slots.pop()
            running.append(row)
        self._running = running
        self.metrics.running_rows.set(len(running))
        block = self.block_length
        return [r for r in running if len(r.committed) + r.in_flight * block < r.answer_length]

    def _dispatch(self, rows: list[_Row]) -> None:
        """Queue a call for `rows` behind the calls already queued. The device waits for
        the host only when the last of those ends before this one is queued: the wait,
        bounded by the last time the host saw that call running, goes to `host_gap`."""
        last = self._queued[-1] if self._queued else None
        self._note_running(last)
        try:
            program, args = self._block_program(rows)
            self._note_running(last)
            queued = time.perf_counter()
            out = program(*args)
        except Exception as err:  # the call failed: its rows fail, the server goes on
            self._fail_rows(rows, err)
            return
        self._carried = out["carried"]
        for row in rows:
            row.in_flight += 1
        if last is not None:
            gap = 0.0 if last.running else queued - last.seen_running
            self.metrics.host_gap.observe(gap)
            if gap > STALL_SECONDS:
                log.info(
                    "the device waited up to %.0f ms for the host (%d rows running, %d waiting)",
                    1e3 * gap,
                    len(self._running),
                    len(self._waiting),
                )
        started = queued if last is None else math.inf  # set when `last` is read
        self._queued.append(_Call(rows, out, queued, started, seen_running=queued))

    def _read_calls(self, n: int) -> None:
        """Read the first `n` queued calls, in order. A call that failed on the device fails
        its rows (`_read`) and fed its carried table to every call queued after it, whose
        outputs are then errors too: those calls are dropped unread and their rows run
        again from what the host holds (`_rerun`), and the table starts anew."""
        failed = False
        while self._queued and (n > 0 or failed):
            n -= 1
            call = self._queued.popleft()
            if failed:
                self._rerun(call)
            else:
                failed = not self._read(call)
        if failed:
            self._carried = self._empty_table()

    def _rerun(self, call: _Call) -> None:
        """Drop a call queued behind a failed one: its rows' blocks are not in flight any
        more, so the next round dispatches them again from their committed tokens and their
        keys as last read (the same tokens the dropped call would have given)."""
        rerun = 0
        for row in call.rows:
            row.in_flight -= 1
            rerun += not row.done
        if rerun:
            log.warning("%d rows run their block again: the call before theirs failed", rerun)

    def _fetch(self, out: dict) -> tuple[np.ndarray, np.ndarray]:
        """A call's blocks and keys on the host, once the device has them."""
        return jax.device_get((out["block"], out["keys"]))

    def _note_running(self, call: _Call | None) -> None:
        if call is not None and call.running:
            call.seen_running = time.perf_counter()

    def _read(self, call: _Call) -> bool:
        """Wait for a call, commit its blocks and send their events; False (its rows
        failed) when the device call failed."""
        try:
            block, keys = self._fetch(call.out)
        except Exception as err:
            self._fail_rows(call.rows, err)
            return False
        finally:
            for row in call.rows:
                row.in_flight -= 1
        ended = time.perf_counter()
        seconds = ended - call.started
        self.metrics.block_call.observe(seconds)
        self._calls += 1
        self._call_seconds += seconds
        if self._queued:  # the next call starts on the device now
            self._queued[0].started = max(self._queued[0].queued, ended)
        with self._lock:
            events = self._commit(call.rows, block, keys)
        self._send(events)
        self._note_memory()
        if self._queued:
            self._note_running(self._queued[-1])
        return True

    def _note_memory(self) -> None:
        """The device memory gauges, where the backend reports memory."""
        in_use = memory.memory_in_use(self.model)
        if in_use is not None:
            self.metrics.device_bytes.set(in_use[0])
            self.metrics.device_peak_bytes.set(in_use[1])

    def _groups(self, rows: list[_Row]) -> list[list[_Row]]:
        """The running rows as one call, or as two calls (shorter and longer sequences)
        when that costs less or when only two fit the memory budget: a call costs its
        padded tokens (batch × sequence bucket, the refresh's work) plus the weight reads of
        its forwards (`call_cost`)."""
        rows = sorted(rows, key=lambda r: r.sequence)

        def cost(group: list[_Row]) -> int:
            batch = layout.bucket(len(group), self.batch_buckets)
            return batch * layout.bucket(group[-1].sequence, self.seq_buckets) + self.call_cost

        best, split = cost(rows) if self._fits(rows) else math.inf, None
        for k in range(1, len(rows)):
            two = cost(rows[:k]) + cost(rows[k:])
            if two < best and self._fits(rows[:k]) and self._fits(rows[k:]):
                best, split = two, k
        return [rows] if split is None else [rows[:split], rows[split:]]

    def _commit(self, rows: list[_Row], block: np.ndarray, keys: np.ndarray) -> list:
        """Record each row's new block [rows, block_length] and its keys; the events to
        send (lock held)."""
        events = []
        for i, row in enumerate(rows):
            if row.cancelled or row.done:
                continue
            row.keys = keys[i]
            tail = self.layout.tail(len(row.context))  # the prompt's, in its first block
            events += self._block_events(row, block[i, tail:].tolist())
        return events

    def _block_events(self, row: _Row, tokens: list[int]) -> list[tuple[_Row, Event]]:
        """Commit a row's next block; its events: the tokens up to the first stop token and
        max_tokens, then `Finished` when the request is done (lock held), whose count of
        answer tokens includes the stop token that ended it (inside max_tokens)."""
        cfg = self.model.config
        # Block diffusion keeps a mask id its model predicted (as `djax.generate` does); a
        # LLaDA block holds none once decoded.
        stalled = not self.layout.causal and cfg.mask_token_id in tokens
        if stalled or not all(0 <= t < cfg.vocab_size for t in tokens):
            row.done = True
            return [
                (
                    row,
                    Failed(
                        "the block stalled with masks left: the model's logits are not finite "
                        "(check the weights and dtype for NaN/inf)"
                    ),
                )
            ]
        request, sent = row.request, len(row.committed)
        row.committed += tokens
        stop_at = None
        if not request.ignore_eos:
            stop_at = next((j for j, t in enumerate(tokens) if t in self.stop_ids), None)
        room = request.max_tokens - sent
        keep = tokens[: min(room, len(tokens) if stop_at is None else stop_at)]
        events: list[tuple[_Row, Event]] = [(row, BlockCommitted(tuple(keep)))]
        if stop_at is not None and stop_at < room:  # the stop token counts, as vLLM counts it
            events.append((row, Finished("stop", sent + len(keep) + 1)))
        elif sent + len(tokens) >= request.max_tokens:
            events.append((row, Finished("length", sent + len(keep))))
        row.done = isinstance(events[-1][1], Finished)
        return events

    def _send(self, events: list[tuple[_Row, Event]]) -> None:
        """Deliver events under the lock, so none reaches a row after its last one (a
        `stop` or `cancel` from another thread lands between two events, never inside
        one) or after `cancel` returns."""
        with self._lock:
            for row, event in events:
                if isinstance(event, (Finished, Failed)):
                    if self._by_id.get(row.request.request_id) is row:  # not ended yet
                        self._finish(row, event)
                elif self._by_id.get(row.request.request_id) is row:
                    self._emit(row, event)
        events.clear()

    # ------------------------------------------------------------ static

    def _serve_static(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._last_ready = None
                if not self._wait_for_work():
                    return
                rows = self._static_batch()
                self._running = rows
                self.metrics.running_rows.set(len(rows))
            if not rows:  # the requests that woke it were cancelled or failed meanwhile
                continue
            try:
                program, args, plan = self._generation_program(rows)
                out = self._timed_call(program, args)
            except Exception as err:
                self._fail_rows(rows, err)
                self._last_ready = None
                continue
            events = []
            with self._lock:
                if self.layout.causal:  # from each row's prompt end
                    answers = out["answers"]
                else:
                    answers = out["tokens"][:, plan.prompt_len :]
                for i, row in enumerate(rows):
                    # its blocks' answer tokens (the first block's less the prompt's tail)
                    tail = self.layout.tail(len(row.request.prompt_ids))
                    for start in range(-tail, row.answer_length, self.block_length):
                        if row.cancelled or row.done:
                            break
                        block = answers[i, max(start, 0) : start + self.block_length].tolist()
                        events += self._block_events(row, block)
                self._running = []
                self.metrics.running_rows.set(0)
            self._send(events)

    def _static_batch(self) -> list[_Row]:
        """The first waiting row and, in the queue's order (`_enqueue`), the waiting rows that
        can share its program (`_static_fits`), up to `max_batch` (lock held)."""
        rows: list[_Row] = []
        for row in list(self._waiting):
            if len(rows) == self.config.max_batch:
                break
            if not rows or self._static_fits([*rows, row]):
                self._waiting.remove(row)
                rows.append(row)
        self.metrics.queue_depth.set(len(self._waiting))
        self._observe_queue_time(rows)
        return rows

    def _static_fits(self, rows: list[_Row]) -> bool:
        """Whether rows can share one whole-generation program: their longest prompt and
        longest answer together within the longest sequence (each fits alone: `submit`),
        and, for a bidirectional family, one answer length: there a row's masks attend to
        each other, so its tokens depend on how many there are (block-causal rows' do
        not)."""
        prompt = max(len(r.request.prompt_ids) for r in rows)
        if not self.layout.causal and len({r.answer_length for r in rows}) > 1:
            return False
        return prompt + max(r.answer_length for r in rows) <= self._max_sequence

    def _generation_program(self, rows: list[_Row]) -> tuple[Any, tuple, Plan]:
        """The whole-generation program for a static batch, its arguments and plan. The
        batch is padded to its bucket with copies of its first row (they stop with it); its
        answer length is the longest request's (block-causal rows: rounded up to a power of
        two blocks where that fits, which leaves their tokens as they are); its prompt
        length is the longest prompt's, rounded up to a sequence bucket (more left padding)
        where that fits beside the answer. Rounding keeps the number of shapes, and so of
        compiles while serving, small."""
        n = len(rows)
        batch = layout.bucket(n, self.batch_buckets)
        padded = rows + [rows[0]] * (batch - n)
        prompt = max(len(r.request.prompt_ids) for r in rows)
        answer = max(r.answer_length for r in rows)
        blocks = math.ceil(answer / self.block_length)
        rounded = self.block_length * 2 ** math.ceil(math.log2(blocks))
        if self.layout.causal and prompt + rounded <= self._max_sequence:
            answer = rounded
        bucketed = next((s for s in layout.SEQ_BUCKETS if s >= prompt), prompt)
        if bucketed + answer <= self._max_sequence:
            prompt = bucketed
        g = self.config.generation
        config = dataclasses.replace(
            g,
            gen_length=answer,
            steps=self.config.steps_per_block * math.ceil(answer / self.block_length),
            stop_ids=tuple(sorted(self.stop_ids)),
            early_stop=not any(r.request.ignore_eos for r in rows),
        )
        prompts = [list(r.request.prompt_ids) for r in padded]
        sampling = any(r.request.temperature > 0 for r in rows)
        pad_id = self.model.config.pad_token_id
        steps = None
        if self.layout.causal:  # every row's blocks take its own steps (`_block_steps`)
            config = dataclasses.replace(config, steps=None)
            plan, _ = block_diffusion.make_plan(self.model, config, prompts)
            plan = dataclasses.replace(plan, sampling=sampling)
            inputs = block_diffusion.layout(prompts, plan, pad_id)
            run = block_diffusion.run_block_diffusion
            steps = self._block_steps(padded, batch)
        else:
            plan, _ = djax_engine.make_plan(self.model, config, batch, prompt)
            plan = dataclasses.replace(plan, sampling=sampling)
            inputs = djax_engine.build_inputs(prompts, plan, pad_id)
            run = run_generation
        per_row = Rows(
            np.stack([r.keys for r in padded]),
            np.array([r.threshold for r in padded], np.float32),
            np.array([r.request.temperature for r in padded], np.float32),
            steps,
            *self._filters(
                np.array([r.request.top_k for r in padded], np.int32),
                np.array([r.request.top_p for r in padded], np.float32),
            ),
        )
        placed = djax_engine.place(
            self.model, [inputs["tokens"], inputs["key_valid"], inputs["positions"]]
        )
        args = (self.model.params, *placed, djax_engine.place(self.model, per_row))
        program, seconds = djax_engine.executable(self.model, plan, args, run)
        if seconds:
            self.metrics.compiles.inc()
        return program, args, plan


# A Hopper GPU's bf16 matrix rate over its memory bandwidth (~990 TFLOP/s / 3.35 TB/s),
# FLOP per byte: the compute that takes as long as reading a byte.
RIDGE_FLOP_PER_BYTE = 300


def check_filters(request: EngineRequest, logits_chunk: int) -> None:
    """A ValueError naming a request's top_k or top_p that are not valid limits, or that
    filter where the server computes its logits in chunks (`logits_chunk`)."""
    top_k, top_p = request.top_k, request.top_p
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k < 2**31:
        raise ValueError(f"top_k={top_k!r}; expected an int ≥ 0 below 2**31 (0: none)")
    if not (isinstance(top_p, int | float) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}; expected a number in (0, 1] (1: none)")
    if logits_chunk and samples_filtered(request.temperature, top_k, top_p):
        raise ValueError(
            f"top_k={top_k}, top_p={top_p}: this server computes a step's logits in chunks "
            f"of {logits_chunk} ids, and the filters need them whole"
        )


def weight_read_tokens(model: Model) -> int:
    """How many tokens' compute take as long as one forward's read of the weights: a
    forward reads every weight once (all experts of a MoE layer, for a block's tokens) and
    spends 2 FLOP per active weight on each token, so (ridge × 2 bytes × all weights) /
    (2 × active weights) with 16-bit weights."""
    cfg = model.config
    total = active = 0
    for leaf in jax.tree.leaves(model.params):
        total += leaf.size
        is_experts = cfg.is_moe and leaf.ndim >= 3 and leaf.shape[0] == cfg.n_experts
        active += leaf.size * cfg.experts_per_token // cfg.n_experts if is_experts else leaf.size
    return RIDGE_FLOP_PER_BYTE * total // max(active, 1)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def make_engine(model: Model, config: ServeConfig, metrics: ServerMetrics) -> ServingEngine:
    """The engine for `config.scheduler`, not started."""
    if config.scheduler == "phase":
        from djax.serving.phase import PhaseEngine  # it builds on this module

        return PhaseEngine(model, config, metrics)
    return ServingEngine(model, config, metrics)
