"""LLaDA-8B's block products, XLA against djax's Pallas Triton kernels and their Pallas Mosaic
GPU ports (`matmul_impl` / `mlp_impl` = `xla`, `pallas`, `mosaic`), the products alone.

`qkv` (4096 -> 12288), `out` (4096 -> 4096) and `down` (12288 -> 4096): XLA's product, the
Triton split-K kernel (`split_k.matmul_partials`) and the Mosaic GPU one
(`split_k_mosaic.matmul_partials`), their partials left unsummed (the consumer adds them);
`gate_up` (4096 -> 2 x 12288, the SwiGLU activation fused): XLA's path
(`layers.swiglu_xla`), `swiglu.swiglu_matmul` and `swiglu_mosaic.swiglu_matmul`;
`gate_up_scaled`: the two kernels on `ScaledRows` (the norm before them moved into them, 128
tiles of sums of squares as the tiled add leaves them; `xla` is XLA's path on the normed
rows). Each kernel
runs at its default tiles (`tiles_for`); `--sweep` adds the Mosaic GPU kernels at the
tilings of MOSAIC_TILES. Each call cycles through enough copies of the weight (>= 256 MB)
that none is still in the L2 cache when it is read again, as inside a forward. Device time
per product from profiler traces (µs, summed over its kernels, the Mosaic GPU kernels' row
padding included where the rows need it); `rel_error` against the product in fp32;
`weight_TB_per_s` the weight bytes over that time.

    python -m bench.kernels.mosaic [--products qkv out down gate_up gate_up_scaled] [--rows 32]
        [--sweep]
        [--tiny]

The Mosaic GPU kernels need a Hopper GPU; off GPUs (`--tiny`) they run in Mosaic GPU's
interpreter and the times are wall times.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.kernels.split_k import products
from bench.kernels.timing import rel_error, time_row
from djax.kernels import split_k, split_k_mosaic, swiglu, swiglu_mosaic
from djax.kernels.handoff import ScaledRows
from djax.kernels.tma_ring import Tiles
from djax.models.layers import swiglu_xla

COLD_BYTES = 256 << 20

# --sweep: (block_n, block_k, splits, stages) of the Mosaic GPU kernels, kept where they fit
MOSAIC_TILES = {
    "qkv": ((128, 64, 1, 6), (128, 64, 1, 4), (64, 128, 1, 4), (128, 128, 2, 3)),
    "out": ((64, 128, 2, 4), (64, 64, 2, 6), (128, 64, 4, 6), (64, 128, 4, 4)),
    "down": ((64, 128, 2, 4), (64, 64, 2, 6), (128, 64, 4, 6), (64, 128, 4, 4)),
    "gate_up": ((128, 64, 1, 4), (128, 64, 1, 3), (64, 128, 1, 4), (64, 64, 1, 6)),
}
MOSAIC_TILES["gate_up_scaled"] = MOSAIC_TILES["gate_up"]
SQUARES_TILES = 32  # columns per tile of sums of squares (`residual_norm.add_scaled`'s)


def product_forms(name: str, k: int, n: int, sweep: bool) -> dict:
    """The forms of product `name` (`k -> n`, n counting gate and up columns for
    `gate_up`), each (x, w) -> its result before any consumer (the split-K forms' partials
    [splits, m, n]); with `sweep` also the MOSAIC_TILES tilings that fit it."""
    if name == "gate_up_scaled":
        forms = {
            "xla": lambda x, w: swiglu_xla(normed(x), w),
            "pallas": swiglu.swiglu_matmul,
            "mosaic": swiglu_mosaic.swiglu_matmul,
        }
        tiled = swiglu_mosaic.swiglu_matmul
    elif name == "gate_up":
        forms = {
            "xla": swiglu_xla,
            "pallas": swiglu.swiglu_matmul,
            "mosaic": swiglu_mosaic.swiglu_matmul,
        }
        tiled = swiglu_mosaic.swiglu_matmul
    else:
        forms = {
            "xla": lambda x, w: x @ w,
            "pallas": lambda x, w: split_k.matmul_partials(x, w).parts,
            "mosaic": lambda x, w: split_k_mosaic.matmul_partials(x, w).parts,
        }

        def tiled(x, w, tiles):
            return split_k_mosaic.matmul_partials(x, w, tiles=tiles).parts

    gate_up = name.startswith("gate_up")
    weights, out_bytes, width = (2, 2, n // 2) if gate_up else (1, 4, n)
    for bn, bk, splits, stages in MOSAIC_TILES[name] if sweep else ():
        tiles = Tiles(bn, bk, splits, stages)
        try:
            tiles.check(k, width, weights, out_bytes)
        except ValueError:
            continue
        forms[f"mosaic {bn}x{bk} s{splits} st{stages}"] = functools.partial(tiled, tiles=tiles)
    return forms


def normed(rows: ScaledRows) -> jax.Array:
    """`ScaledRows` with their norm applied, in their dtype."""
    return (rows.scaled.astype(jnp.float32) * rows.inv_rms()).astype(rows.dtype)


def scaled_rows(x: jax.Array, key) -> ScaledRows:
    """x [m, k] as `ScaledRows` with random positive sums of squares in k / SQUARES_TILES
    tiles."""
    tiles = x.shape[1] // SQUARES_TILES
    squares = jax.random.uniform(key, (tiles, x.shape[0]), minval=0.5, maxval=2.0)
    return ScaledRows(x, squares * SQUARES_TILES, 1e-5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--products",
        nargs="+",
        choices=["qkv", "out", "down", "gate_up", "gate_up_scaled"],
        default=["qkv", "out", "down", "gate_up", "gate_up_scaled"],
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also the tilings of MOSAIC_TILES")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config("dense", args.tiny)
    rows = []
    for name in args.products:
        gate_up = name.startswith("gate_up")
        k, n = products(cfg)["gate_up" if gate_up else name]
        shape = (k, 2, n // 2) if gate_up else (k, n)
        keys = jax.random.split(jax.random.key(0), 3)
        w = (jax.random.normal(keys[0], shape) * k**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(keys[1], (args.rows, k), jnp.bfloat16)
        if name == "gate_up_scaled":
            x = scaled_rows(x, keys[2])
        copies = max(1, -(-COLD_BYTES // w.nbytes)) if not args.tiny else 1
        ws = [w * (1 + i / 64) for i in range(copies)]
        wf = w.astype(jnp.float32)
        if name == "gate_up_scaled":
            reference = swiglu_xla(x.scaled.astype(jnp.float32) * x.inv_rms(), wf)
        else:
            reference = product_forms(name, k, n, False)["xla"](x.astype(jnp.float32), wf)
        for label, form in product_forms(name, k, n, args.sweep).items():
            row = {"product": name, "rows": args.rows, "k": k, "n": n, "impl": label}
            fn = jax.jit(lambda x, ws, form=form: [form(x, w) for w in ws])
            try:
                out = fn(x, ws[:1])[0]
                out = out.sum(0) if out.ndim == 3 else out  # split-K partials
                row["rel_error"] = rel_error(out, reference)
                time_row(row, fn, (x, ws), args.calls, w.nbytes, len(ws))
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print({key: v for key, v in row.items() if key != "kernels_us"}, flush=True)
            rows.append(row)
    save("mosaic", {"model": "dense", "copies_bytes": COLD_BYTES, "results": rows})


if __name__ == "__main__":
    main()
