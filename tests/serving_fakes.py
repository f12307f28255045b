"""A stand-in engine for the HTTP tests: `FakeEngine` answers each request with scripted
events from a thread, without a model, so the HTTP layer's cases (errors, queue bounds,
disconnects, failures) can be played exactly. `Collector` gathers a real engine's events
per request for the engine tests."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable

from djax.serving.engine import ServeConfig
from djax.serving.requests import (
    BlockCommitted,
    EngineRequest,
    EngineStopped,
    Event,
    Failed,
    Finished,
    QueueFull,
)


def scripted(tokenizer, text: str, reason: str = "stop") -> Callable[[EngineRequest], list]:
    """A script answering `text` (cut at max_tokens), one block of `block` tokens per
    event, then Finished (`length` when cut, else `reason`)."""

    def script(request: EngineRequest, block: int) -> list[Event]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = ids[: request.max_tokens]
        events = [BlockCommitted(tuple(cut[i : i + block])) for i in range(0, len(cut), block)]
        finish = "length" if len(ids) > request.max_tokens else reason
        return [*events, Finished(finish, len(cut))]

    return script


class FakeEngine:
    """The `ServingEngine` interface without a model. Each request gets the events
    `script(request, block_length)` returns, one per `interval` seconds, from a thread of
    its own, until cancelled; while `release` is clear requests wait (queued). `full`:
    submit raises QueueFull; once stopped, EngineStopped. `submitted` and `cancelled`
    record what the server asked."""

    def __init__(self, config: ServeConfig, script, *, max_sequence: int = 128):
        self.config = config
        self.max_sequence = max_sequence
        self.script = script
        self.interval = 0.0
        self.ready = False
        self.full = False
        self.release = threading.Event()
        self.release.set()
        self.submitted: list[EngineRequest] = []
        self.cancelled: list[str] = []
        self.stopped = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self.ready = True

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        self.stopped = True
        self.release.set()
        for thread in self._threads:
            thread.join(timeout)

    def answer_length(self, max_tokens: int, prompt_length: int) -> int:
        block = self.config.generation.block_length
        return block * math.ceil(max_tokens / block)

    def submit(self, request: EngineRequest, on_event: Callable[[Event], None]) -> None:
        if self.stopped:
            raise EngineStopped("the engine is stopping or has stopped")
        if self.full:
            raise QueueFull(depth=self.config.max_queue, retry_after=1.5)
        if request.max_tokens > 1000:
            raise ValueError(f"max_tokens={request.max_tokens}; the fake serves ≤ 1000")
        events = self.script(request, self.config.generation.block_length)
        with self._lock:
            self.submitted.append(request)
        thread = threading.Thread(target=self._run, args=(request.request_id, events, on_event))
        self._threads.append(thread)
        thread.start()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)

    def _run(self, request_id: str, events: list[Event], on_event) -> None:
        self.release.wait()
        for event in events:
            time.sleep(self.interval)
            with self._lock:
                if request_id in self.cancelled:
                    return
            on_event(event)


class Collector:
    """Events per request id, and a wait for the last one."""

    def __init__(self):
        self.events: dict[str, list] = {}
        self.ended: queue.Queue = queue.Queue()

    def sink(self, request_id):
        def on_event(event):
            self.events.setdefault(request_id, []).append(event)
            if isinstance(event, (Finished, Failed)):
                self.ended.put(request_id)

        return on_event

    def wait(self, n, timeout=120):
        return {self.ended.get(timeout=timeout) for _ in range(n)}

    def tokens(self, request_id):
        events = self.events[request_id]
        return [t for e in events if isinstance(e, BlockCommitted) for t in e.token_ids]
