"""What the HTTP layer hands the engine, and what the engine hands back.

The engine (`djax.serving.engine`) runs in its own thread. The HTTP layer submits an
`EngineRequest` with a callback; the engine calls it, from its thread, with one event per
committed block (`BlockCommitted`), then exactly one `Finished` or `Failed`. After
`cancel(request_id)` the callback is called no more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple, Protocol


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One generation. prompt_ids: the tokenised prompt (chat template applied);
    max_tokens: answer tokens wanted (≥ 1; the engine denoises whole blocks and never returns
    more); temperature: 0 is argmax; seed: the request's own randomness (its tokens never
    depend on its batch-mates); threshold: τ of the threshold decoder, None for the
    server's default; ignore_eos: keep denoising past stop tokens up to max_tokens (for
    benchmarks with fixed output lengths); top_k (0: none) and top_p (1: none): the limits
    on a sampled token (`djax.decoders.Filters`; at temperature 0 they change nothing);
    priority: where it waits for a row under the `priority` scheduling policy, lower
    first (`ServeConfig.scheduling_policy`)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    threshold: float | None = None
    ignore_eos: bool = False
    top_k: int = 0
    top_p: float = 1.0
    priority: int = 0


class BlockCommitted(NamedTuple):
    """A decoded block's tokens, final (a dLLM never re-masks a committed token); cut
    before the first stop token and at max_tokens, so it may be empty."""

    token_ids: tuple[int, ...]


class Finished(NamedTuple):
    """The request is done: `stop` (a stop token was generated) or `length` (max_tokens);
    `completion_tokens` counts the answer's tokens and the stop token that ended it (sent
    in no `BlockCommitted`), as vLLM's usage counts a generated EOS."""

    reason: Literal["stop", "length"]
    completion_tokens: int


class Failed(NamedTuple):
    """The engine could not finish this request; the server keeps serving the others."""

    message: str


Event = BlockCommitted | Finished | Failed


class QueueFull(Exception):
    """The waiting queue is at its bound; try again after `retry_after` seconds."""

    def __init__(self, depth: int, retry_after: float):
        super().__init__(f"the queue holds {depth} requests, its bound; retry later")
        self.depth = depth
        self.retry_after = retry_after


class EngineStopped(Exception):
    """The engine takes no more requests: it is stopping, or its thread ended."""


class OverBudget(ValueError):
    """A request whose block call would not fit the server's memory budget even alone."""

    code = "memory_budget_exceeded"


class Engine(Protocol):
    """What the HTTP layer needs of an engine (continuous or static scheduler)."""

    @property
    def ready(self) -> bool:
        """True once every program is compiled and the engine accepts requests."""

    @property
    def max_sequence(self) -> int:
        """The longest prompt + answer (answer rounded up to whole blocks) it serves."""

    def answer_length(self, max_tokens: int, prompt_length: int) -> int:
        """The answer positions a request of `max_tokens` after a prompt of
        `prompt_length` tokens occupies (whole blocks, less the prompt's tail in the first
        under block diffusion)."""

    def submit(self, request: EngineRequest, on_event: Callable[[Event], None]) -> None:
        """Queue a request (thread-safe). Raises `QueueFull`, `EngineStopped` once the
        engine is stopping or has stopped, or ValueError for a request
        it cannot serve (the message names the field; `OverBudget` for one over the memory
        budget)."""

    def cancel(self, request_id: str) -> None:
        """Drop a request, queued or running (thread-safe); its slot is free within two
        block calls and no more events are sent for it."""
