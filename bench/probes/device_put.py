"""Probe: do e4m3 arrays copy from the host to the GPU slower per byte than bf16 ones?

Question. In the profiled loads of `bench.load` (H100, 4087e2b) orbax's host-to-device
copies ran at 2.4 GB/s for the bf16 folder's 16 GB and at 1.5 GB/s for the fp8 folder's
8 GB (323 arrays against 195, a quarter of them small fp32 scales), so a converted fp8 load
took 0.65x the bf16 one where half the bytes would give ~0.5x. Is the slow part the e4m3
dtype (a conversion path in `jax.device_put`), the number of arrays, or orbax's restore?

Answer (H100, a414cd5, `bench/results/device_put_NVIDIA_H100_80GB_HBM3.json`): not the
dtype. One 1 GiB array copies at 17.3 GB/s as bf16, 13.8 as e4m3 and 15.1 as uint8; one
layer's arrays at 17.6 GB/s in e4m3 (with their scales) and 19.1 as uint8 (bf16's 2.0 was
the first multi-array copy of the run); an orbax restore of 8 layers at 5.1 GB/s in bf16,
5.2 in e4m3 and 4.8 as uint8. So restoring the values as bytes would gain nothing, and an
orbax restore from the page cache runs at ~5 GB/s per byte in either dtype. The loads'
1.5-2.4 GB/s is the disk: in the next `bench.load` run on that machine kind, reading each
folder once before its load took 9.3-10.7 s for the bf16 folder's 16 GB and 5.2 s for the
fp8 folder's 8.5 GB (~1.6 GB/s), the loads after it 12.3-12.6 s and 9.1 s (bench/NOTES.md).

Method. The same bytes, placed three ways, each timed as the median of `--repeats` runs:
`jax.device_put` of one 1 GiB host array as e4m3, bf16 and uint8; of one layer of LLaDA-8B's
weights (q/k/v/o [4096, 4096], gate/up [4096, 12288] each, down [12288, 4096]) in bf16, in
e4m3 with per-output-channel fp32 scales, and in uint8 with the scales; and an orbax
restore (uncompressed, as `djax convert` writes) of `--layers` such layers in each form into
device arrays, as `djax.load` restores.

    python -m bench.probes.device_put [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from bench.common import save

LAYER = {
    "q": (4096, 4096),
    "k": (4096, 4096),
    "v": (4096, 4096),
    "o": (4096, 4096),
    "gate": (4096, 12288),
    "up": (4096, 12288),
    "down": (12288, 4096),
}
FORMS = ("bfloat16", "float8_e4m3fn", "uint8")


def layer_arrays(form: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One layer's weights as host arrays of `form`; e4m3 and uint8 (its bytes) carry a fp32
    scale per output column, as `djax.models.fp8` stores them."""
    out = {}
    for name, shape in LAYER.items():
        if form == "bfloat16":
            out[name] = rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)
            continue
        values = rng.standard_normal(shape, np.float32).astype(ml_dtypes.float8_e4m3fn)
        out[name] = values.view(np.uint8) if form == "uint8" else values
        out[f"{name}_scale"] = np.ones(shape[-1], np.float32)
    return out


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks until its copies are done) over `repeats`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def put(tree) -> None:
    jax.block_until_ready(jax.device_put(tree))


def orbax_restore(folder: Path, tree: dict, repeats: int) -> float:
    import orbax.checkpoint as ocp

    writer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    writer.save(folder, args=ocp.args.PyTreeSave(tree))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), tree)
    reader = ocp.Checkpointer(ocp.StandardCheckpointHandler())

    def restore():
        jax.block_until_ready(reader.restore(folder, args=ocp.args.StandardRestore(target)))

    return timed(restore, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="layers in the orbax restore")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for form in FORMS:
        itemsize = np.dtype(getattr(ml_dtypes, form, form)).itemsize
        whole = np.zeros(2**30 // itemsize, getattr(ml_dtypes, form, form))
        put(whole)  # the first copy of a dtype compiles nothing but warms the transfer path
        seconds = timed(lambda whole=whole: put(whole), args.repeats)
        rows.append({"what": "one 1 GiB array", "form": form, "gb": whole.nbytes / 1e9})
        rows[-1].update(seconds=seconds, gb_per_s=whole.nbytes / 1e9 / seconds)
        del whole
        layer = layer_arrays(form, rng)
        nbytes = sum(a.nbytes for a in layer.values())
        seconds = timed(lambda layer=layer: put(layer), args.repeats)
        rows.append({"what": "one layer's arrays", "form": form, "gb": nbytes / 1e9})
        rows[-1].update(arrays=len(layer), seconds=seconds, gb_per_s=nbytes / 1e9 / seconds)
        tree = {f"layer_{i}": layer for i in range(args.layers)}
        with tempfile.TemporaryDirectory() as tmp:
            seconds = orbax_restore(Path(tmp) / "params", tree, args.repeats)
        rows.append({"what": f"orbax restore of {args.layers} layers", "form": form})
        rows[-1].update(gb=nbytes * args.layers / 1e9, seconds=seconds)
        rows[-1]["gb_per_s"] = rows[-1]["gb"] / seconds
        for row in rows[-3:]:
            rate = f"{row['seconds']:.3f} s, {row['gb_per_s']:.2f} GB/s"
            print(f"{row['what']:>28} {form:>14}: {rate}")
    save("device_put", {"options": vars(args), "results": rows})


if __name__ == "__main__":
    main()
