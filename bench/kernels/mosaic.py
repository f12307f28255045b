"""LLaDA-8B's block products, XLA against djax's Pallas Mosaic GPU kernels
(`matmul_impl` / `mlp_impl` / `norm_impl` / `rope_impl` = `xla`, `mosaic`), the products
alone.

- `qkv` (4096 -> 12288), `out` (4096 -> 4096), `down` (12288 -> 4096): XLA's product and
  the split-K kernel (`split_k_mosaic.matmul_partials`), its partials left unsummed (the
  consumer adds them).
- `gate_up` (4096 -> 2 x 12288, the SwiGLU activation fused): XLA's path
  (`layers.swiglu_xla`) and `swiglu_mosaic.swiglu_matmul`; `gate_up_scaled`: the kernel on
  `ScaledRows` (the norm before it moved into it, 128 tiles of sums of squares as the
  tiled add leaves them; `xla`: XLA's path on the normed rows).
- `out_residual`, `down_residual`: the product with the residual add in its epilogue and the
  norm left to the next product (`norm_impl="fused"`,
  `residual_product_mosaic.residual_product`); `xla`: XLA's product, add and norm.
- `out_tiled`, `down_tiled`: the split-K product, then the tiled residual add leaving the
  norm to the next product (`norm_impl="tiled"`: `split_k_mosaic`,
  `residual_norm_mosaic.add_scaled`), and the Mosaic GPU product with XLA's add
  (`mosaic + xla add`: the slices' sum, add, scale and tiles' sums of squares).
- `out_norm`, `down_norm`: the split-K product, then the per-row residual norm
  (`norm_impl="mosaic"`, `residual_norm_mosaic.add_rms_norm`), or XLA's add and norm on the
  Mosaic GPU partials (`mosaic + xla norm`, the slices' sum fused into them).
- `qkv_rope`: the q/k/v product with what follows it up to attention (q/k norm, RoPE, the
  window's K/V written into a 384-position buffer at 128): `xla` (XLA's product and head
  ops), `mosaic` (the product with RoPE and the writes in its epilogue,
  `rope_write_mosaic.project_rope_and_write`: `qkv="rope"`), `mosaic + epilogue` (the
  split-K product, then `rope_write_mosaic.rope_and_write` on its partials) and
  `mosaic + xla rope` (its partials summed, then XLA's head ops and writes), for LLaDA-8B's
  heads or, with `--model moe`, LLaDA-MoE's.

The `_tiled` and `_norm` products end with a verdict line each (`verdict`, also under
`verdicts` in the results): the Mosaic GPU kernels against XLA's path and XLA's fusion on
the Mosaic GPU partials, the fastest named.

Each kernel runs at its default tiles (`tiles_for`); `--sweep` adds the Mosaic GPU kernels
(split-K, SwiGLU, residual product, the fused q/k/v and RoPE kernel's ring) at every tiling
of SWEEP_GRIDS (QKV_ROPE_RINGS) that fits, and ends with the fastest per product (also
under `fastest` in the results): what each kernel's `tiles_for` should take. Each call
cycles through enough copies of the weight (>= 256 MB) that none is still in the L2 cache
when it is read again, as inside a forward. Device time per product from profiler traces
(µs, summed over its kernels, the Mosaic GPU kernels' row padding included where the rows
need it); `rel_error` of the product (the normed rows for the residual forms, the worst of
q, keys and values for `qkv_rope`) against fp32; `weight_TB_per_s` the weight bytes over
that time.

    python -m bench.kernels.mosaic [--products qkv out down gate_up gate_up_scaled
        out_residual down_residual out_tiled down_tiled out_norm down_norm qkv_rope]
        [--model dense] [--rows 32] [--sweep] [--tiny]

The Mosaic GPU kernels need a Hopper GPU; off GPUs (`--tiny`) they run in Mosaic GPU's
interpreter and the times are wall times.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.kernels.timing import rel_error, time_row
from djax.kernels import (
    residual_norm_mosaic,
    residual_product_mosaic,
    rope_write_mosaic,
    split_k_mosaic,
    swiglu_mosaic,
)
from djax.kernels.handoff import Partials, ScaledRows
from djax.kernels.tma_ring import Tiles
from djax.models import layers
from djax.models.layers import rms_norm, swiglu_xla

COLD_BYTES = 256 << 20
EPS = 1e-5
PRODUCTS = (
    "qkv",
    "out",
    "down",
    "gate_up",
    "gate_up_scaled",
    "out_residual",
    "down_residual",
    "out_tiled",
    "down_tiled",
    "out_norm",
    "down_norm",
    "qkv_rope",
)

# --sweep: each kernel's tilings (block_n, block_k, splits, stages), the union of products
# of these values, kept where they divide the product and fit in shared memory
# (`sweep_tiles`); the residual product's splits are a cluster's CTAs
SWEEP_GRIDS = {
    "split_k": (((64, 128), (64, 128), (1, 2, 4), (4, 6)),),
    "gate_up": (((64, 128), (64, 128), (1,), (3, 4, 6)),),
    "residual": (
        ((32, 64, 128), (64, 128, 256), (1,), (3, 4, 6)),
        ((64, 128), (64, 128), (2, 4), (4, 6)),
    ),
}
SQUARES_TILES = 32  # columns per tile of sums of squares (`residual_norm_mosaic.add_scaled`'s)
# --sweep: the fused q/k/v and RoPE kernel's rings, (block_k, stages) (its block_n is head_dim)
QKV_ROPE_RINGS = ((64, 3), (64, 4), (64, 5), (64, 6), (128, 2), (128, 3), (128, 4))
BUFFER, START = 384, 128  # qkv_rope: the dual cache's K/V buffer at the setting, the first block


def products(cfg) -> dict[str, tuple[int, int]]:
    """(k, n) of a block layer's products: q/k/v, attention output, down, gate/up."""
    m, heads = cfg.d_model, cfg.n_heads * cfg.head_dim
    return {
        "qkv": (m, heads + 2 * cfg.n_kv_heads * cfg.head_dim),
        "out": (heads, m),
        "down": (cfg.mlp_hidden, m),
        "gate_up": (m, 2 * cfg.mlp_hidden),
    }


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


