"""LLaDA-8B's block products, XLA against djax's Pallas Triton kernels and their Pallas Mosaic
GPU ports (`matmul_impl` / `mlp_impl` = `xla`, `pallas`, `mosaic`), the products alone.

- `qkv` (4096 -> 12288), `out` (4096 -> 4096), `down` (12288 -> 4096): XLA's product, the
  Triton split-K kernel (`split_k.matmul_partials`) and the Mosaic GPU one
  (`split_k_mosaic.matmul_partials`), their partials left unsummed (the consumer adds them).
- `gate_up` (4096 -> 2 x 12288, the SwiGLU activation fused): XLA's path
  (`layers.swiglu_xla`), `swiglu.swiglu_matmul` and `swiglu_mosaic.swiglu_matmul`;
  `gate_up_scaled`: the two kernels on `ScaledRows` (the norm before them moved into them,
  128 tiles of sums of squares as the tiled add leaves them; `xla`: XLA's path on the
  normed rows).
- `out_residual`, `down_residual`: the product with the residual add in its epilogue and the
  norm left to the next product (`norm_impl="fused"`): `residual_product.residual_product`
  and `residual_product_mosaic.residual_product`; `xla`: XLA's product, add and norm.

Each kernel runs at its default tiles (`tiles_for`); `--sweep` adds the Mosaic GPU kernels
at the tilings of MOSAIC_TILES. Each call cycles through enough copies of the weight
(>= 256 MB) that none is still in the L2 cache when it is read again, as inside a forward.
Device time per product from profiler traces (µs, summed over its kernels, the Mosaic GPU
kernels' row padding included where the rows need it); `rel_error` of the product (the
normed rows for the residual forms) against fp32; `weight_TB_per_s` the weight bytes over
that time.

    python -m bench.kernels.mosaic [--products qkv out down gate_up gate_up_scaled
        out_residual down_residual] [--rows 32] [--sweep] [--tiny]

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
from djax.kernels import (
    residual_product,
    residual_product_mosaic,
    split_k,
    split_k_mosaic,
    swiglu,
    swiglu_mosaic,
)
from djax.kernels.handoff import ScaledRows
from djax.kernels.tma_ring import Tiles
from djax.models.layers import rms_norm, swiglu_xla

COLD_BYTES = 256 << 20
EPS = 1e-5
PRODUCTS = ("qkv", "out", "down", "gate_up", "gate_up_scaled", "out_residual", "down_residual")

# --sweep: (block_n, block_k, splits, stages) of the Mosaic GPU kernels, kept where they fit
SPLIT_K_TILES = ((64, 128, 2, 4), (64, 64, 2, 6), (128, 64, 4, 6), (64, 128, 4, 4))
GATE_UP_TILES = ((128, 64, 1, 4), (128, 64, 1, 3), (64, 128, 1, 4), (64, 64, 1, 6))
RESIDUAL_TILES = ((32, 128, 6), (32, 256, 4), (32, 64, 8), (64, 128, 4))
MOSAIC_TILES = {
    "qkv": ((128, 64, 1, 6), (128, 64, 1, 4), (64, 128, 1, 4), (128, 128, 2, 3)),
    "out": SPLIT_K_TILES,
    "down": SPLIT_K_TILES,
    "gate_up": GATE_UP_TILES,
    "gate_up_scaled": GATE_UP_TILES,
    "out_residual": tuple((bn, bk, 1, st) for bn, bk, st in RESIDUAL_TILES),
    "down_residual": tuple((bn, bk, 1, st) for bn, bk, st in RESIDUAL_TILES),
}
SQUARES_TILES = 32  # columns per tile of sums of squares (`residual_norm.add_scaled`'s)


def normed(rows: ScaledRows) -> jax.Array:
    """`ScaledRows` with their norm applied, in fp32."""
    return rows.scaled.astype(jnp.float32) * rows.inv_rms()


def scaled_rows(x: jax.Array, key) -> ScaledRows:
    """x [m, k] as `ScaledRows` with random positive sums of squares in k / SQUARES_TILES
    tiles."""
    tiles = x.shape[1] // SQUARES_TILES
    squares = jax.random.uniform(key, (tiles, x.shape[0]), minval=0.5, maxval=2.0)
    return ScaledRows(x, squares * SQUARES_TILES, EPS)


def xla_residual(x, w):
    """XLA's product, residual add and norm: (h, normed rows)."""
    rows, residual, scale = x
    h = residual + rows @ w
    return h, rms_norm(h, scale, EPS)


