"""LLaDA-8B's q/k/v, attention-output and down products at block rows, XLA against djax's
split-K kernel (`djax.kernels.split_k`) with its partials summed by the consumer.

`xla` is the product as XLA runs it inside a layer: for the output and down products with
the residual add and RMSNorm after them (`layers.RMSNorm`'s XLA path), for q/k/v alone.
`pallas` is the split-K kernel, its partials summed by `residual_norm.add_rms_norm` for the
output and down products (q/k/v: the kernel alone; `rope_write` sums its partials), at the
default tiles (`tiles_for`) and at each tiling of the sweep. `--mosaic` adds JAX's own
warp-specialized Hopper matmul (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`: TMA
loads, Mosaic GPU) at a few tile shapes, its rows padded to 64 (its smallest row tile),
followed by XLA's add and norm where `xla` has them: a first look at whether TMA streaming
reads the weights faster than Triton's loads (it does not: bench/NOTES.md). Each call
cycles through enough copies of the weight (>= 256 MB) that no copy is still in the L2 cache
when it is read again, as inside a forward. Device time per product from profiler traces
(µs, summed over its kernels); `weight_TB_per_s` is weight bytes over that time.

`qkv_rope` is the q/k/v product with what follows it up to attention (q/k norm, RoPE, the
window's K/V written into a 384-position buffer at 128): `xla` (XLA's product and head ops),
`pallas` (the split-K kernel, then `rope_write.rope_and_write`) and `fused` (the product
inside that kernel, `rope_write.project_rope_and_write`), and their Pallas Mosaic GPU forms
(Hopper GPUs): `mosaic` (`split_k_mosaic.matmul_partials`, then the Triton
`rope_and_write`: `matmul_impl="mosaic"`; `mosaic_xla`: its partials summed, then XLA's
head ops and writes, whether XLA can take that epilogue; `mosaic_epilogue`: then the
Mosaic GPU epilogue, `rope_write_mosaic.rope_and_write`) and `mosaic_fused` (the product
with RoPE and the writes in its epilogue, `rope_write_mosaic.project_rope_and_write`:
`rope_impl="mosaic"`), for LLaDA-8B or, with `--model moe`, LLaDA-MoE's heads.

    python -m bench.kernels.split_k [--model dense] [--rows 32] [--products qkv out down qkv_rope]
        [--sweep] [--norm-warps 4 8] [--mosaic] [--fused-sweep] [--tiny]
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
    residual_product,
    rope_write,
    rope_write_mosaic,
    split_k_mosaic,
    tma_ring,
)
from djax.kernels.residual_norm import add_rms_norm, add_scaled
from djax.kernels.split_k import Tiles, matmul_partials, tiles_for
from djax.models import layers

COLD_BYTES = 256 << 20
EPS = 1e-5


def products(cfg) -> dict[str, tuple[int, int]]:
    """(k, n) of a block layer's products: q/k/v, attention output, down, gate/up."""
    m, heads = cfg.d_model, cfg.n_heads * cfg.head_dim
    return {
        "qkv": (m, heads + 2 * cfg.n_kv_heads * cfg.head_dim),
        "out": (heads, m),
        "down": (cfg.mlp_hidden, m),
        "gate_up": (m, 2 * cfg.mlp_hidden),
    }


def xla_form(name, x, residual, scale, w):
    y = x @ w
    if name == "qkv":
        return y
    return layers.RMSNorm(EPS, jnp.bfloat16, "xla").apply({"params": {"scale": scale}}, y, residual)


def pallas_form(name, x, residual, scale, w, tiles=None, norm_warps=16):
    y = matmul_partials(x, w, tiles=tiles)
    if name == "qkv":
        return y.parts
    return add_rms_norm(residual, y, scale, EPS, num_warps=norm_warps)


def scaled_form(name, x, residual, scale, w, block_n=32, num_warps=4):
    """The split-K product, then the tiled residual add leaving the norm to the next
    product (`add_scaled`): (h, ScaledRows)."""
    y = matmul_partials(x, w)
    return add_scaled(residual, y, scale, EPS, block_n=block_n, num_warps=num_warps)