def base_product(name: str) -> str:
    """The product of `products(cfg)` a benchmark row `name` runs."""
    return "gate_up" if name.startswith("gate_up") else name.split("_")[0]  # qkv_rope: qkv


def _run_residual(kernel, x, w, tiles=None):
    return kernel.residual_product(*x[:1], w, *x[1:], EPS, tiles=tiles)


def _tiled(matmul, add, x, w, tiles=None):
    """The split-K product `matmul` with tiles `tiles`, then the tiled residual add `add`
    on its partials: (h, ScaledRows)."""
    rows, residual, scale = x
    return add(residual, matmul.matmul_partials(rows, w, tiles=tiles), scale, EPS)


def xla_add_scaled(x, y, scale, eps):
    """XLA's form of `residual_norm_mosaic.add_scaled` (SQUARES_TILES-column tiles): x [m, d]
    plus y (`Partials`) and the (h, `ScaledRows`) of the sum."""
    h = x + y.total()
    hf = h.astype(jnp.float32)
    m, d = h.shape
    squares = (hf * hf).reshape(m, d // SQUARES_TILES, SQUARES_TILES).sum(-1).T
    return h, ScaledRows((hf * scale.astype(jnp.float32)).astype(h.dtype), squares, eps)


def _normed(norm: str, x, w):
    """The Mosaic GPU split-K product, then the per-row residual norm on its partials: the
    Mosaic GPU kernel (`add_rms_norm`, `norm="mosaic"`) or XLA's add and norm (`"xla"`, the
    slices' sum fused into them)."""
    rows, residual, scale = x
    y = split_k_mosaic.matmul_partials(rows, w)
    if norm == "mosaic":
        return residual_norm_mosaic.add_rms_norm(residual, y, scale, EPS)
    h = residual + y.total()
    return h, rms_norm(h, scale, EPS)


def product_forms(name: str) -> tuple[dict, object]:
    """The forms of product `name`, each (x, w) -> its outputs before any consumer (the
    split-K forms' partials [splits, m, n]; the residual forms' (h, rows)), and the Mosaic
    GPU form taking `tiles` for the sweep."""
    if name.startswith("gate_up"):
        xla = swiglu_xla
        if name == "gate_up_scaled":
            xla = lambda x, w: swiglu_xla(normed(x).astype(x.dtype), w)  # noqa: E731
        forms = {"xla": xla, "mosaic": swiglu_mosaic.swiglu_matmul}
        return forms, swiglu_mosaic.swiglu_matmul
    if name.endswith("_residual"):
        forms = {
            "xla": xla_residual,
            "mosaic": functools.partial(_run_residual, residual_product_mosaic),
        }
        return forms, functools.partial(_run_residual, residual_product_mosaic)
    if name.endswith("_tiled"):
        mosaic = functools.partial(_tiled, split_k_mosaic, residual_norm_mosaic.add_scaled)
        forms = {
            "xla": xla_residual,
            "mosaic": mosaic,
            "mosaic + xla add": functools.partial(_tiled, split_k_mosaic, xla_add_scaled),
        }
        return forms, mosaic
    if name.endswith("_norm"):
        forms = {
            "xla": xla_residual,
            "mosaic": functools.partial(_normed, "mosaic"),
            "mosaic + xla norm": functools.partial(_normed, "xla"),
        }
        return forms, None

    def partials(kernel, x, w, tiles=None):
        return kernel.matmul_partials(x, w, tiles=tiles).parts

    forms = {
        "xla": lambda x, w: x @ w,
        "mosaic": functools.partial(partials, split_k_mosaic),
    }
    return forms, functools.partial(partials, split_k_mosaic)


def sweep_tiles(name: str, k: int, n: int) -> list[Tiles]:
    """The tilings of SWEEP_GRIDS the Mosaic GPU kernel of product `name` (`k -> n`; n the
    output columns, per side for the gate/up forms) takes, at 64 rows; none for the tiled
    and per-row norm forms (their products are the split-K ones, swept alone)."""
    if name.endswith(("_tiled", "_norm")):
        return []
    if name.startswith("gate_up"):
        grid = SWEEP_GRIDS["gate_up"]
        squares = 0 if name == "gate_up" else (k // SQUARES_TILES) * 64 * 4

        def check(tiles):
            tiles.check(k, n, weights=2, out_bytes=2, extra=squares)
    elif name.endswith("_residual"):
        grid = SWEEP_GRIDS["residual"]

        def check(tiles):
            residual_product_mosaic.check_tiles(tiles, k, n)
    else:
        grid = SWEEP_GRIDS["split_k"]

        def check(tiles):
            tiles.check(k, n, weights=1, out_bytes=4)

    kept = []
    tilings = itertools.chain.from_iterable(itertools.product(*values) for values in grid)
    for tiles in itertools.starmap(Tiles, tilings):
        try:
            check(tiles)
        except ValueError:
            continue
        kept.append(tiles)
    return kept


def sweep_forms(name: str, k: int, n: int) -> dict:
    """The Mosaic GPU form of `name` (`k -> n`) at each tiling of `sweep_tiles`."""
    _, tiled = product_forms(name)
    n = n // 2 if name.startswith("gate_up") else n
    return {
        f"mosaic {t.block_n}x{t.block_k} s{t.splits} st{t.stages}": functools.partial(
            tiled, tiles=t
        )
        for t in sweep_tiles(name, k, n)
    }


def fastest(rows: list[dict]) -> dict[str, str]:
    """Per product, the fastest Mosaic GPU form of `rows` (those that ran) and its time."""
    best: dict[str, dict] = {}
    for row in rows:
        if "us" not in row or not row["impl"].startswith("mosaic"):
            continue
        if row["product"] not in best or row["us"] < best[row["product"]]["us"]:
            best[row["product"]] = row
    return {name: f"{row['impl']}: {row['us']:.1f} us" for name, row in best.items()}


# The forms a verdict weighs, per product suffix: (what the verdict calls it, impl); the
# first is the Mosaic GPU kernels'
VERDICT_FORMS = {
    "tiled": (
        ("Mosaic", "mosaic"),
        ("XLA", "xla"),
        ("XLA on Mosaic partials", "mosaic + xla add"),
    ),
    "norm": (
        ("Mosaic", "mosaic"),
        ("XLA", "xla"),
        ("XLA on Mosaic partials", "mosaic + xla norm"),
    ),
}
# Relative error (normed rows against fp32) above which a form counts as wrong: bf16
# rounding of the rows is ~4e-3
MAX_REL_ERROR = 2e-2


def verdict(name: str, rows: list[dict]) -> str | None:
    """One line for product `name` of the `_tiled` or `_norm` kind (None for others): the
    times of VERDICT_FORMS's forms in `rows`, and the fastest of those that ran and are
    right, with how far each other trails it."""
    forms = VERDICT_FORMS.get(name.rsplit("_", 1)[-1])
    if forms is None:
        return None
    times, shown = {}, []
    for label, impl in forms:
        row = next((r for r in rows if r["product"] == name and r["impl"] == impl), None)
        if row is None:
            shown.append(f"{label} not run")
        elif "us" not in row:
            shown.append(f"{label} failed")
        elif row["rel_error"] > MAX_REL_ERROR:
            shown.append(f"{label} wrong (rel_error {row['rel_error']:.1e})")
        else:
            times[label] = row["us"]
            shown.append(f"{label} {row['us']:.1f} us")
    line = f"verdict {name}: " + " | ".join(shown)
    if not times:
        return line + " -> none ran"
    best = min(times, key=times.get)
    behind = ", ".join(
        f"{label} +{us - times[best]:.1f} us" for label, us in times.items() if label != best
    )
    return f"{line} -> {best} fastest" + (f" ({behind})" if behind else "")


def qkv_rope_inputs(cfg, rows: int, key) -> tuple:
    """A window of `rows` normed rows at START, its q/k/v weight [model, kv, group + 2, d],
    the K/V buffers, RoPE tables, bounds and q/k norm scales (or None)."""
    group = cfg.n_heads // cfg.n_kv_heads
    keys = jax.random.split(key, 4)
    x = jax.random.normal(keys[0], (1, rows, cfg.d_model), jnp.bfloat16)
    shape = (cfg.d_model, cfg.n_kv_heads, group + 2, cfg.head_dim)
    w = (jax.random.normal(keys[1], shape) * cfg.d_model**-0.5).astype(jnp.bfloat16)
    buffers = tuple(
        jax.random.normal(k, (1, BUFFER, cfg.n_kv_heads, cfg.head_dim), jnp.bfloat16)
        for k in keys[2:]
    )
    positions = START + jnp.arange(rows)[None]
    cos, sin = layers.rope_tables(positions, cfg.rope_theta, cfg.rope_dim)
    bounds = jnp.array([START, START, START + rows], jnp.int32)
    scales = (jnp.ones((cfg.head_dim,), jnp.bfloat16),) * 2 if cfg.qk_norm else None
    return x, w, buffers, positions, cos, sin, bounds, scales


def qkv_rope_forms(cfg, sweep: bool = False) -> dict:
    """The paths from normed rows to attention's inputs, each (x, w, buffers, positions,
    cos, sin, bounds, scales) -> (q, keys, values); with `sweep` also the fused kernel at
    each ring of QKV_ROPE_RINGS whose contraction steps divide the model width."""
    ops = rope_write_mosaic.HeadOps(cfg.qk_norm, cfg.rms_norm_eps, cfg.clip_qkv)
    window = layers.Window(START)

    def xla_rope(qkv, positions, buffers, scales):
        return layers.rope_and_write_xla(
            qkv, positions, buffers, window, scales, ops, cfg.rope_theta, cfg.rope_dim
        )

    def xla(x, w, buffers, positions, cos, sin, bounds, scales):
        return xla_rope(jnp.einsum("btm,mkgd->btkgd", x, w), positions, buffers, scales)

    def partials(x, w) -> Partials:
        qkv = split_k_mosaic.matmul_partials(x, w.reshape(w.shape[0], -1))
        return Partials(qkv.parts.reshape(qkv.parts.shape[:-1] + w.shape[1:]), qkv.dtype)

    def epilogue(x, w, buffers, positions, cos, sin, bounds, scales):
        qkv = partials(x, w)
        return rope_write_mosaic.rope_and_write(qkv, cos, sin, buffers, bounds, scales, ops)

    def xla_epilogue(x, w, buffers, positions, cos, sin, bounds, scales):
        return xla_rope(partials(x, w).total(), positions, buffers, scales)

    def fused(x, w, buffers, positions, cos, sin, bounds, scales, tiles=None):
        return rope_write_mosaic.project_rope_and_write(
            x, w, cos, sin, buffers, bounds, scales, ops, tiles=tiles
        )

    forms = {
        "xla": xla,
        "mosaic": fused,
        "mosaic + epilogue": epilogue,
        "mosaic + xla rope": xla_epilogue,
    }
    for block_k, stages in QKV_ROPE_RINGS if sweep else ():
        if cfg.d_model % block_k:
            continue
        tiles = Tiles(block_n=cfg.head_dim, block_k=block_k, splits=1, stages=stages)
        label = f"mosaic st{stages}" if block_k == 64 else f"mosaic k{block_k} st{stages}"
        forms[label] = functools.partial(fused, tiles=tiles)
    return forms


def qkv_rope_rows(cfg, rows: int, calls: int, tiny: bool, sweep: bool) -> list[dict]:
    """Device time of each `qkv_rope_forms` path, weights L2-cold, with its error (the worst
    of q, keys and values) against XLA's path in fp32."""
    x, w, buffers, positions, cos, sin, bounds, scales = qkv_rope_inputs(
        cfg, rows, jax.random.key(0)
    )
    copies = max(1, -(-COLD_BYTES // w.nbytes)) if not tiny else 1
    ws = [w * (1 + i / 64) for i in range(copies)]
    forms = qkv_rope_forms(cfg, sweep)
    f32 = [a.astype(jnp.float32) for a in (x, w)]
    reference = forms["xla"](*f32, buffers, positions, cos, sin, bounds, scales)
    found = []
    for label, form in forms.items():
        row = {"product": "qkv_rope", "rows": rows, "k": cfg.d_model, "n": w[0].size}
        row["impl"] = label

        def run(x, ws, buffers, form=form):
            return [form(x, w, buffers, positions, cos, sin, bounds, scales) for w in ws]

        fn = jax.jit(run)
        try:
            out = fn(x, ws[:1], buffers)[0]
            row["rel_error"] = max(rel_error(o, r) for o, r in zip(out, reference, strict=True))
            time_row(row, fn, (x, ws, buffers), calls, w.nbytes, len(ws))
        except Exception as err:  # keep the other rows of a costly run
            row["error"] = f"{type(err).__name__}: {err}"[:1500]
        print({key: v for key, v in row.items() if key != "kernels_us"}, flush=True)
        found.append(row)
    return found


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
    if name.endswith(("_residual", "_tiled", "_norm")):
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
    parser.add_argument(
        "--model", choices=["dense", "moe"], default="dense", help="qkv_rope: whose heads"
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also the tilings of SWEEP_GRIDS")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config("dense", args.tiny)
    rows = []
    for name in args.products:
        if name == "qkv_rope":
            heads = model_config(args.model, args.tiny)
            rows += qkv_rope_rows(heads, args.rows, args.calls, args.tiny, args.sweep)
            continue
        k, n = products(cfg)[base_product(name)]
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
    best = fastest(rows)
    for name, line in best.items():
        print(f"fastest mosaic {name}: {line}", flush=True)
    verdicts = [line for name in args.products if (line := verdict(name, rows))]
    for line in verdicts:
        print(line, flush=True)
    results = {"results": rows, "fastest": best, "verdicts": verdicts}
    save("mosaic", {"model": args.model, "copies_bytes": COLD_BYTES, **results})


if __name__ == "__main__":
    main()
