"""Probe: which Mosaic GPU kernels make a new shape's lowering slow?

Question. `bench.compile --profile` (H100, jax 0.11.2, 6f98a3d) lowered LLaDA-8B's generation
program at a new shape in 20.6 s (under cProfile), 16.3 s of it lowering its nine Mosaic GPU
kernel calls and 13.1 s of that in Mosaic GPU's layout inference (a constraint solver in
Python). The same program lowers for CUDA in ~1.5 s on a CPU host with jax 0.10.2. Which
kernels take the time, and is it the layout inference?

Answer (H100, jax 0.11.2; `bench/results/kernel_lowering_NVIDIA_H100_80GB_HBM3.json`, and
`logs/kernel_lowering_af851bf_…` before the fixes). Two kernels were the time, both in
layout inference: the SwiGLU gate/up product with the norm applied (6.83 s, 6.08 of it
layout inference), which added its 128 row tiles' sums of squares one written-out add
each, and the fused q/k/v + RoPE kernel (2.68 s; LLaDA-MoE's 2.70), whose epilogue was
written out once per kind of slot. Every other kernel lowered in 0.1-0.4 s. With the adds
in a loop and each epilogue step written once (19463bc, e01d2ba): 0.29 s and 0.76 s
(LLaDA-MoE's 1.58 s), the whole dense program's lowering 11.95 -> 3.21 s, and a new
shape's compile 33.7 -> 20.6 s (LLaDA-MoE 32.1 -> 27.5 s; `bench.compile`).

Method. Builds the generation program at the compared setting (`SETTING`, prompt 128, batch
1) with the kernels `auto` resolves on this device (abstract weights: nothing is allocated),
finds every Mosaic GPU kernel call in its jaxpr (nested programs too; one per kernel name
and operand shapes) and lowers each alone for this platform in a fresh `jax.jit`, `--repeats`
times. Prints and saves, per kernel, the median seconds of a lowering, the seconds of it
spent in layout inference, and the length of its lowered text; and the whole program's
trace and lower seconds for reference.

    python -m bench.probes.kernel_lowering [--models dense moe] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from bench.common import SETTING, model_config, save
from djax import engine, programs
from djax.model import Model
from djax.models import init_params

KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def kernel_calls(jaxpr: Any) -> Iterator[Any]:
    """Every kernel call (`KERNEL_PRIMITIVES`) in `jaxpr` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            yield eqn
        else:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from kernel_calls(sub)


def kernel_name(eqn: Any) -> str:
    """The kernel's own name where the call records it, else its primitive's."""
    for key in ("name_and_src_info", "debug_info", "name"):
        if key in eqn.params:
            info = eqn.params[key]
            return str(getattr(info, "name", None) or getattr(info, "func_name", None) or info)
    return eqn.primitive.name


def signature(eqn: Any) -> str:
    """The kernel name and its operands' shapes and dtypes."""
    shapes = ", ".join(f"{v.aval.dtype}{list(v.aval.shape)}" for v in eqn.invars)
    return f"{kernel_name(eqn)}({shapes})"


class LayoutTimer:
    """Seconds spent in Mosaic GPU's layout inference while active (best effort: wraps
    `infer_layout` where this jax version exposes it)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.patched: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> LayoutTimer:
        from jax.experimental.mosaic import gpu as mgpu

        for owner in (mgpu, getattr(mgpu, "layout_inference", None)):
            original = getattr(owner, "infer_layout", None)
            if original is None:
                continue

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            owner.infer_layout = timed
            self.patched.append((owner, "infer_layout", original))
        return self

    def __exit__(self, *_: Any) -> None:
        for owner, name, original in self.patched:
            setattr(owner, name, original)


def lower_alone(eqn: Any, platform: str) -> tuple[float, float, int]:
    """(seconds, of them in layout inference, lowered text length) of lowering this one
    kernel call in a fresh jit."""
    operands = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]

    def call(*xs):
        return eqn.primitive.bind(*xs, **eqn.params)

    with LayoutTimer() as layout:
        start = time.perf_counter()
        lowered = jax.jit(call).trace(*operands).lower(lowering_platforms=(platform,))
        seconds = time.perf_counter() - start
    return seconds, layout.seconds, len(lowered.as_text())


def probe(name: str, repeats: int) -> dict:
    config = model_config(name)
    params = jax.eval_shape(lambda: init_params(config, jnp.bfloat16, seed=0))
    model = Model(config, params, None, jnp.bfloat16)
    plan, _ = engine.make_plan(model, SETTING, 1, 128)
    kernels = engine.kernel_choice(model, plan)
    args = engine.program_args(model, plan, [list(range(10, 138))], SETTING)
    program = programs.row_program(model, plan, engine.run_generation, kernels)
    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    start = time.perf_counter()
    traced = program.trace(*args)
    traced_at = time.perf_counter()
    with LayoutTimer() as layout:
        traced.lower(lowering_platforms=(platform,))
    lowered_at = time.perf_counter()
    calls: dict[str, Any] = {}
    for eqn in kernel_calls(traced.jaxpr.jaxpr):
        calls.setdefault(signature(eqn), eqn)
    rows = []
    for sig, eqn in calls.items():
        runs = [lower_alone(eqn, platform) for _ in range(repeats)]
        rows.append(
            {
                "kernel": sig,
                "lower_s": statistics.median(r[0] for r in runs),
                "layout_inference_s": statistics.median(r[1] for r in runs),
                "lowered_chars": runs[0][2],
                "runs_s": [round(r[0], 3) for r in runs],
            }
        )
        print(rows[-1], flush=True)
    rows.sort(key=lambda row: -row["lower_s"])
    return {
        "model": name,
        "kernels": kernels.explain(),
        "program_trace_s": traced_at - start,
        "program_lower_s": lowered_at - traced_at,
        "program_layout_inference_s": layout.seconds,
        "kernel_calls": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["dense", "moe"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = []
    for name in args.models:
        result = probe(name, args.repeats)
        print(
            f"{name}: trace {result['program_trace_s']:.2f} s, lower "
            f"{result['program_lower_s']:.2f} s (layout inference "
            f"{result['program_layout_inference_s']:.2f} s)"
        )
        for row in result["kernel_calls"]:
            print(f"  {row['lower_s']:7.2f} s  {row['layout_inference_s']:6.2f}  {row['kernel']}")
        results.append(result)
    save("kernel_lowering", {"jax": jax.__version__, "models": results})


if __name__ == "__main__":
    main()