# --scaled: (block_n, num_warps) of `scaled_form`
SCALED_TILES = ((32, 4), (16, 4), (64, 4), (32, 2), (32, 8))


def residual_form(name, x, residual, scale, w, tiles=None):
    """The unsplit product with the residual add in its epilogue, the norm left to the next
    product (`residual_product`): (h, ScaledRows)."""
    return residual_product.residual_product(x, w, residual, scale, EPS, tiles=tiles)


# --residual: (block_n, block_k, num_stages) of `residual_form`, 4 warps
RESIDUAL_TILES = (
    (32, 128, 4),
    (32, 128, 6),
    (32, 128, 8),
    (32, 128, 10),
    (32, 128, 12),
    (32, 256, 4),
    (32, 256, 5),
    (32, 256, 6),
    (32, 512, 3),
    (32, 64, 16),
    (64, 128, 6),
    (64, 128, 8),
)


# JAX's Hopper matmul tiles rows by 64 (one warpgroup's wgmma); the block's rows are padded.
MOSAIC_ROWS = 64
# (tile_n, tile_k, max_concurrent_steps): two compute warpgroups split each CTA's columns, so
# a CTA covers 2 x tile_n columns.
MOSAIC_TILES = ((64, 64, 4), (64, 64, 6), (64, 64, 8), (64, 128, 4), (128, 64, 4))


def mosaic_form(name, x, residual, scale, w, tiles=(64, 64, 4)):
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hopper

    tile_n, tile_k, steps = tiles
    config = hopper.TuningConfig(
        tile_m=MOSAIC_ROWS,
        tile_n=tile_n,
        tile_k=tile_k,
        max_concurrent_steps=steps,
        epi_tile_m=MOSAIC_ROWS,
        epi_tile_n=min(tile_n, 64),
    )
    rows = x.shape[0]
    padded = jnp.pad(x, ((0, -rows % MOSAIC_ROWS), (0, 0)))
    y = hopper.matmul(padded, w, None, config)[:rows]
    if name == "qkv":
        return y
    return layers.RMSNorm(EPS, jnp.bfloat16, "xla").apply({"params": {"scale": scale}}, y, residual)


BUFFER, START = 384, 128  # the dual cache's K/V buffer at the setting, the first block


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


# --fused-sweep: the Triton fused kernel at these (num_warps, num_stages) besides its default
# (4, 4), and the Mosaic GPU one at these ring stages (its block_n is head_dim, block_k 64)
FUSED_SWEEP = ((4, 3), (4, 5), (8, 3), (8, 4), (8, 5))
MOSAIC_FUSED_STAGES = (3, 4, 5, 6)


