"""Does reading the start of the next weight into L2 from inside the residual/norm kernel
(`djax.models.l2_prefetch`) shorten the matmul after it? LLaDA-8B's two norm -> matmul
chains at block rows: RMSNorm -> q/k/v (split-K kernel) and RMSNorm -> gate/up (SwiGLU
kernel), with 0 (no extra programs) up to `--mb` megabytes read ahead.

Each call cycles through enough copies of the weight (>= 256 MB) that none is still in L2
from its previous use, as inside a forward. Device µs per chain from profiler traces,
per kernel.

    python -m bench.prefetch [--mb 0 4 8 12 16 24] [--tiny]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.matmul import kernel_us
from djax.models import l2_prefetch
from djax.models.residual_norm import add_rms_norm
from djax.models.split_k import matmul_partials, tiles_for
from djax.models.swiglu import swiglu_matmul

COLD_BYTES = 256 << 20
EPS = 1e-5


def chain(product, x, y, scale, w, mb):
    slices = tiles_for(x.shape[0], *w.shape[:1], w.size // w.shape[0]).splits
    plan = l2_prefetch.plan(w, slices if product == "qkv" else 1, mb << 20) if mb else None
    _, normed = add_rms_norm(x, y, scale, EPS, w if plan else None, plan)
    if product == "qkv":
        return matmul_partials(normed, w).parts
    return swiglu_matmul(normed, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--mb", nargs="+", type=int, default=[0, 4, 8, 12, 16, 24])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config("dense", args.tiny)
    m = cfg.d_model
    shapes = {"qkv": (m, 3 * m), "gate_up": (m, 2, cfg.mlp_hidden)}
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (args.rows, m), jnp.bfloat16)
    y = jax.random.normal(keys[1], (args.rows, m), jnp.bfloat16)
    scale = jnp.ones((m,), jnp.bfloat16)
    rows = []
    for product, shape in shapes.items():
        w = (jax.random.normal(keys[2], shape) * m**-0.5).astype(jnp.bfloat16)
        copies = max(1, -(-COLD_BYTES // w.nbytes)) if not args.tiny else 1
        ws = [w * (1 + i / 64) for i in range(copies)]
        for mb in args.mb:
            fn = jax.jit(
                lambda x, y, s, ws, mb=mb, product=product: [
                    chain(product, x, y, s, w, mb) for w in ws
                ]
            )
            row = {"product": product, "rows": args.rows, "prefetch_mb": mb}
            try:
                per_call = kernel_us(fn, (x, y, scale, ws), args.calls)
                row["kernels_us"] = {k: v / len(ws) for k, v in per_call.items()}
                row["us"] = sum(row["kernels_us"].values())
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print(row, flush=True)
            rows.append(row)
    save("prefetch", {"model": "dense", "copies_bytes": COLD_BYTES, "results": rows})


if __name__ == "__main__":
    main()
