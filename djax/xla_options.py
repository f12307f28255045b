"""XLA compiler options the engine compiles its programs with.

`DEFAULTS` holds the options djax sets itself, per backend platform, each chosen from a
measured sweep (`bench/flags.py`, results in `bench/results/flags_*`), and
`FP8_WITHOUT_EXPERTS` those it adds for fp8 products in models without experts
(`compiler_options` says which program takes which). A user can add or
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

# On GPUs, for a model of fp8 weights without experts whose fp8 products XLA runs as fp8 x
# fp8 (`scaled`): XLA's Triton GEMM fusions off, so those products (refreshes, forwards of
# more than a block's rows) are cuBLASLt's, whose algorithms XLA's autotuner times without
# compiling a Triton kernel per candidate tiling. Autotuning those fusions took most of such
# a program's compile, for cuBLASLt's speed; with experts (LLaDA-MoE) the fusions run
# faster, so they stay. Autotuning off instead (`xla_gpu_autotune_level=0`) leaves fp8
# products on untimed defaults, several times slower. Figures: bench/NOTES.md ("fp8
# weights", the fp8 programs' compile).
FP8_WITHOUT_EXPERTS: dict[str, dict[str, Value]] = {
    "gpu": {"xla_gpu_enable_triton_gemm": False},
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


def compiler_options(
    platform: str, fp8: str = "no", experts: bool = False, loops: bool = True
) -> dict[str, Value]:
    """The options for a new compile on `platform` ("cpu", "gpu", ...) of a program whose
    fp8 products left to XLA take `fp8` (`Kernels.fp8`: "no" without fp8 weights,
    "scaled" or "dequant"), of a model with or without expert layers (`experts`): djax's
    defaults (`DEFAULTS`, for programs that run their forwards in loops, `loops`; the phase
    scheduler's one-forward call takes XLA's own), with `scaled` fp8 products and no experts
    `FP8_WITHOUT_EXPERTS`'s (`dequant` keeps the Triton fusions that fold its conversion into
    the product), then the user's `DJAX_XLA_OPTIONS` over them."""
    options = dict(DEFAULTS.get(platform, {})) if loops else {}
    if fp8 == "scaled" and not experts:
        options.update(FP8_WITHOUT_EXPERTS.get(platform, {}))
    return {**options, **parse(os.environ.get(ENV, ""))}


def tables(platform: str) -> tuple:
    """Everything the options of a compile on `platform` are chosen from besides the program
    itself (its model and kernel choice): djax's tables for the platform and the user's
    `DJAX_XLA_OPTIONS`, as a hashable tuple, for an in-process program key."""
    chosen_from = (DEFAULTS, FP8_WITHOUT_EXPERTS)
    ours = tuple(tuple(sorted(table.get(platform, {}).items())) for table in chosen_from)
    return (*ours, tuple(sorted(parse(os.environ.get(ENV, "")).items())))


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