def qkv_rope_forms(cfg, fused_sweep: bool = False) -> dict:
    """The paths from normed rows to attention's inputs, each (x, w, buffers,
    positions, cos, sin, bounds, scales) -> (q, keys, values); with `fused_sweep` also the
    fused kernel at each FUSED_SWEEP setting."""
    ops = rope_write.HeadOps(cfg.qk_norm, cfg.rms_norm_eps, cfg.clip_qkv)
    window = layers.Window(START)

    def xla(x, w, buffers, positions, cos, sin, bounds, scales):
        qkv = jnp.einsum("btm,mkgd->btkgd", x, w)
        return layers.rope_and_write_xla(
            qkv, positions, buffers, window, scales, ops, cfg.rope_theta, cfg.rope_dim
        )

    def pallas(x, w, buffers, positions, cos, sin, bounds, scales):
        qkv = matmul_partials(x, w.reshape(w.shape[0], -1))
        qkv = type(qkv)(qkv.parts.reshape(qkv.parts.shape[:-1] + w.shape[1:]), qkv.dtype)
        return rope_write.rope_and_write(qkv, cos, sin, buffers, bounds, scales, ops)

    def fused(x, w, buffers, positions, cos, sin, bounds, scales, warps=4, stages=4):
        return rope_write.project_rope_and_write(
            x, w, cos, sin, buffers, bounds, scales, ops, num_warps=warps, num_stages=stages
        )

    def mosaic(x, w, buffers, positions, cos, sin, bounds, scales):
        qkv = split_k_mosaic.matmul_partials(x, w.reshape(w.shape[0], -1))
        qkv = type(qkv)(qkv.parts.reshape(qkv.parts.shape[:-1] + w.shape[1:]), qkv.dtype)
        return rope_write.rope_and_write(qkv, cos, sin, buffers, bounds, scales, ops)

    def mosaic_xla(x, w, buffers, positions, cos, sin, bounds, scales):
        qkv = split_k_mosaic.matmul_partials(x, w.reshape(w.shape[0], -1)).total()
        return layers.rope_and_write_xla(
            qkv.reshape(qkv.shape[:-1] + w.shape[1:]),
            positions,
            buffers,
            window,
            scales,
            ops,
            cfg.rope_theta,
            cfg.rope_dim,
        )

    def mosaic_epilogue(x, w, buffers, positions, cos, sin, bounds, scales):
        qkv = split_k_mosaic.matmul_partials(x, w.reshape(w.shape[0], -1))
        qkv = type(qkv)(qkv.parts.reshape(qkv.parts.shape[:-1] + w.shape[1:]), qkv.dtype)
        return rope_write_mosaic.rope_and_write(qkv, cos, sin, buffers, bounds, scales, ops)

    def mosaic_fused(x, w, buffers, positions, cos, sin, bounds, scales, tiles=None):
        return rope_write_mosaic.project_rope_and_write(
            x, w, cos, sin, buffers, bounds, scales, ops, tiles=tiles
        )

    forms = {
        "xla": xla,
        "pallas": pallas,
        "fused": fused,
        "mosaic": mosaic,
        "mosaic_xla": mosaic_xla,
        "mosaic_epilogue": mosaic_epilogue,
        "mosaic_fused": mosaic_fused,
    }
    for warps, stages in FUSED_SWEEP if fused_sweep else ():
        forms[f"fused w{warps} st{stages}"] = functools.partial(fused, warps=warps, stages=stages)
    for stages in MOSAIC_FUSED_STAGES if fused_sweep else ():
        tiles = tma_ring.Tiles(block_n=cfg.head_dim, block_k=64, splits=1, stages=stages)
        forms[f"mosaic_fused st{stages}"] = functools.partial(mosaic_fused, tiles=tiles)
    return forms


