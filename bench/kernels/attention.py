"""One layer's attention per implementation, at the shapes a generation runs: a denoising
block (32 queries) against the K/V buffer, and a refresh (all queries against all keys).

Implementations: `xla` (einsums), `cudnn` (with the key-padding mask, as the engine calls
it), `cudnn no mask` (what cuDNN takes when nothing is padded; a bound, not an engine path)
and `split_kv` (djax's flash-decoding kernel, `flash_attention_mosaic`: Pallas Mosaic GPU,
Hopper only) at several tilings. Each is
checked against fp32 einsums (relative L2 error) and timed twice: in-program, where
`step_only` is the cost of the loop's own `q + 1e-3 * out` update, to subtract; and by its
kernels' device time in a profiler trace (`kernels_us` per kernel, `device_us` their sum:
every kernel the call launches, e.g. the split-K/V kernel, the merge of its slices and the
key-bias kernel that a generation runs once per forward; no loop).

    python -m bench.kernels.attention [--shapes 32x384 32x1280 384x384] [--model dense|moe]
        [--batch 1] [--impls xla cudnn split_kv] [--tiny]

`--impls` keeps the implementations whose label starts with one of the given words. Off
GPUs (`--tiny`) the kernels run in their interpreters and the times are wall times.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from bench.common import model_config, save, time_in_program
from bench.kernels.timing import kernel_us
from djax.kernels import flash_attention_mosaic
from djax.models.layers import attend

# The kernel's tilings: (block_k, splits, stages, warpgroups), beside `tiles_for`'s; splits
# past the key blocks are clamped. Two stages leave room for two CTAs per SM (batch 8: 256
# CTAs). Warpgroups: key slices of one CTA merged in the kernel (each with its own ring),
# alone or with splits across CTAs merged in XLA.
TILINGS = tuple(
    flash_attention_mosaic.Tiles(block_k=bk, splits=splits, stages=stages, warpgroups=wgs)
    for bk, splits, stages, wgs in (
        (64, 1, 4, 1),
        (64, 1, 2, 1),
        (64, 2, 4, 1),
        (64, 3, 2, 1),
        (64, 6, 2, 1),
        (128, 1, 2, 1),
        (128, 3, 2, 1),
        (64, 1, 2, 2),
        (64, 1, 2, 3),
        (64, 1, 1, 3),
        (128, 1, 1, 2),
        (128, 1, 1, 3),
        (64, 2, 2, 2),
        (64, 2, 2, 3),
        (64, 3, 2, 2),
    )
)


def _label(name: str, tiles) -> str:
    shape = " ".join(f"{k}={v}" for k, v in vars(tiles).items()) if tiles else "tiles_for"
    return f"{name} {shape}"


def _cudnn_no_mask(q, keys, values, key_valid):
    return jax.nn.dot_product_attention(q, keys, values, implementation="cudnn")


def implementations() -> list[tuple[str, object]]:
    def grouped(impl):
        def run(q, keys, values, key_valid):
            b, t, n, d = q.shape
            k = keys.shape[2]
            out = attend(q.reshape(b, t, k, n // k, d), keys, values, key_valid, impl)
            return out.reshape(q.shape)

        return run

    out = [("xla", grouped("xla"))]
    if jax.default_backend() == "gpu":
        out += [("cudnn", grouped("cudnn")), ("cudnn no mask", _cudnn_no_mask)]
    kernel = flash_attention_mosaic.split_kv_attention
    for tiles in (None, *TILINGS):  # None: the engine's choice, `tiles_for`
        out.append((_label("split_kv", tiles), functools.partial(kernel, tiles=tiles)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["32x384", "32x1280", "384x384", "1280x1280"]
    )
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--batch", type=int, default=1, help="sequences (rows of q and K/V)")
    parser.add_argument("--impls", nargs="+", help="label prefixes to keep (default: all)")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--calls", type=int, default=50, help="calls in the profiler trace")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    cfg = model_config(args.model, args.tiny)
    n, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    impls = implementations()
    if args.impls:  # the fp32 reference stays first
        impls = impls[:1] + [i for i in impls[1:] if i[0].startswith(tuple(args.impls))]
    b = args.batch
    rows = []
    for shape in args.shapes:
        t, s = (int(v) for v in shape.split("x"))
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, s, kv, d), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, kv, d), jnp.bfloat16)
        valid = jnp.ones((b, s), bool)
        f32 = [a.astype(jnp.float32) for a in (q, k, v)]
        reference = impls[0][1](*f32, valid)  # einsums in fp32

        def step(q, k, v, valid, run=None):
            return q + (1e-3 * run(q, k, v, valid)).astype(q.dtype)

        base = time_in_program(lambda q, k, v, valid: q + 1e-3 * q, q, args.iters, k, v, valid)
        rows.append({"batch": b, "queries": t, "keys": s, "impl": "step_only", "us": 1e6 * base})
        print(rows[-1], flush=True)
        for label, run in impls:
            row = {"batch": b, "queries": t, "keys": s, "impl": label}
            try:
                out = jax.jit(run)(q, k, v, valid).astype(jnp.float32)
                err = jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)
                row["rel_error"] = float(err)
                seconds = time_in_program(
                    functools.partial(step, run=run), q, args.iters, k, v, valid
                )
                row["us"] = 1e6 * seconds
                row["us_minus_step"] = 1e6 * (seconds - base)
                row["kernels_us"] = kernel_us(jax.jit(run), (q, k, v, valid), args.calls)
                row["device_us"] = sum(row["kernels_us"].values())
            except Exception as err:  # keep the other implementations of a costly run
                row["error"] = f"{type(err).__name__}: {err}"[:1500]
            print(row, flush=True)
            rows.append(row)
    # one file per model and batch (the default run's name as before)
    setting = "_".join(([args.model] if args.model != "dense" else []) + [f"batch{b}"] * (b > 1))
    payload = {"model": args.model, "batch": b, "heads": [n, kv, d], "results": rows}
    save("attention", payload, setting or None)


if __name__ == "__main__":
    main()
