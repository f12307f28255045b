"""Sweep of XLA compiler options at the `bench/generate.py` setting (batch 1, prompt 128,
gen 256, block 32, dual cache, 4 tokens per forward), on one device or a TP/EP mesh.

Each variant is a set of options passed to the engine's compiles through
`DJAX_XLA_OPTIONS` (`djax.xla_options`); every variant compiles its own programs. For each
one: tokens/s, ms per forward and the block-forward ms by difference (`bench.parallel`),
and the tokens of the generation, which must equal the default variant's (an option that
changes the answer is reported, not hidden).

    python -m bench.flags [--models dense moe] [--variants default ...] [--devices N] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from bench.common import model_config, save
from bench.parallel import SETTING, measure
from djax import Model, generate
from djax.models import init_params
from djax.sharding import make_mesh, param_shardings
from djax.xla_options import ENV

COMMAND_BUFFER_DEFAULT = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS: dict[str, str] = {
    "default": "",
    "no_command_buffer": "xla_gpu_enable_command_buffer=",
    "command_buffer_loops": (
        f"xla_gpu_enable_command_buffer={COMMAND_BUFFER_DEFAULT},DYNAMIC_SLICE_FUSION,"
        "WHILE,CONDITIONAL xla_gpu_graph_min_graph_size=1"
    ),
    "no_triton_gemm": "xla_gpu_enable_triton_gemm=false",
    "latency_hiding": "xla_gpu_enable_latency_hiding_scheduler=true",
    "one_shot_all_reduce": "xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true",
    "ragged_dot_fusion": "xla_gpu_experimental_use_ragged_dot_fusion=true",
    "ragged_dot_grouped_gemm": "xla_gpu_experimental_use_ragged_dot_grouped_gemm=true",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument(
        "--extra", action="append", default=[], help="NAME=OPTIONS: a variant of your own"
    )
    parser.add_argument("--devices", type=int, default=1, help="TP (dense) / EP (MoE) size")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moe-impl", default="auto")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants}
    variants.update(dict(item.split("=", 1) for item in args.extra))
    prompt = np.arange(10, 10 + args.prompt_len).tolist()
    rows = []
    for name in args.models:
        config = model_config(name, args.tiny)
        n = args.devices
        split = {"expert_parallel": n} if config.is_moe else {"tensor_parallel": n}
        mesh = make_mesh(**split) if n > 1 else None
        shardings = param_shardings(config, jnp.bfloat16, mesh) if mesh else None
        params = init_params(config, jnp.bfloat16, seed=0, shardings=shardings)
        options = (("moe_impl", args.moe_impl),) if config.is_moe else ()
        model = Model(config, params, None, jnp.bfloat16, mesh=mesh, options=options)
        reference = None
        for label, text in variants.items():
            os.environ[ENV] = text
            row = {"model": name, "variant": label, "options": text, "devices": n, **split}
            try:
                row.update(measure(model, prompt, SETTING, args.repeats))
                tokens = generate(model, [prompt], SETTING).answer_ids
                reference = tokens if reference is None else reference
                row["tokens_match_first_variant"] = bool(np.array_equal(tokens, reference))
            except Exception as err:  # keep the other variants of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            print(row, flush=True)
            rows.append(row)
        os.environ.pop(ENV, None)
        del model, params
    save("flags", {"setting": dataclasses.asdict(SETTING), "options": vars(args), "results": rows})


if __name__ == "__main__":
    main()