def qkv_rope_rows(cfg, rows: int, calls: int, tiny: bool, fused_sweep: bool) -> list[dict]:
    """Device time of each `qkv_rope_forms` path, weights L2-cold, with its error against
    XLA's path in fp32."""
    x, w, buffers, positions, cos, sin, bounds, scales = qkv_rope_inputs(
        cfg, rows, jax.random.key(0)
    )
    copies = max(1, -(-COLD_BYTES // w.nbytes))
    ws = [w * (1 + i / 64) for i in range(copies)] if not tiny else [w]
    forms = qkv_rope_forms(cfg, fused_sweep)
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
        print(row, flush=True)
        found.append(row)
    return found


def sweep(k: int, n: int) -> list[Tiles]:
    """Slices x column tiles x contraction steps, 4 stages (3 for 256-column tiles), at
    least 4 steps per slice and at most ~8 waves of programs."""
    found = []
    for splits, block_n, block_k in itertools.product((1, 2, 4, 8, 16), (64, 128, 256), (64, 128)):
        if n % block_n or k % (splits * block_k) or k // (splits * block_k) < 4:
            continue
        if (n // block_n) * splits > 1100:
            continue
        found.append(Tiles(32, block_n, block_k, splits, 4, 3 if block_n == 256 else 4))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument(
        "--products",
        nargs="+",
        choices=["qkv", "out", "down", "qkv_rope"],
        default=["qkv", "out", "down", "qkv_rope"],
    )
    parser.add_argument("--sweep", action="store_true", help="also every tiling of the sweep")
    parser.add_argument(
        "--norm-warps",
        nargs="*",
        type=int,
        default=[],
        help="also the default tiles with the norm kernel at these warp counts (output, down)",
    )
    parser.add_argument(
        "--mosaic", action="store_true", help="also JAX's Hopper Mosaic GPU matmul (GPUs only)"
    )
    parser.add_argument(
        "--fused-sweep", action="store_true", help="qkv_rope: the fused kernel at FUSED_SWEEP"
    )
    parser.add_argument(
        "--residual",
        action="store_true",
        help="output, down: also the unsplit product with the residual add in its epilogue",
    )
    parser.add_argument(
        "--scaled",
        action="store_true",
        help="output, down: also the split-K product with the tiled residual add (add_scaled)",
    )
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config(args.model, args.tiny)
    rows = []
    for name in args.products:
        if name == "qkv_rope":
            rows += qkv_rope_rows(cfg, args.rows, args.calls, args.tiny, args.fused_sweep)
            continue
        k, n = products(cfg)[name]
        keys = jax.random.split(jax.random.key(0), 3)
        w = (jax.random.normal(keys[0], (k, n)) * k**-0.5).astype(jnp.bfloat16)
        copies = max(1, -(-COLD_BYTES // w.nbytes))
        ws = [w * (1 + i / 64) for i in range(copies)] if not args.tiny else [w]
        x = jax.random.normal(keys[1], (args.rows, k), jnp.bfloat16)
        residual = jax.random.normal(keys[2], (args.rows, n), jnp.bfloat16)
        scale = jnp.ones((n,), jnp.bfloat16)
        reference = xla_form(name, x.astype(jnp.float32), residual, scale, w.astype(jnp.float32))
        runs = [("xla", xla_form), ("pallas", pallas_form)]
        if args.sweep:
            runs += [
                (
                    f"pallas s{t.splits} {t.block_n}x{t.block_k} st{t.num_stages}",
                    functools.partial(pallas_form, tiles=t),
                )
                for t in sweep(k, n)
            ]
        if args.mosaic:
            runs += [
                (f"mosaic {n_}x{k_} st{st}", functools.partial(mosaic_form, tiles=(n_, k_, st)))
                for n_, k_, st in MOSAIC_TILES
            ]
        if name != "qkv":
            runs += [
                (f"pallas norm w{warps}", functools.partial(pallas_form, norm_warps=warps))
                for warps in args.norm_warps
            ]
        if args.scaled and name != "qkv":
            runs += [
                (
                    f"scaled {bn} w{warps}",
                    functools.partial(scaled_form, block_n=bn, num_warps=warps),
                )
                for bn, warps in SCALED_TILES
            ]
        if args.residual and name != "qkv":
            runs += [
                (
                    f"residual {n_}x{k_} st{st}",
                    functools.partial(
                        residual_form, tiles=residual_product.Tiles(32, n_, k_, 4, st)
                    ),
                )
                for n_, k_, st in RESIDUAL_TILES
                if n % n_ == 0 and k % k_ == 0
            ]
        for label, form in runs:
            row = {"product": name, "rows": args.rows, "k": k, "n": n, "impl": label}
            if label == "pallas":
                row["tiles"] = str(tiles_for(args.rows, k, n))
            fn = jax.jit(
                lambda x, r, s, ws, form=form, name=name: [form(name, x, r, s, w) for w in ws]
            )
            try:
                out = fn(x, residual, scale, ws[:1])[0]
                if isinstance(out[1], residual_product.ScaledRows):  # the norm, done by XLA
                    scaled = out[1]
                    out = (out[0], scaled.scaled.astype(jnp.float32) * scaled.inv_rms())
                out = out[1] if isinstance(out, tuple) else out
                out = out.sum(0) if out.ndim == 3 else out
                ref = reference[1] if isinstance(reference, tuple) else reference
                row["rel_error"] = rel_error(out, ref)
                time_row(row, fn, (x, residual, scale, ws), args.calls, w.nbytes, len(ws))
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print(row, flush=True)
            rows.append(row)
    save("split_k", {"model": args.model, "copies_bytes": COLD_BYTES, "results": rows})


if __name__ == "__main__":
    main()
