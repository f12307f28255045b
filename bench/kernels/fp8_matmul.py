"""LLaDA-8B's block products with fp8 weights at block rows: the fp8 x fp8 Mosaic GPU kernel
(`fp8_matmul_mosaic`, the rows' quantisation included) against XLA's fp8 products and the
bf16 products, the products alone.

Products (k -> n): `qkv` 4096 -> 12288, `out` 4096 -> 4096, `down` 12288 -> 4096, `gate_up`
4096 -> 24576 (gate and up side by side, no activation). Forms:

- `mosaic fp8`: `fp8_matmul_mosaic.matmul` (`quantize_rows`, then the kernel on the weight
  stored [n, k]) at its default tiles (`tiles_for`), partials left unsummed;
- `xla fp8 scaled [n,k]`: the `scaled` product of `djax.models.fp8` (rows quantised, fp8 x
  fp8 dot, both scales) given the weight already stored [n, k], so XLA need not transpose
  it per call as it does the model's [k, n] weight;
- `xla fp8 dequant`: the `dequant` product on the model's [k, n] fp8 weight;
- `xla bf16`, `mosaic bf16` (`split_k_mosaic.matmul_partials`): the bf16 weight's products;
- `gate_up` also as SwiGLU (`silu(gate) * up` of the two halves written):
  `swiglu mosaic fp8` (`fp8_matmul_mosaic.swiglu`, the weight stored [2, n / 2, k]),
  `swiglu xla fp8 dequant` and `swiglu xla bf16` (`layers.swiglu_xla`) and `swiglu mosaic
  bf16` (`swiglu_mosaic.swiglu_matmul`).

`--sweep` adds the Mosaic GPU fp8 kernel at every tiling of SWEEP (block_n, block_k, splits,
stages) that fits (`fp8_matmul_mosaic.check_tiles`) and ends with the fastest per product
(saved under `fastest`). Each call cycles through enough copies of the weight (>= 256 MB in
the form's own dtype) that none is still in the L2 cache when it is read again. Device time
per product from profiler traces (µs, summed over its kernels); `rel_error` against the
fp32 product with the bf16 weight (the fp8 forms carry the weight's and, for the scaled
forms, the rows' quantisation); `accumulation_error` (the forms on the [n, k] weight)
against the fp32 product of the same e4m3 rows and weight: what the dot's own accumulation
adds (Hopper's fp8 WGMMA adds into a narrower accumulator than fp32; XLA's form returns
bf16, whose rounding alone is ~2e-3, the kernel fp32 partials); `weight_TB_per_s` the
form's weight bytes over its time.

    python -m bench.kernels.fp8_matmul [--products qkv out down gate_up] [--rows 32]
        [--sweep] [--tiny]

The Mosaic GPU kernels need a Hopper GPU; off GPUs (`--tiny`) they run in Mosaic GPU's
interpreter and the times are wall times.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.kernels.mosaic import fastest, products
from bench.kernels.timing import rel_error, time_row
from djax.kernels import fp8_matmul_mosaic, split_k_mosaic, swiglu_mosaic
from djax.kernels.tma_ring import Tiles
from djax.models import fp8
from djax.models.layers import swiglu_xla

COLD_BYTES = 256 << 20
PRODUCTS = ("qkv", "out", "down", "gate_up")
# --sweep: (block_n, block_k, splits, stages), kept where they divide and fit
SWEEP = ((64, 128), (128, 256), (1, 2, 4), (4, 6, 8))


def xla_scaled_nk(x, weight):
    """The `scaled` product on a weight stored [n, k]: (w_t, w_scale)."""
    w_t, w_scale = weight
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    y = jax.lax.dot_general(xq, w_t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale[:, None] * w_scale).astype(x.dtype)


def mosaic_fp8(x, weight, tiles=None):
    """The fp8 kernel (rows quantised by it) on (w_t, w_scale): its partials."""
    return fp8_matmul_mosaic.matmul(x, *weight, tiles=tiles).parts


# form label -> (weight layout, product (x, weight) -> output)
FORMS = {
    "mosaic fp8": ("fp8 [n,k]", mosaic_fp8),
    "xla fp8 scaled [n,k]": ("fp8 [n,k]", xla_scaled_nk),
    "xla fp8 dequant": ("fp8 [k,n]", lambda x, w: fp8.einsum("mk,kn->mn", x, w, "dequant")),
    "xla bf16": ("bf16", lambda x, w: x @ w),
    "mosaic bf16": ("bf16", lambda x, w: split_k_mosaic.matmul_partials(x, w).parts),
}


def swiglu_mosaic_fp8(x, weight):
    """The fp8 kernel's SwiGLU form (rows quantised by it) on (w_t [2, n, k], w_scale)."""
    return fp8_matmul_mosaic.swiglu(x, *weight)


