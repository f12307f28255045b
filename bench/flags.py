"""Sweep of XLA compiler options at the `bench/generate.py` setting (batch 1, prompt 128,
gen 256, block 32, dual cache, 4 tokens per forward), on one device or a TP/EP mesh.

Each variant is the set of XLA options the engine compiles with (`djax.xla_options`), on
top of XLA's own defaults; every variant compiles its own programs. `engine` is what djax
ships: its `DEFAULTS` and, for fp8 models, the fp8 rule (`FP8_WITHOUT_EXPERTS`); every other
variant replaces both (so `command_buffer_loops` is the engine's without the fp8 rule). For each
one: tokens/s, ms per forward and the block-forward ms by difference (`bench.parallel`),
and the tokens of the generation, which must equal the default variant's (an option that
changes the answer is reported, not hidden).

    python -m bench.flags [--models dense moe] [--variants engine ...] [--devices N]
        [--weights dtype|fp8] [--routing model|spread]
        [--with "OPTION=VALUE ..."] [--extra "NAME=OPTION=VALUE ..."] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax
import numpy as np

from bench.common import ROUTINGS, SETTING, bench_model, model_config, save, use_routing
from bench.parallel import measure
from djax import xla_options

# Each variant is the whole option set on top of XLA's own defaults; `engine` is what djax
# ships (`djax.xla_options.DEFAULTS`).
VARIANTS: dict[str, dict] = {
    "engine": dict(xla_options.DEFAULTS["gpu"]),
    "xla_defaults": {},
    "no_command_buffer": {"xla_gpu_enable_command_buffer": ""},
    "command_buffer_loops": xla_options.COMMAND_BUFFER_LOOPS,
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
    "latency_hiding": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "one_shot_all_reduce": {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True},
    "ragged_dot_fusion": {"xla_gpu_experimental_use_ragged_dot_fusion": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument(
        "--extra", action="append", default=[], help="NAME=OPTIONS: a variant of your own"
    )
    parser.add_argument(
        "--with", dest="common", default="", help="OPTIONS added to every variant but engine"
    )
    parser.add_argument("--devices", type=int, default=1, help="TP (dense) / EP (MoE) size")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moe-impl", default="auto")
    parser.add_argument("--weights", choices=["dtype", "fp8"], default="dtype")
    parser.add_argument("--routing", choices=ROUTINGS, default="model", help="see use_routing")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    use_routing(args.routing)
    common = xla_options.parse(args.common)
    variants = {
        name: VARIANTS[name] if name == "engine" else {**common, **VARIANTS[name]}
        for name in args.variants
    }
    for item in args.extra:
        name, text = item.split("=", 1)
        variants[name] = {**common, **xla_options.parse(text)}
    prompt = np.arange(10, 10 + args.prompt_len).tolist()
    platform = jax.default_backend()
    os.environ.pop(xla_options.ENV, None)
    shipped = {
        table: dict(getattr(xla_options, table).get(platform, {}))
        for table in ("DEFAULTS", "FP8_WITHOUT_EXPERTS")
    }
    rows = []
    for name in args.models:
        config = model_config(name, args.tiny)
        module_options = (("moe_impl", args.moe_impl),) if config.is_moe else ()
        model, split = bench_model(config, args.devices, module_options, args.weights)
        reference = None
        for label, options in variants.items():
            engine = label == "engine"
            options = shipped["DEFAULTS"] if engine else options
            fp8_rule = shipped["FP8_WITHOUT_EXPERTS"] if engine else {}
            xla_options.DEFAULTS[platform] = options
            xla_options.FP8_WITHOUT_EXPERTS[platform] = fp8_rule
            row = {
                "model": name,
                "weights": args.weights,
                "variant": label,
                "options": options,
                "fp8_rule": fp8_rule,
                "devices": args.devices,
                **split,
            }
            try:
                row.update(measure(model, prompt, SETTING, args.repeats))
                tokens = row.pop("answer_ids")
                reference = tokens if reference is None else reference
                row["tokens_match_first_variant"] = bool(np.array_equal(tokens, reference))
            except Exception as err:  # keep the other variants of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
            print(row, flush=True)
            rows.append(row)
        del model
    payload = {"setting": dataclasses.asdict(SETTING), "options": vars(args), "results": rows}
    spread = "spread" if args.routing == "spread" else None
    setting = "_".join(x for x in (spread, "fp8" if args.weights == "fp8" else None) if x)
    save("flags", payload, setting or None)


if __name__ == "__main__":
    main()
