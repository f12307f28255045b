"""The HTTP endpoints of `djax serve` (FastAPI): OpenAI's completions and chat completions,
streamed as server-sent events or whole, plus `/v1/models`, `/tokenize` and `/detokenize`,
`/health` and `/metrics`.

Each request is validated and tokenised here, submitted to the engine (one engine request
per choice: `n` of them), and fed by the engine's events: they arrive on the engine's thread
and are handed to each choice's asyncio queue with `loop.call_soon_threadsafe`. A stop
string ends only its choice; a client that goes away ends every choice of its request, and
a `Failed` event ends the request with an error; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from djax.engine import tokenize
from djax.generation import THRESHOLD_DECODERS, samples_filtered
from djax.model import Model
from djax.serving import protocol as p
from djax.serving.detokenize import Detokenizer
from djax.serving.metrics import ServerMetrics
from djax.serving.requests import (
    BlockCommitted,
    Engine,
    EngineRequest,
    EngineStopped,
    Event,
    Failed,
    Finished,
    QueueFull,
)

OPEN_PATHS = ("/health", "/metrics")  # served without the API key


class _ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


class _EngineFailed(Exception):
    """The request failed: the engine sent `Failed` for it, or the server's own handling of
    a choice raised (`_Generation.texts`)."""


class _Generation:
    """One submitted choice: its events (put on `queue` from the engine's thread), its
    detokenizer, and how it ended (`finish_reason`, `completion_tokens`). `times_ttft`: its
    first text is the request's time to first token (choice 0's)."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        request: EngineRequest,
        detokenizer: Detokenizer,
        arrival: float,
        times_ttft: bool = True,
    ):
        self.engine = engine
        self.metrics = metrics
        self.request = request
        self.detokenizer = detokenizer
        self.arrival = arrival
        self.times_ttft = times_ttft
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finish_reason: p.FinishReason | None = None
        self.completion_tokens = 0
        self.ended = False  # finished, failed or stopped: the engine holds it no more
        self.request_failed = False  # another choice of its request failed (`_merged`)
        self._loop = asyncio.get_running_loop()

    def on_event(self, event: Event) -> None:
        """The engine's callback (its thread)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the server has gone
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def submit(self) -> None:
        self.engine.submit(self.request, self.on_event)

    async def texts(self, watcher: asyncio.Future) -> AsyncIterator[str]:
        """The answer's new text, one piece per committed block that made some; then sets
        `finish_reason` and `completion_tokens`. Raises _ClientGone once `watcher` (the
        request's disconnect watch) is done, _EngineFailed on a `Failed` event or on an error
        of its own (the tokenizer's decode, say: the request fails rather than hangs). Unless
        the answer ended, the engine is told to drop the choice, which counts as an error
        where its request failed and as aborted otherwise."""
        try:
            while self.finish_reason is None:
                event = await _next(self.queue, watcher)
                if isinstance(event, Failed):
                    self.ended = True
                    self.metrics.requests.labels("error").inc()
                    raise _EngineFailed(event.message)
                first = not self.detokenizer.text
                text = self._take(event)
                if text:
                    if first and self.times_ttft:
                        self.metrics.ttft.observe(time.perf_counter() - self.arrival)
                    yield text
        except (_ClientGone, _EngineFailed):
            raise
        except Exception as err:  # any error of the server's own: fail the request, never hang
            self.request_failed = True
            raise _EngineFailed(f"{type(err).__name__}: {err}") from err
        finally:
            self.metrics.generated_tokens.inc(self.completion_tokens)
            if not self.ended:
                self.engine.cancel(self.request.request_id)
                if self.request_failed:
                    self.metrics.requests.labels("error").inc()
                else:
                    self.metrics.aborted.inc()

    def _take(self, event: BlockCommitted | Finished) -> str:
        """The text an event makes final; the answer's tokens: under a stop string those up
        to the one that completed it (`Detokenizer.tokens`), else the engine's count."""
        if isinstance(event, BlockCommitted):
            text = self.detokenizer.push(event.token_ids)
            self.completion_tokens = self.detokenizer.tokens
            if self.detokenizer.stopped:
                self.engine.cancel(self.request.request_id)
                self._end("stop")
            return text
        text = self.detokenizer.finish()
        stopped = self.detokenizer.stopped
        self.completion_tokens = self.detokenizer.tokens if stopped else event.completion_tokens
        self._end("stop" if stopped else event.reason)
        return text

    def _end(self, reason: p.FinishReason) -> None:
        self.finish_reason = reason
        self.ended = True
        self.metrics.requests.labels(reason).inc()


def _usage(generations: list[_Generation], prompt_tokens: int) -> p.Usage:
    """`prompt_tokens` (each prompt once), every choice's answer tokens."""
    return p.Usage.of(prompt_tokens, sum(g.completion_tokens for g in generations))


class _Piece(NamedTuple):
    """A choice's new text (None: the choice ended) and its answer tokens up to it."""

    index: int
    text: str | None
    tokens: int


async def _merged(generations: list[_Generation], watcher: asyncio.Future) -> AsyncIterator[_Piece]:
    """Each choice's new text as the choices make it, and a piece of text None as each ends;
    _ClientGone or _EngineFailed from any choice ends it, and the others are cancelled (each
    tells the engine to drop its row)."""
    queue: asyncio.Queue[_Piece | tuple[int, Exception]] = asyncio.Queue()

    async def feed(index: int, generation: _Generation) -> None:
        try:
            async with contextlib.aclosing(generation.texts(watcher)) as texts:
                async for text in texts:  # its count is the text's until the next is taken
                    queue.put_nowait(_Piece(index, text, generation.completion_tokens))
            queue.put_nowait(_Piece(index, None, generation.completion_tokens))
        except (_ClientGone, _EngineFailed) as err:
            queue.put_nowait((index, err))

    tasks = [asyncio.ensure_future(feed(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            piece = await queue.get()
            if not isinstance(piece, _Piece):
                error = piece[1]
                if isinstance(error, _EngineFailed):  # the request fails: its choices are errors
                    for generation in generations:
                        generation.request_failed = True
                raise error
            if piece.text is None:
                running -= 1
            yield piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _next(queue: asyncio.Queue[Event], watcher: asyncio.Future) -> Event:
    """The next event, or _ClientGone once `watcher` (the disconnect watch) is done."""
    get = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait((get, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        get.cancel()  # no-op once it is done
    if get.done() and not get.cancelled():
        return get.result()
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is already read, so
    the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


class _Format:
    """How one endpoint writes chunks and whole answers; a choice is (text, finish reason)."""

    prefix: str

    def __init__(self, request_id: str, created: int, model: str):
        self.id, self.created, self.model = request_id, created, model

    def chunk(self, index: int, text: str, finish_reason: p.FinishReason | None) -> BaseModel: ...

    def usage_chunk(self, usage: p.Usage) -> BaseModel: ...

    def whole(self, choices: list[tuple[str, p.FinishReason]], usage: p.Usage) -> BaseModel: ...


class _CompletionFormat(_Format):
    prefix = "cmpl"

    def _of(self, choices: list[p.CompletionChoice], usage: p.Usage | None) -> BaseModel:
        return p.Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def chunk(self, index: int, text: str, finish_reason: p.FinishReason | None) -> BaseModel:
        choice = p.CompletionChoice(index=index, text=text, finish_reason=finish_reason)
        return self._of([choice], None)

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return self._of([], usage)

    def whole(self, choices: list[tuple[str, p.FinishReason]], usage: p.Usage) -> BaseModel:
        return self._of(
            [
                p.CompletionChoice(index=i, text=text, finish_reason=reason)
                for i, (text, reason) in enumerate(choices)
            ],
            usage,
        )


class _ChatFormat(_Format):
    prefix = "chatcmpl"

    def __init__(self, request_id: str, created: int, model: str):
        super().__init__(request_id, created, model)
        self._role_sent: set[int] = set()  # the choices whose first chunk went out

    def chunk(self, index: int, text: str, finish_reason: p.FinishReason | None) -> BaseModel:
        delta = p.Delta(content=text)
        if index not in self._role_sent:
            delta.role = "assistant"
            self._role_sent.add(index)
        choice = p.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
        return p.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, choices: list[tuple[str, p.FinishReason]], usage: p.Usage) -> BaseModel:
        return p.ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                p.ChatChoice(
                    index=i, message=p.AssistantMessage(content=text), finish_reason=reason
                )
                for i, (text, reason) in enumerate(choices)
            ],
            usage=usage,
        )


def create_app(
    engine: Engine,
    model: Model,
    *,
    model_name: str,
    metrics: ServerMetrics,
    api_key: str | None = None,
) -> FastAPI:
    """The server's ASGI app. engine: started by the caller (it also has `config`, the
    server's `ServeConfig`, whose generation settings give the request defaults); model:
    its tokenizer and config; model_name: the one model id clients name; api_key: when
    set, every request but `/health` and `/metrics` must carry `Authorization: Bearer
    <api_key>` (401 otherwise).
    `app.state.draining = True` makes `/health` answer 503 and new requests be refused.
    Raises ValueError when the default answer (`gen_length`) leaves no room for a prompt."""
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty; expected a key, or None for an open server")
    if model.tokenizer is None:
        raise ValueError(
            f"{model.path}: has no tokenizer; djax serve needs one to read prompts and "
            "write answers"
        )
    defaults = engine.config.generation
    limit = engine.max_sequence
    if engine.answer_length(defaults.gen_length, 1) + 1 > limit:
        most = next(n for n in range(limit - 1, 0, -1) if engine.answer_length(n, 1) < limit)
        raise ValueError(
            f"gen_length={defaults.gen_length} (the default max_tokens) leaves no room for a "
            f"prompt in this server's maximum sequence of {limit} tokens; expected at most {most}"
        )
    created = int(time.time())
    body_limit = p.body_limit(engine.max_sequence)
    # Tokenising (and chat templates) run here, one request at a time, off the event loop:
    # a long prompt never holds up the streams of others.
    tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="djax-tokenize")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn, *args)

    async def read_body(request: Request) -> bytes:
        """The body, refused with a 413 once it passes `body_limit` bytes (by its declared
        length before reading anything, else as it arrives)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > body_limit:
            raise too_large(f"{int(declared)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > body_limit:
                raise too_large(f"over {body_limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def too_large(size: str) -> p.ProtocolError:
        return p.ProtocolError(
            f"the request body holds {size}; this server reads at most {body_limit} bytes "
            f"(room for {p.MAX_PROMPTS} prompts of its whole {engine.max_sequence}-token "
            "sequence)",
            status=413,
            code="request_too_large",
        )

    app = FastAPI(title="djax", description="OpenAI-compatible serving of diffusion LMs")
    app.state.draining = False

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _authorised(request: Request, call_next):
            given = request.headers.get("authorization", "").encode()
            if request.url.path not in OPEN_PATHS and not secrets.compare_digest(given, expected):
                error = p.ProtocolError(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                    "with the key this server was started with (djax serve --api-key)",
                    status=401,
                    code="invalid_api_key",
                )
                return JSONResponse(error.body(), status_code=401)
            return await call_next(request)

    @app.exception_handler(p.ProtocolError)
    async def _refused(request: Request, err: p.ProtocolError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        error = p.ProtocolError(str(err.detail), status=err.status_code, kind=kind)
        return JSONResponse(error.body(), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _crashed(request: Request, err: Exception) -> JSONResponse:
        error = p.ProtocolError(
            f"internal error: {type(err).__name__}: {err}", status=500, kind="server_error"
        )
        return JSONResponse(error.body(), status_code=500)

    def check_model(name: str | None) -> None:
        if name and name != model_name:  # none or "" (as vLLM takes it): the served model
            raise p.ProtocolError(
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def check_prompt(ids: list[int], param: str) -> None:
        cfg = model.config
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise p.ProtocolError(
                f"{param} holds token id {bad[0]}; expected ids in [0, {cfg.vocab_size})",
                param=param,
            )
        if cfg.mask_token_id in ids:
            raise p.ProtocolError(
                f"{param} holds the mask id {cfg.mask_token_id}; masks are only for the answer",
                param=param,
            )

    def check_length(ids: list[int], max_tokens: int, param: str) -> None:
        limit = engine.max_sequence
        answer = engine.answer_length(max_tokens, len(ids)) if max_tokens <= limit else max_tokens
        if len(ids) + answer > limit:
            raise p.ProtocolError(
                f"the prompt ({len(ids)} tokens) + the answer ({answer} positions for "
                f"max_tokens={max_tokens}) = {len(ids) + answer} exceeds this server's "
                f"maximum sequence of {limit} tokens; shorten the prompt or lower max_tokens",
                param=param,
                code="context_length_exceeded",
            )

    def default_answer(ids: list[int], param: str) -> int:
        """The answer tokens of a request that names none: the server's default
        (`--gen-length`), or as many as fit after a prompt too long for it (as OpenAI and
        vLLM cap an answer at the context left); a prompt that leaves no room is refused."""
        limit = engine.max_sequence
        tokens = min(defaults.gen_length, limit - len(ids))
        while tokens >= 1 and len(ids) + engine.answer_length(tokens, len(ids)) > limit:
            tokens -= 1
        if tokens < 1:
            raise p.ProtocolError(
                f"the prompt ({len(ids)} tokens) leaves no room for an answer in this "
                f"server's maximum sequence of {limit} tokens; shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        return tokens

    async def generate(
        http_request: Request,
        body: p.CompletionRequest | p.ChatCompletionRequest,
        prompts: list[list[int]],
        param: str,
        format_: type[_Format],
        arrival: float,
    ) -> Response:
        """`n` choices of each prompt in `prompts` (completions may send a batch), choice
        `k * n + j` the j-th of prompt k, with the seed `seed + k * n + j`."""
        if app.state.draining:
            raise p.ProtocolError("the server is shutting down", status=503, kind="server_error")
        if not engine.ready:
            raise p.ProtocolError(
                "the server is warming up (GET /health answers 200 once it is ready)",
                status=503,
                kind="server_error",
            )
        max_tokens = []  # each prompt's
        for k, ids in enumerate(prompts):
            named = param if len(prompts) == 1 else f"{param}.{k}"
            check_prompt(ids, named)
            if body.answer_tokens is None:
                max_tokens.append(default_answer(ids, named))
            else:
                check_length(ids, body.answer_tokens, named)
                max_tokens.append(body.answer_tokens)
        count = len(prompts) * body.n
        room = engine.config.max_queue + engine.config.max_batch
        if count > room:  # never admitted whole: not worth a retry
            raise p.ProtocolError(
                f"{len(prompts)} prompt(s) x n={body.n} = {count} choices exceed this server's "
                f"{engine.config.max_batch} rows and queue of {engine.config.max_queue} "
                "requests (djax serve --max-batch, --max-queue)",
                param="n" if body.n > 1 else param,
            )
        decoder = engine.config.generation.decoder
        if body.threshold is not None and decoder not in THRESHOLD_DECODERS:
            raise p.ProtocolError(
                f"threshold={body.threshold}; this server decodes with {decoder!r}, "
                f"which takes no threshold (only {', '.join(THRESHOLD_DECODERS)} do): "
                "expected none",
                param="threshold",
            )
        temperature = defaults.temperature if body.temperature is None else body.temperature
        if temperature > 0 and not engine.config.sampling:
            raise p.ProtocolError(
                f"temperature={temperature}; this server decodes greedily only (started "
                "without sampling): expected 0",
                param="temperature",
            )
        top_k = defaults.top_k if body.top_k is None else max(body.top_k, 0)  # -1: none
        top_p = defaults.top_p if body.top_p is None else body.top_p
        chunk = engine.config.generation.logits_chunk
        if chunk and samples_filtered(temperature, top_k, top_p):
            raise p.ProtocolError(
                f"top_k={top_k}, top_p={top_p}: this server computes a step's logits "
                f"{chunk} vocabulary ids at a time (--logits-chunk), and the "
                "filters need them whole: expected top_k 0 and top_p 1",
                param="top_p" if top_p < 1 else "top_k",
            )
        priority = body.priority or 0
        if priority and engine.config.scheduling_policy != "priority":
            raise p.ProtocolError(
                f"priority={priority}; this server admits requests first come, first served "
                "(started without --scheduling-policy priority): expected 0",
                param="priority",
            )
        seed = secrets.randbelow(p.SEED_LIMIT) if body.seed is None else body.seed
        request_id = f"{format_.prefix}-{uuid.uuid4().hex}"
        generations = [
            _Generation(
                engine,
                metrics,
                EngineRequest(
                    request_id=request_id if count == 1 else f"{request_id}-{i}",
                    prompt_ids=tuple(prompts[i // body.n]),
                    max_tokens=max_tokens[i // body.n],
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=(seed + i) % p.SEED_LIMIT,
                    threshold=body.threshold,
                    ignore_eos=body.ignore_eos,
                    priority=priority,
                ),
                Detokenizer(model.tokenizer, body.stop),
                arrival,
                times_ttft=i == 0,
            )
            for i in range(count)
        ]
        prompt_tokens = sum(len(ids) for ids in prompts)
        submit_all(generations)
        out = format_(request_id, int(time.time()), model_name)
        if body.stream:
            return StreamingResponse(
                _stream(
                    generations,
                    out,
                    http_request,
                    body.include_usage,
                    body.continuous_usage,
                    prompt_tokens,
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        watcher = asyncio.ensure_future(_disconnected(http_request))
        try:
            async with contextlib.aclosing(_merged(generations, watcher)) as pieces:
                async for _ in pieces:  # the detokenizers keep each choice's text
                    pass
        except _ClientGone:
            return Response(status_code=499)
        except _EngineFailed as err:
            raise _failure(str(err)) from None
        finally:
            watcher.cancel()
        metrics.e2e.observe(time.perf_counter() - arrival)
        choices = [(g.detokenizer.text, g.finish_reason) for g in generations]
        usage = _usage(generations, prompt_tokens)
        return JSONResponse(out.whole(choices, usage).model_dump())

    def submit_all(generations: list[_Generation]) -> None:
        """Every choice into the engine, or none: a refusal takes back those submitted."""
        submitted: list[_Generation] = []
        try:
            for generation in generations:
                generation.submit()
                submitted.append(generation)
        except (QueueFull, EngineStopped, ValueError) as err:
            for generation in submitted:
                generation.ended = True
                engine.cancel(generation.request.request_id)
            raise _refusal(err) from None

    async def _stream(
        generations: list[_Generation],
        out: _Format,
        http_request: Request,
        include_usage: bool,
        continuous_usage: bool,
        prompt_tokens: int,
    ) -> AsyncIterator[str]:
        """The chunks of a streamed answer; with `continuous_usage` each also carries its
        choice's usage so far (its prompt's tokens, its answer's up to the chunk)."""
        watcher = asyncio.ensure_future(_disconnected(http_request))
        try:
            async with contextlib.aclosing(_merged(generations, watcher)) as pieces:
                async for index, text, tokens in pieces:
                    generation = generations[index]
                    if text is None:  # the choice ended
                        chunk = out.chunk(index, "", generation.finish_reason)
                    else:
                        chunk = out.chunk(index, text, None)
                    if continuous_usage:
                        chunk.usage = p.Usage.of(len(generation.request.prompt_ids), tokens)
                    yield _sse(chunk)
            metrics.e2e.observe(time.perf_counter() - generations[0].arrival)
            if include_usage:
                yield _sse(out.usage_chunk(_usage(generations, prompt_tokens)))
        except _ClientGone:
            return
        except _EngineFailed as err:
            yield _sse(_failure(str(err)).body())
        finally:
            watcher.cancel()
        yield "data: [DONE]\n\n"

    def completion_ids(prompts: list[str | list[int]]) -> list[list[int]]:
        """The prompts as `djax generate` tokenises them (on the tokenising thread)."""
        try:
            return tokenize(model, prompts, chat=False)
        except ValueError as err:
            raise p.ProtocolError(str(err), param="prompt") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        body = p.parse(p.CompletionRequest, await read_body(request))
        check_model(body.model)
        prompts = await off_loop(completion_ids, list(body.prompt))
        return await generate(request, body, prompts, "prompt", _CompletionFormat, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        body = p.parse(p.ChatCompletionRequest, await read_body(request))
        check_model(body.model)
        ids = await off_loop(_chat_ids, model, [m.template_turn() for m in body.messages])
        return await generate(request, body, [ids], "messages", _ChatFormat, arrival)

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> JSONResponse:
        body = p.parse(p.TokenizeRequest, await read_body(request))
        check_model(body.model)
        if body.messages is not None:
            ids = await off_loop(_chat_ids, model, [m.template_turn() for m in body.messages])
        elif body.prompt:
            (ids,) = await off_loop(completion_ids, [body.prompt])
        else:
            ids = []  # the empty prompt: no tokens (the completions endpoint refuses it)
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": engine.max_sequence}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = p.parse(p.DetokenizeRequest, await read_body(request))
        check_model(body.model)
        vocab = model.config.vocab_size  # the ids a prompt may hold and the model may answer
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise p.ProtocolError(
                f"tokens holds id {bad[0]}; expected ids in [0, {vocab})", param="tokens"
            )
        text = await off_loop(model.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    def model_card() -> p.ModelCard:
        return p.ModelCard(id=model_name, created=created, max_model_len=engine.max_sequence)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(p.ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> JSONResponse:
        check_model(name)
        return JSONResponse(model_card().model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def _chat_ids(model: Model, turns: list[dict[str, str]]) -> list[int]:
    """The prompt of a chat, as `djax.engine.tokenize` writes one: the chat template with
    the assistant's header, tokenised without special tokens added."""
    try:
        text = model.tokenizer.apply_chat_template(
            turns, add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # jinja and transformers raise their own types
        raise p.ProtocolError(
            f"the model's chat template refused these messages: {err}", param="messages"
        ) from None
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _refusal(err: QueueFull | EngineStopped | ValueError) -> p.ProtocolError:
    """The engine's refusal of a submission, as the client sees it."""
    if isinstance(err, QueueFull):
        return p.ProtocolError(
            str(err),
            status=429,
            kind="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(max(1, math.ceil(err.retry_after)))},
        )
    if isinstance(err, EngineStopped):
        return p.ProtocolError(str(err), status=503, kind="server_error")
    return p.ProtocolError(str(err), code=getattr(err, "code", None))


def _failure(message: str) -> p.ProtocolError:
    return p.ProtocolError(
        f"the engine could not finish this request: {message}", status=500, kind="server_error"
    )
