"""A layer's weight matmuls with their neighbours, XLA against djax's fused Pallas kernel, at
the row counts of a denoising block (32 per row of the batch).

Forms (one LLaDA layer): `qkv` = rms_norm(x) @ w_qkv; `out` = residual + a @ w_out;
`gate_up` = silu(rms_norm(x) @ w_gate) * (rms_norm(x) @ w_up), and `gate_up_no_norm` the
same on x; `down` = residual + a @ w_down. `xla` is the model's code for the form (XLA fuses
what it can around the matmul); `fused` is `djax.models.fused_matmul` at its default tiles
and at each tiling of the sweep. Each is checked against fp32 (relative L2 error) and timed
by its kernels' device time in a profiler trace (µs per call, summed over its kernels).
`weight_TB_per_s` is weight bytes over that time (the weights dominate the bytes).

    python -m bench.matmul [--model dense|moe] [--rows 32 64] [--sweep-rows 32] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.profile import device_events
from djax.models.fused_matmul import Tiles, fused_matmul
from djax.models.layers import rms_norm

# Around the configurations XLA's autotuner picked for these shapes in the generation's
# profile (block_n 16-64, block_k 32-128, 5 stages), and wider ones.
TILINGS = tuple(
    Tiles(block_m=32, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    for bn, bk, warps, stages in [
        (16, 64, 2, 6),
        (16, 128, 2, 5),
        (16, 128, 4, 5),
        (16, 128, 4, 4),
        (16, 256, 4, 4),
        (32, 32, 4, 5),
        (32, 64, 4, 5),
        (32, 64, 2, 6),
        (32, 128, 4, 5),
        (32, 128, 4, 4),
        (32, 256, 4, 5),
        (64, 64, 4, 5),
        (64, 128, 4, 3),
        (64, 128, 4, 4),
        (64, 128, 4, 5),
        (64, 128, 8, 3),
        (64, 256, 8, 2),
        (128, 64, 4, 4),
        (128, 128, 8, 3),
    ]
)
EPS = 1e-5


def forms(d_model: int, qkv_width: int, ffn: int | None) -> dict[str, tuple]:
    """name -> (weight shape, input width, normed, residual)."""
    out = {
        "qkv": ((d_model, qkv_width), d_model, True, False),
        "out": ((d_model, d_model), d_model, False, True),
    }
    if ffn:
        out["gate_up"] = ((d_model, 2, ffn), d_model, True, False)
        out["gate_up_no_norm"] = ((d_model, 2, ffn), d_model, False, False)
        out["down"] = ((ffn, d_model), ffn, False, True)
    return out


def xla_form(x, w, scale, residual):
    """The model's code for the form (`layers.Attention` / `layers.GatedMLP`)."""
    h = x if scale is None else rms_norm(x, scale, EPS)
    if w.ndim == 3:
        y = jnp.einsum("tm,mcf->tcf", h, w)
        return jax.nn.silu(y[:, 0]) * y[:, 1]
    y = jnp.einsum("tm,mn->tn", h, w)
    return y if residual is None else residual + y


def kernel_us(fn, args: tuple, calls: int) -> dict[str, float]:
    """Device µs per call of each kernel `fn` launches, read from a profiler trace of `calls`
    separate calls: no loop or timer overhead, only the form's own kernels. Off GPUs (no
    device events) the wall time per call, under "wall"."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() != "gpu":
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        return {"wall": 1e6 * (time.perf_counter() - start) / calls}
    folder = Path(tempfile.mkdtemp(prefix="djax_matmul_trace_"))
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    with gzip.open(sorted(folder.rglob("*.trace.json.gz"))[-1]) as fh:
        events = next(iter(device_events(json.load(fh)).values()))
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        totals[e["name"]] += e["dur"] / calls
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--rows", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--sweep-rows", nargs="*", type=int, default=[32])
    parser.add_argument("--forms", nargs="+", help="only these forms (default: all)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config(args.model, args.tiny)
    qkv_width = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    interpret = jax.default_backend() != "gpu"
    rows = []
    for name, (w_shape, width, normed, with_residual) in forms(
        cfg.d_model, qkv_width, None if cfg.is_moe else cfg.mlp_hidden
    ).items():
        if args.forms and name not in args.forms:
            continue
        keys = jax.random.split(jax.random.key(0), 4)
        w = (jax.random.normal(keys[0], w_shape) * width**-0.5).astype(jnp.bfloat16)
        scale = (1 + 0.1 * jax.random.normal(keys[1], (width,))).astype(jnp.bfloat16)
        scale = scale if normed else None
        n = w_shape[-1]
        for m in sorted(set(args.rows) | set(args.sweep_rows)):
            x = jax.random.normal(keys[2], (m, width), jnp.bfloat16)
            residual = jax.random.normal(keys[3], (m, n), jnp.bfloat16) if with_residual else None
            operands = (x, w, scale, residual)
            reference = xla_form(*[None if a is None else a.astype(jnp.float32) for a in operands])
            runs = [("xla", xla_form), ("fused", None)]
            if m in args.sweep_rows:
                runs += [
                    (f"fused {t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}", t)
                    for t in TILINGS
                ]
            for label, tiles in runs:
                run = (
                    tiles
                    if callable(tiles)
                    else functools.partial(fused_matmul, eps=EPS, tiles=tiles, interpret=interpret)
                )
                row = {"form": name, "rows": m, "k": width, "n": n, "impl": label}
                try:
                    out = jax.jit(run)(*operands).astype(jnp.float32)
                    err = jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)
                    row["rel_error"] = float(err)
                    row["kernels_us"] = kernel_us(jax.jit(run), operands, args.calls)
                    row["us"] = sum(row["kernels_us"].values())
                    row["weight_TB_per_s"] = w.nbytes / row["us"] / 1e6
                except Exception as err:  # keep the other rows of a costly run
                    row["error"] = f"{type(err).__name__}: {err}"[:1500]
                print(row, flush=True)
                rows.append(row)
    save("matmul", {"model": args.model, "eps": EPS, "results": rows})


if __name__ == "__main__":
    main()
