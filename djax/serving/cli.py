"""`djax serve`: the subcommand's options (`add_parser`) and what it runs (`run`).

Every `GenerationConfig` field is an option, as for `djax generate`: they set the
server-wide defaults (`--gen-length` is the default `max_tokens`). With no `--model` the
demo model is served, with the answer layout it was trained for.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

DEMO_NAME = "djax-demo"


def add_parser(
    commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> argparse.ArgumentParser:
    """Register `serve` on the `djax` command's subparsers (`parents`: the options every
    command shares)."""
    from djax.cli import _add_generation_options, _add_model_options

    serve = commands.add_parser(
        "serve",
        parents=parents,
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API with continuous "
        "batching at block boundaries. SIGINT or SIGTERM drains the running requests and "
        "exits 0.",
    )
    _add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument(
        "--served-model-name",
        help=f"the model id clients name (default: the folder's name; {DEMO_NAME} for the demo)",
    )
    serve.add_argument(
        "--scheduler",
        default="continuous",
        choices=("continuous", "phase", "static"),  # engine.SCHEDULERS, without importing jax
        help="continuous: requests join and leave the batch at block boundaries (sooner "
        "answers below saturation); phase: each device call mixes some rows' refreshes with "
        "the decoding rows' cached steps, over K/V kept on the device between calls (more "
        "answer tokens at saturation); static: a batch runs until all its requests finish "
        "(default: continuous)",
    )
    serve.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),  # engine.SCHEDULING_POLICIES
        help="the order waiting requests get a row: fcfs, by arrival (a request's priority "
        "must be 0); priority, by the request's priority field, lower first, then by arrival; "
        "a running request keeps its row (default: fcfs)",
    )
    serve.add_argument(
        "--phase-tokens",
        type=int,
        default=0,
        help="phase scheduler: tokens a call, every row's block plus the refreshing rows' "
        "sequences (default: 0, room for two of the longest rows beside the steps)",
    )
    serve.add_argument(
        "--max-batch",
        "--max-num-seqs",  # vLLM's name
        type=int,
        default=32,
        help="requests decoded together (default: 32)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests waiting for a batch row; beyond it, 429 (default: 1024)",
    )
    serve.add_argument(
        "--max-seq-len",
        "--max-model-len",  # vLLM's name
        type=int,
        help="longest prompt + answer served (default: the model's maximum)",
    )
    serve.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of the memory JAX may allocate on each device that the server may use, "
        "weights included (djax serve gives JAX's allocator 95%% of each GPU unless "
        "XLA_CLIENT_MEM_FRACTION sets it); a block call (batch, sequence) runs only where its "
        "compiled program fits beside the weights, otherwise requests wait, and one that "
        "cannot fit alone is refused (default: 0.9; no budget where the device reports no "
        "memory, as on the CPU)",
    )
    serve.add_argument(
        "--sampling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve temperature > 0; its programs are compiled at start, so --no-sampling "
        "halves the warm-up (default: on)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("DJAX_API_KEY"),
        help="serve only requests with the header 'Authorization: Bearer <key>' (all but "
        "/health and /metrics; default: $DJAX_API_KEY; unset: an open server)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default: info)",
    )
    _add_generation_options(serve)
    return serve


def run(args: argparse.Namespace) -> int:
    """Load the model and serve it until SIGINT or SIGTERM; 0 on a requested shutdown, 2
    on an error the user can fix, 1 when the engine failed (both printed)."""
    from djax import demo
    from djax.cli import _generation_config, _load
    from djax.generation import generation_defaults
    from djax.serving.engine import ServeConfig
    from djax.serving.memory import size_device_pool
    from djax.serving.server import listen, serve

    size_device_pool()  # before loading starts JAX's backend

    # The engine's progress (programs compiled, ready) is what a server's operator reads.
    logging.getLogger("djax.serve").setLevel(logging.ERROR if args.quiet else logging.INFO)
    # CPUs cannot reuse a donated buffer: said once per compiled program, it says nothing.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    try:
        listen(args.host, args.port).close()  # a busy port fails now, not after loading
        path = args.model or str(demo.default_model_path())
        label = demo.describe(path)  # None unless the folder holds a demo model
        config = ServeConfig(
            generation=_generation_config(args, generation_defaults(path)),
            scheduler=args.scheduler,
            scheduling_policy=args.scheduling_policy,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            max_seq_len=args.max_seq_len,
            sampling=args.sampling,
            memory_fraction=args.memory_fraction,
            phase_tokens=args.phase_tokens,
        )
        name = args.served_model_name or (DEMO_NAME if label else Path(path).name)
        from djax.engine import enable_compile_cache

        enable_compile_cache()  # a bad cache setting fails now, and the load's programs use it
        model = _load(args, path, progress=False)
        serve(
            model,
            config,
            host=args.host,
            port=args.port,
            model_name=name,
            log_level=args.log_level,
            api_key=args.api_key,
        )
    except (ValueError, FileNotFoundError, OSError, TypeError) as err:
        print(f"djax: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the engine failed while serving or warming up
        print(f"djax: error: {err}", file=sys.stderr)
        return 1
    return 0