def product_forms(name: str) -> tuple[dict, object]:
    """The forms of product `name`, each (x, w) -> its outputs before any consumer (the
    split-K forms' partials [splits, m, n]; the residual forms' (h, rows)), and the Mosaic
    GPU form taking `tiles` for the sweep."""
    if name.startswith("gate_up"):
        xla = swiglu_xla
        if name == "gate_up_scaled":
            xla = lambda x, w: swiglu_xla(normed(x).astype(x.dtype), w)  # noqa: E731
        forms = {"xla": xla, "pallas": swiglu.swiglu_matmul, "mosaic": swiglu_mosaic.swiglu_matmul}
        return forms, swiglu_mosaic.swiglu_matmul
    if name.endswith("_residual"):

        def run(kernel, x, w, tiles=None):
            return kernel.residual_product(*x[:1], w, *x[1:], EPS, tiles=tiles)

        forms = {
            "xla": xla_residual,
            "pallas": functools.partial(run, residual_product),
            "mosaic": functools.partial(run, residual_product_mosaic),
        }
        return forms, functools.partial(run, residual_product_mosaic)

    def partials(kernel, x, w, tiles=None):
        return kernel.matmul_partials(x, w, tiles=tiles).parts

    forms = {
        "xla": lambda x, w: x @ w,
        "pallas": functools.partial(partials, split_k),
        "mosaic": functools.partial(partials, split_k_mosaic),
    }
    return forms, functools.partial(partials, split_k_mosaic)


def sweep_forms(name: str, k: int, n: int) -> dict:
    """The Mosaic GPU form of `name` (`k -> n`) at each MOSAIC_TILES tiling that fits."""
    _, tiled = product_forms(name)
    gate_up, residual = name.startswith("gate_up"), name.endswith("_residual")
    weights, out_bytes = (2, 2) if gate_up else (1, 6 if residual else 4)
    forms = {}
    for bn, bk, splits, stages in MOSAIC_TILES[name]:
        tiles = Tiles(bn, bk, splits, stages)
        try:
            tiles.check(k, n // 2 if gate_up else n, weights, out_bytes)
        except ValueError:
            continue
        forms[f"mosaic {bn}x{bk} s{splits} st{stages}"] = functools.partial(tiled, tiles=tiles)
    return forms


def inputs(name: str, rows: int, k: int, n: int, key) -> tuple:
    """(x, w) of product `name`: x [rows, k] (as `ScaledRows` for `gate_up_scaled`, with the
    residual and the norm's scale for the residual forms), w [k, n] ([k, 2, n / 2] for
    the gate/up forms), bf16."""
    keys = jax.random.split(key, 4)
    shape = (k, 2, n // 2) if name.startswith("gate_up") else (k, n)
    w = (jax.random.normal(keys[0], shape) * k**-0.5).astype(jnp.bfloat16)
    x = jax.random.normal(keys[1], (rows, k), jnp.bfloat16)
    if name == "gate_up_scaled":
        x = scaled_rows(x, keys[2])
    if name.endswith("_residual"):
        residual = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)
        scale = (1 + 0.1 * jax.random.normal(keys[3], (n,))).astype(jnp.bfloat16)
        x = (x, residual, scale)
    return x, w


def compared(out):
    """The array a form's outputs are checked by: the product (the split-K partials
    summed), or for the residual forms the normed rows."""
    if isinstance(out, tuple):
        rows = out[1]
        return normed(rows) if isinstance(rows, ScaledRows) else rows
    return out.sum(0) if out.ndim == 3 else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--products", nargs="+", choices=PRODUCTS, default=list(PRODUCTS))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also the tilings of MOSAIC_TILES")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config("dense", args.tiny)
    rows = []
    for name in args.products:
        k, n = products(cfg)[name.removesuffix("_scaled").removesuffix("_residual")]
        x, w = inputs(name, args.rows, k, n, jax.random.key(0))
        copies = max(1, -(-COLD_BYTES // w.nbytes)) if not args.tiny else 1
        ws = [w * (1 + i / 64) for i in range(copies)]
        forms, _ = product_forms(name)
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        x32 = jax.tree.map(f32, x) if not isinstance(x, ScaledRows) else x
        if isinstance(x, ScaledRows):  # XLA's path on the normed rows, in fp32
            reference = swiglu_xla(normed(x), f32(w))
        else:
            reference = compared(forms["xla"](x32, f32(w)))
        if args.sweep:
            forms = {**forms, **sweep_forms(name, k, n)}
        for label, form in forms.items():
            row = {"product": name, "rows": args.rows, "k": k, "n": n, "impl": label}
            fn = jax.jit(lambda x, ws, form=form: [form(x, w) for w in ws])
            try:
                row["rel_error"] = rel_error(compared(fn(x, ws[:1])[0]), reference)
                time_row(row, fn, (x, ws), args.calls, w.nbytes, len(ws))
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print({key: v for key, v in row.items() if key != "kernels_us"}, flush=True)
            rows.append(row)
    save("mosaic", {"model": "dense", "copies_bytes": COLD_BYTES, "results": rows})


if __name__ == "__main__":
    main()
