"""Running the server: `serve` (the `djax serve` process, in the foreground until SIGINT or
SIGTERM) and `running_server` / `running_app` (in a background thread, for tests and
benchmarks).

Shutdown drains: `/health` turns 503 and new requests are refused, uvicorn stops accepting
connections and waits for the requests in flight, then the engine stops (`drain=True`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from djax.model import Model
from djax.serving.api import create_app
from djax.serving.metrics import ServerMetrics

if TYPE_CHECKING:
    from djax.serving.engine import ServeConfig, ServingEngine


class _Server(uvicorn.Server):
    """uvicorn's server, which also marks the app draining when asked to exit, and exits
    quietly: the signal that asked is handled, not raised again after the shutdown."""

    def __init__(self, app: FastAPI, log_level: str):
        super().__init__(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for requests in flight
        else:
            self.should_exit = True


def default_model_name(model: Model) -> str:
    """The id clients name the model by: its folder's name."""
    return Path(model.path).name if model.path else "djax"


def _build(
    model: Model, config: ServeConfig, model_name: str, api_key: str | None = None
) -> tuple[ServingEngine, FastAPI]:
    from djax.serving.engine import make_engine

    metrics = ServerMetrics()
    engine = make_engine(model, config, metrics)
    app = create_app(engine, model, model_name=model_name, metrics=metrics, api_key=api_key)
    return engine, app


def freeze_when_ready(engine: ServingEngine) -> None:
    """Once the engine is warm, freeze what is alive (the model, the programs, the
    libraries) out of the cyclic garbage collector: it lives as long as the server
    process, and a full collection, which pauses every thread, then scans only what
    serving creates. For the `serve` process alone: in a process that goes on to do other
    work the frozen objects would never be collected."""
    if engine.wait_ready():
        gc.collect()
        gc.freeze()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); raises OSError naming them
    (ValueError for a port outside 0 to 65535)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port={port}; expected 0 to 65535 (0: a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as err:
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def serve(
    model: Model,
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    log_level: str = "info",
    api_key: str | None = None,
) -> None:
    """Serve `model` on http://host:port until SIGINT or SIGTERM, then drain and return.
    The engine compiles its programs in the background; `/health` is 503 until it is
    ready. An engine that fails (in its warm-up, say) ends the server: RuntimeError naming
    why. model_name: the id clients use (default: the model folder's name); api_key: the
    key every request but `/health` and `/metrics` must bear (`create_app`; None: open)."""
    name = model_name or default_model_name(model)
    engine, app = _build(model, config, name, api_key)  # a bad cache setting: no socket yet
    server = _Server(app, log_level)
    sock = listen(host, port)
    engine.start()
    threading.Thread(
        target=freeze_when_ready, args=(engine,), name="djax-freeze", daemon=True
    ).start()

    def end_with_the_engine() -> None:
        engine.join()
        if engine.failure is not None:
            app.state.draining = True
            server.should_exit = True

    threading.Thread(target=end_with_the_engine, name="djax-watch", daemon=True).start()
    logging.getLogger("uvicorn.error").info(
        "serving %r on http://%s:%d/v1%s (GET /health answers 503 until the engine is ready)",
        name,
        _url_host(host),
        sock.getsockname()[1],
        " to requests bearing the API key" if api_key else "",
    )
    try:
        server.run(sockets=[sock])
    finally:
        app.state.draining = True
        engine.stop(drain=True)
        sock.close()
    if engine.failure is not None:
        raise RuntimeError(f"the engine stopped: {engine.failure}") from engine.failure


@contextlib.contextmanager
def running_app(
    app: FastAPI, engine: ServingEngine, *, host: str = "127.0.0.1", port: int = 0
) -> Iterator[str]:
    """Run `app` over `engine` in a background thread; yields its base URL
    (`http://127.0.0.1:PORT`). The engine is started here and, on exit, drained and
    stopped after the server."""
    sock = listen(host, port)
    server = _Server(app, "warning")
    engine.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the server on {host}:{sock.getsockname()[1]} did not start")
            time.sleep(0.01)
        bound_host, bound_port = sock.getsockname()[:2]
        yield f"http://{_url_host(bound_host)}:{bound_port}"
    finally:
        app.state.draining = True
        server.should_exit = True
        thread.join()
        engine.stop(drain=True)
        sock.close()


@contextlib.contextmanager
def running_server(
    model: Model,
    config: ServeConfig,
    *,
    model_name: str | None = None,
    host: str = "127.0.0.1",
    ready_timeout: float = 600.0,
) -> Iterator[str]:
    """`serve` in a background thread on a free port: yields the base URL once the
    engine is ready (raises TimeoutError after `ready_timeout` seconds)."""
    engine, app = _build(model, config, model_name or default_model_name(model))
    with running_app(app, engine, host=host) as url:
        deadline = time.monotonic() + ready_timeout
        while not engine.ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not ready after {ready_timeout} s")
            time.sleep(0.05)
        yield url


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
