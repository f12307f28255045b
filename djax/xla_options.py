"""XLA compiler options the engine compiles its programs with.

`DEFAULTS` holds the options djax sets itself, per backend platform, each chosen from a
measured sweep (`bench/flags.py`, results in `bench/results/flags_*`). A user can add or
override options through the `DJAX_XLA_OPTIONS` environment variable, read at each new
compile: `name=value` pairs separated by spaces (commas inside a value are kept), e.g.

    DJAX_XLA_OPTIONS="xla_gpu_enable_latency_hiding_scheduler=true xla_gpu_autotune_level=4"

These are per-program XLA debug options (the `--xla_*` flags without dashes); process-wide
settings such as NCCL's environment variables are not covered here.
"""

from __future__ import annotations

import os
import re
from typing import Any

ENV = "DJAX_XLA_OPTIONS"

Value = str | bool | int

# Whole while-loop and conditional bodies captured as CUDA graphs: +2.2% tokens/s on
# LLaDA-8B on an H200 with the same tokens (bench/results/flags_NVIDIA_H200_20261122_015905
# .json), within the run-to-run spread but never slower in any sweep.
COMMAND_BUFFER_LOOPS: dict[str, Value] = {
    "xla_gpu_enable_command_buffer": (
        "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
    ),
    "xla_gpu_graph_min_graph_size": 1,
}

DEFAULTS: dict[str, dict[str, Value]] = {
    "cpu": {},
    "gpu": dict(COMMAND_BUFFER_LOOPS),
}


def _value(text: str) -> Value:
    """XLA wants bools and ints typed: "true" -> True, "4" -> 4, anything else a string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def parse(text: str) -> dict[str, Value]:
    """`"a=4 b=true c=X,Y"` -> {"a": 4, "b": True, "c": "X,Y"}; raises ValueError naming a
    malformed item. An unknown option name is found at compile time (`compile_lowered`)."""
    options = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("xla_"):
            raise ValueError(f"{ENV}: {item!r} is not name=value with an XLA option name (xla_...)")
        options[name] = _value(value)
    return options


def compiler_options(platform: str) -> dict[str, Value]:
    """The options for a new compile on `platform` ("cpu", "gpu", ...): djax's defaults,
    then the user's `DJAX_XLA_OPTIONS` over them."""
    return {**DEFAULTS.get(platform, {}), **parse(os.environ.get(ENV, ""))}


def compile_lowered(lowered: Any, options: dict[str, Value]) -> Any:
    """`lowered.compile(options)`, where an option XLA rejects (an unknown name, a value of
    the wrong type or outside its enum) raises a one-line ValueError naming it and where it
    came from, instead of XLA's runtime error."""
    import jax

    try:
        return lowered.compile(options)
    except jax.errors.JaxRuntimeError as err:
        message = str(err).strip().partition("INVALID_ARGUMENT: ")[2].splitlines()
        if not message or not message[0].startswith(("No such compile option", "While setting")):
            raise
        name = re.search(r"xla_\w+", message[0])
        user_given = name is not None and name.group() in parse(os.environ.get(ENV, ""))
        source = ENV if user_given else "djax's XLA options"
        raise ValueError(f"{source}: {message[0]}") from None