# gate_up only: the SwiGLU forms, the activation fused where the kernel fuses it
SWIGLU_FORMS = {
    "swiglu mosaic fp8": ("fp8 [2,n,k]", swiglu_mosaic_fp8),
    "swiglu xla fp8 dequant": ("fp8 [k,2,n]", lambda x, w: swiglu_xla(x, w, "dequant")),
    "swiglu xla bf16": ("bf16 [k,2,n]", swiglu_xla),
    "swiglu mosaic bf16": ("bf16 [k,2,n]", swiglu_mosaic.swiglu_matmul),
}


def quantised_product(x, weight):
    """The fp32 product of the rows and weight as the fp8 x fp8 forms quantise them:
    (xq * x_scale) @ (w_t * w_scale)^T, at full fp32 precision."""
    w_t, w_scale = weight
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    rows = xq.astype(jnp.float32) * x_scale[:, None]
    columns = w_t.astype(jnp.float32) * w_scale[:, None]
    return jnp.dot(rows, columns.T, precision=jax.lax.Precision.HIGHEST)


def weight_forms(w: jax.Array, layout: str):
    """A bf16 weight [k, n] in `layout` (of FORMS, SWIGLU_FORMS): itself, an `Fp8Weight`
    [k, n], the kernel's (w_t [n, k] e4m3, w_scale [n]); the gate/up forms split n into
    gate and up halves: [k, 2, n / 2], its `Fp8Weight`, (w_t [2, n / 2, k], w_scale
    [2, n / 2])."""
    k, n = w.shape
    if layout.startswith("bf16"):
        return w if layout == "bf16" else w.reshape(k, 2, n // 2)
    values, scale = fp8.quantize(w, (0,))
    if layout == "fp8 [k,n]":
        return fp8.Fp8Weight(values, scale)
    if layout == "fp8 [n,k]":
        return values.T, scale
    if layout == "fp8 [k,2,n]":
        return fp8.Fp8Weight(values.reshape(k, 2, n // 2), scale.reshape(2, n // 2))
    return values.reshape(k, 2, n // 2).transpose(1, 2, 0), scale.reshape(2, n // 2)


def sweep_tiles(k: int, n: int) -> list[Tiles]:
    """The tilings of SWEEP the fp8 kernel takes for a `k -> n` product."""
    kept = []
    for tiles in itertools.starmap(Tiles, itertools.product(*SWEEP)):
        try:
            fp8_matmul_mosaic.check_tiles(tiles, k, n)
        except ValueError:
            continue
        kept.append(tiles)
    return kept


def nbytes(weight) -> int:
    """Bytes of a weight in any layout of `weight_forms` (values and scales)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(weight))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--products", nargs="+", choices=PRODUCTS, default=list(PRODUCTS))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also the tilings of SWEEP")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    cfg = model_config("dense", args.tiny)
    rows = []
    for name in args.products:
        k, n = products(cfg)[name]
        keys = jax.random.split(jax.random.key(0), 2)
        w = (jax.random.normal(keys[0], (k, n)) * k**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(keys[1], (args.rows, k), jnp.bfloat16)
        reference = x.astype(jnp.float32) @ w.astype(jnp.float32)
        forms = dict(FORMS, **(SWIGLU_FORMS if name == "gate_up" else {}))
        if args.sweep:
            for t in sweep_tiles(k, n):
                label = f"mosaic fp8 {t.block_n}x{t.block_k} s{t.splits} st{t.stages}"
                forms[label] = ("fp8 [n,k]", lambda x, w, t=t: mosaic_fp8(x, w, t))
        copies = {}
        for label, (layout, form) in forms.items():
            row = {"product": name, "rows": args.rows, "k": k, "n": n, "impl": label}
            try:
                if layout not in copies:
                    count = -(-COLD_BYTES // nbytes(weight_forms(w, layout)))
                    scaled = [w * (1 + i / 64) for i in range(1 if args.tiny else count)]
                    copies[layout] = [weight_forms(c, layout) for c in scaled]
                ws = copies[layout]
                fn = jax.jit(lambda x, ws, form=form: [form(x, w) for w in ws])
                out = fn(x, ws[:1])[0]
                out = out.sum(0) if out.ndim == 3 else out
                if label.startswith("swiglu"):
                    half = n // 2
                    gate, up = reference[:, :half], reference[:, half:]
                    expected = jax.nn.silu(gate) * up
                else:
                    expected = reference
                row["rel_error"] = rel_error(out, expected)
                if layout == "fp8 [n,k]":  # against the fp32 product of its e4m3 operands
                    row["accumulation_error"] = rel_error(out, quantised_product(x, ws[0]))
                time_row(row, fn, (x, ws), args.calls, nbytes(ws[0]), len(ws))
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print({key: v for key, v in row.items() if key != "kernels_us"}, flush=True)
            rows.append(row)
    best = fastest([row for row in rows if row["impl"].startswith("mosaic fp8")])
    for name, line in best.items():
        print(f"fastest mosaic {name}: {line}", flush=True)
    payload = {"model": "dense", "copies_bytes": COLD_BYTES, "results": rows, "fastest": best}
    save("fp8_matmul", payload)


if __name__ == "__main__":
    main()
