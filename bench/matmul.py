"""A layer's weight matmuls with their neighbours, XLA against djax's fused Pallas kernel, at
the row counts a generation runs (32 for a denoising block, 384 for a refresh).

Forms (one LLaDA layer): `qkv` = rms_norm(x) @ w_qkv; `out` = residual + a @ w_out;
`gate_up` = silu(rms_norm(x) @ w_gate) * (rms_norm(x) @ w_up); `down` = residual + a @ w_down.
`xla` is the model's own code for the form (XLA fuses what it can around the matmul);
`fused` is `djax.models.fused_matmul` at its default tiles and at each tiling of the sweep.
Each is checked against fp32 (relative L2 error) and timed in-program; every step also sums
its output into the loop state, and `sum_only` times that alone. `GB/s` is weight bytes per
second (the weights dominate the bytes at 32 rows).

    python -m bench.matmul [--model dense|moe] [--rows 32 64 128 256 384] [--sweep-rows 32]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.common import model_config, save, time_in_program
from djax.models.fused_matmul import Tiles, fused_matmul
from djax.models.layers import rms_norm

TILINGS = tuple(
    Tiles(block_m=32, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    for bn, bk, warps, stages in [
        (16, 256, 4, 4),
        (16, 512, 4, 4),
        (32, 128, 4, 4),
        (32, 128, 2, 6),
        (32, 256, 4, 3),
        (32, 256, 4, 4),
        (32, 256, 4, 5),
        (32, 512, 4, 3),
        (32, 512, 8, 3),
        (64, 128, 4, 4),
        (64, 256, 4, 3),
        (64, 256, 4, 4),
        (64, 256, 8, 4),
        (64, 512, 8, 3),
        (128, 128, 4, 4),
        (128, 256, 8, 3),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--rows", nargs="+", type=int, default=[32, 64, 128, 256, 384])
    parser.add_argument("--sweep-rows", nargs="*", type=int, default=[32])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config(args.model, args.tiny)
    qkv_width = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    interpret = jax.default_backend() != "gpu"
    rows = []
    for name, (w_shape, width, normed, with_residual) in forms(
        cfg.d_model, qkv_width, None if cfg.is_moe else cfg.mlp_hidden
    ).items():
        keys = jax.random.split(jax.random.key(0), 4)
        w = (jax.random.normal(keys[0], w_shape) * width**-0.5).astype(jnp.bfloat16)
        scale = (1 + 0.1 * jax.random.normal(keys[1], (width,))).astype(jnp.bfloat16)
        scale = scale if normed else None
        n = w_shape[-1]
        for m in sorted(set(args.rows) | set(args.sweep_rows)):
            x = jax.random.normal(keys[2], (m, width), jnp.bfloat16)
            residual = jax.random.normal(keys[3], (m, n), jnp.bfloat16) if with_residual else None
            f32 = [None if a is None else a.astype(jnp.float32) for a in (x, w, scale, residual)]
            reference = xla_form(*f32)

            def step(x, w, scale, residual, run=None):
                out = run(x, w, scale, residual)
                return x + (1e-6 * jnp.sum(out, dtype=jnp.float32)).astype(x.dtype)

            def sum_only(x, w, scale, residual, shape=(m, n)):
                proxy = jnp.broadcast_to(x[:1, :1], shape)  # an output-sized array from x
                return x + (1e-6 * jnp.sum(proxy, dtype=jnp.float32)).astype(x.dtype)

            runs = [("sum_only", None), ("xla", xla_form), ("fused", fused_matmul)]
            if m in args.sweep_rows:
                runs += [
                    (f"fused {t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}", t)
                    for t in TILINGS
                ]
            for label, run in runs:
                if isinstance(run, Tiles):
                    run = functools.partial(fused_matmul, tiles=run)
                if run is fused_matmul or isinstance(run, functools.partial):
                    run = functools.partial(run, eps=EPS, interpret=interpret)
                row = {"form": name, "rows": m, "k": width, "n": n, "impl": label}
                try:
                    if run is None:
                        seconds = time_in_program(sum_only, x, args.iters, w, scale, residual)
                    else:
                        out = jax.jit(run)(x, w, scale, residual).astype(jnp.float32)
                        err = jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)
                        row["rel_error"] = float(err)
                        seconds = time_in_program(
                            functools.partial(step, run=run), x, args.iters, w, scale, residual
                        )
                    row["us"] = 1e6 * seconds
                    row["weight_GB_per_s"] = w.nbytes / seconds / 1e9
                except Exception as err:  # keep the other rows of a costly run
                    row["error"] = f"{type(err).__name__}: {err}"[:1500]
                print(row, flush=True)
                rows.append(row)
    save("matmul", {"model": args.model, "eps": EPS, "results": rows})


if __name__ == "__main__":
    main()
