"""Probe: does a skinny split-K product in Mosaic GPU (TMA copies, WGMMA) beat djax's Triton one?

Question. `bench.probes.pdl` showed a Mosaic GPU kernel streaming the down product's 100.7 MB
through TMA copies in 23.4 µs on an H200 (4.30 TB/s, start and tail included), where djax's
Triton split-K product takes ~25.6 µs. Does that hold once the kernel also multiplies? Each
CTA owns one column tile and one contraction slice, streams x's and w's tiles through a ring
of `stages` shared-memory slots, multiplies them with WGMMA into a 64-row fp32 accumulator
(the block's 32 rows, padded: WGMMA's smallest row tile) and writes its fp32 partial
product. Rows: the product's device time per call (µs, from profiler traces, weights
L2-cold) for each tiling and for djax's split-K product, with the error of the summed
partials against XLA's product in fp32. The Triton split-K kernel of the answer below has
left djax: the baseline row is now its Mosaic GPU successor (`split_k_mosaic`).

Answer (H200, commits 725500e-c9c63cd, result `bench/results/tma_matmul_NVIDIA_H200.json`;
the tables are in bench/NOTES.md). No: correct (1e-6 against fp32) but not faster. Down
26.5 µs against Triton's 25.6-25.9, output 11.1 against 11.1, q/k/v 26.9 against 26.1-26.4,
gate/up 52.4 against 53.8. A 2-D weight tile streams ~1.2 µs slower than contiguous tiles,
x's reads and the multiplies cost ~0.7 µs each: TMA does not read these weights faster than
Triton's loads. What Mosaic GPU offers is the kernel boundary (`bench.probes.pdl`).

`tma-t` rows are `tma_partials_t`: the same product transposed (w's tile as WGMMA's 64-row
operand, x's 32 rows unpadded), each slot refilled as soon as its product is done.

    python -m bench.probes.tma_matmul [--products qkv out down gate_up] [--rows 32] [--only-t]

GPU only (Hopper or newer).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.common import model_config, save
from bench.kernels.mosaic import products
from bench.kernels.timing import rel_error, time_row
from djax.kernels.split_k_mosaic import matmul_partials

COLD_BYTES = 256 << 20
PAD_ROWS = 64  # WGMMA's row tile


SWIZZLE = 128  # bytes: 64 bf16 columns per swizzled tile, as WGMMA reads them


def _steps(x, w, block_n: int, block_k: int, splits: int, rows_ok: bool) -> int:
    """Contraction steps per slice of x [m, k] @ w [k, n] at these tiles; raises where the
    tiles do not divide the product or `rows_ok` is False."""
    (_, k), n = x.shape, w.shape[1]
    steps = k // (splits * block_k)
    if not rows_ok or n % block_n or k % (splits * block_k) or steps < 1:
        raise ValueError(f"x {x.shape}, w {w.shape}: no {block_n}x{block_k} tiles in {splits}")
    return steps


def _ring_kernel(body, x, w, tiles, out_shape, out_tile, interpret):
    """Run `body` as the Mosaic GPU kernel both products share: one CTA per (column tile,
    slice) of w [k, n] (`tiles` = (block_n, block_k, splits, stages)), rings of `stages`
    x [m, block_k] and w [block_k, block_n] tiles swizzled for WGMMA with a barrier per
    slot, and an fp32 `out_tile` in shared memory for the CTA's partial product."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    block_n, block_k, splits, stages = tiles
    transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(w.shape[1] // block_n * splits,),
        grid_names=("cta",),
        interpret=interpret,
        scratch_types=[
            plgpu.SMEM((stages, x.shape[0], block_k), x.dtype, transforms=transforms),
            plgpu.SMEM((stages, block_k, block_n), w.dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.SMEM(out_tile, jnp.float32),
        ],
    )
    return kernel(x, w)


def _store_partial(out_smem, dst) -> None:
    """Inside a kernel: the CTA's partial product, in `out_smem`, to its place in GMEM."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, dst)
    plgpu.wait_smem_to_gmem(0)


def tma_partials(x, w, block_n: int, block_k: int, splits: int, stages: int, interpret=None):
    """fp32 partial products [splits, 64, n] of x [64, k] @ w [k, n], one CTA per (column
    tile, slice). `interpret`: Mosaic GPU's interpreter parameters (CPU tests)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = w.shape[1]
    steps = _steps(x, w, block_n, block_k, splits, x.shape[0] == PAD_ROWS)
    tiles_n = n // block_n

    def body(x_gmem, w_gmem, out_gmem, x_ring, w_ring, x_bars, w_bars, out_smem):
        cta = jax.lax.axis_index("cta")
        tile, split = cta % tiles_n, cta // tiles_n
        columns = pl.ds(tile * block_n, block_n)

        def fetch(step, slot):
            ks = pl.ds((split * steps + step) * block_k, block_k)
            plgpu.copy_gmem_to_smem(x_gmem.at[:, ks], x_ring.at[slot], x_bars.at[slot])
            plgpu.copy_gmem_to_smem(w_gmem.at[ks, columns], w_ring.at[slot], w_bars.at[slot])

        for s in range(min(stages, steps)):
            fetch(s, s)

        def scope(acc):
            @pl.loop(0, steps)
            def _step(i):
                slot = jax.lax.rem(i, stages)
                plgpu.barrier_wait(x_bars.at[slot])
                plgpu.barrier_wait(w_bars.at[slot])
                plgpu.wgmma(acc, x_ring.at[slot], w_ring.at[slot])
                plgpu.wgmma_wait(1)  # the previous step's product is done: refill its slot

                @pl.when((i > 0) & (i - 1 + stages < steps))
                def _refill():
                    fetch(i - 1 + stages, jax.lax.rem(i - 1, stages))

            plgpu.wgmma_wait(0)
            out_smem[...] = acc[...]

        pl.run_scoped(scope, plgpu.ACC((PAD_ROWS, block_n), jnp.float32))
        _store_partial(out_smem, out_gmem.at[split, :, columns])

    tiles = (block_n, block_k, splits, stages)
    out_shape, out_tile = (splits, PAD_ROWS, n), (PAD_ROWS, block_n)
    return _ring_kernel(body, x, w, tiles, out_shape, out_tile, interpret)


PARTS = ("full", "x_once", "no_mma", "w_only")


def tma_partials_t(
    x, w, block_n: int, block_k: int, splits: int, stages: int, interpret=None, parts="full"
):
    """fp32 partial products, transposed, [splits, n, rows] of x [rows, k] @ w [k, n]: each
    CTA multiplies w's tile (transposed, as WGMMA's 64-row operand) by x's rows, so x is
    not padded and its tiles take a quarter of a w tile's shared memory; each slot is
    refilled as soon as its product is done. `parts` (PARTS) drops work to find where the
    time goes, giving wrong products: `x_once` reads x's tile only at the first step,
    `no_mma` skips the multiplies, `w_only` both."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, n = x.shape[0], w.shape[1]
    steps = _steps(x, w, block_n, block_k, splits, m % 8 == 0)
    tiles_n = n // block_n

    def body(x_gmem, w_gmem, out_gmem, x_ring, w_ring, x_bars, w_bars, out_smem):
        cta = jax.lax.axis_index("cta")
        tile, split = cta % tiles_n, cta // tiles_n
        columns = pl.ds(tile * block_n, block_n)

        x_each_step = parts in ("full", "no_mma")

        def fetch(step, slot, with_x=x_each_step):
            ks = pl.ds((split * steps + step) * block_k, block_k)
            if with_x:
                plgpu.copy_gmem_to_smem(x_gmem.at[:, ks], x_ring.at[slot], x_bars.at[slot])
            plgpu.copy_gmem_to_smem(w_gmem.at[ks, columns], w_ring.at[slot], w_bars.at[slot])

        for s in range(min(stages, steps)):
            fetch(s, s, with_x=x_each_step or (parts == "x_once" and s == 0))
        if parts == "x_once":
            plgpu.barrier_wait(x_bars.at[0])

        def scope(acc):
            @pl.loop(0, steps)
            def _step(i):
                slot = jax.lax.rem(i, stages)
                if x_each_step:
                    plgpu.barrier_wait(x_bars.at[slot])
                plgpu.barrier_wait(w_bars.at[slot])
                if parts in ("full", "x_once"):
                    plgpu.wgmma(
                        acc,
                        w_ring.at[slot].transpose((1, 0)),
                        x_ring.at[slot if x_each_step else 0].transpose((1, 0)),
                    )
                    plgpu.wgmma_wait(0)

                @pl.when(i + stages < steps)
                def _refill():
                    fetch(i + stages, slot)

            out_smem[...] = acc[...]

        pl.run_scoped(scope, plgpu.ACC((block_n, m), jnp.float32))
        _store_partial(out_smem, out_gmem.at[split, columns])

    tiles = (block_n, block_k, splits, stages)
    return _ring_kernel(body, x, w, tiles, (splits, n, m), (block_n, m), interpret)


def padded(x):
    """x [rows, k] with zero rows up to PAD_ROWS."""
    return jnp.pad(x, ((0, PAD_ROWS - x.shape[0]), (0, 0)))


TILINGS = [  # (block_n, block_k, splits, stages)
    (128, 128, 4, 3),
    (128, 64, 4, 6),
    (64, 128, 2, 4),
    (128, 64, 8, 6),
    (128, 64, 1, 6),
    (128, 64, 2, 6),
    (128, 128, 1, 3),
    (64, 128, 1, 4),
    (64, 64, 1, 6),
    (256, 64, 1, 3),
]


T_TILINGS = [  # tma_partials_t's (block_n, block_k, splits, stages)
    (128, 128, 4, 5),
    (256, 64, 8, 5),
    (128, 64, 4, 8),
    (128, 128, 2, 5),
    (128, 128, 1, 5),
    (64, 128, 1, 6),
    (128, 64, 2, 8),
    (256, 64, 1, 5),
]


def fits(k: int, n: int, tiling, x_rows: int = PAD_ROWS) -> bool:
    """Whether a tiling divides the product, gives 48-528 CTAs, at least 4 steps per slice,
    and its rings and output tile fit in 224 KB of shared memory."""
    bn, bk, sp, st = tiling
    if n % bn or k % (sp * bk) or k // (sp * bk) < 4:
        return False
    ctas = (n // bn) * sp
    smem = st * (x_rows * bk + bk * bn) * 2 + x_rows * bn * 4
    return 48 <= ctas <= 528 and smem <= 224 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--products", nargs="+", choices=["qkv", "out", "gate_up", "down"], default=["down"]
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--only-t", action="store_true", help="skip the padded kernel's rows")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=["full"], help="tma-t: work kept (PARTS)"
    )
    parser.add_argument("--tilings", type=int, default=None, help="tma-t: only the first N")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"bench.probes.tma_matmul needs a Hopper GPU; got {jax.devices()}")
    cfg = model_config("dense", False)
    rows = []
    for name in args.products:
        k, n = products(cfg)[name]
        keys = jax.random.split(jax.random.key(0), 2)
        w = (jax.random.normal(keys[0], (k, n)) * k**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(keys[1], (args.rows, k), jnp.bfloat16)
        copies = max(1, -(-COLD_BYTES // w.nbytes))
        ws = [w * (1 + i / 64) for i in range(copies)]
        reference = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
        summed = lambda parts: parts.sum(0)[: args.rows]  # noqa: E731
        forms = {"djax split-K": (lambda x, w: matmul_partials(x, w).parts, summed)}
        for bn, bk, sp, st in [t for t in TILINGS if fits(k, n, t) and not args.only_t]:
            label = f"tma {bn}x{bk} splits{sp} st{st}"
            form = lambda x, w, t=(bn, bk, sp, st): tma_partials(padded(x), w, *t)  # noqa: E731
            forms[label] = (form, summed)
        for bn, bk, sp, st in [t for t in T_TILINGS if fits(k, n, t, args.rows)][: args.tilings]:
            for part in args.parts:
                label = f"tma-t {bn}x{bk} splits{sp} st{st}" + ("" if part == "full" else part)
                form = lambda x, w, t=(bn, bk, sp, st), p=part: tma_partials_t(  # noqa: E731
                    x, w, *t, parts=p
                )
                forms[label] = (form, lambda parts: parts.sum(0).T)
        for label, (form, total) in forms.items():
            row = {"product": name, "k": k, "n": n, "rows": args.rows, "impl": label}

            def run(x, ws, form=form):
                return [form(x, w) for w in ws]

            fn = jax.jit(run)
            try:
                parts = fn(x, ws[:1])[0]
                row["rel_error"] = rel_error(total(parts), reference)
                time_row(row, fn, (x, ws), args.calls, w.nbytes, len(ws))
            except Exception as err:  # keep the other rows of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print({k: v for k, v in row.items() if k != "kernels_us"}, flush=True)
            rows.append(row)
    save("tma_matmul", {"options": vars(args), "results": rows})


if __name__ == "__main__":
    main()
