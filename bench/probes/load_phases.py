"""Probe: where does a cold load of a converted checkpoint spend what its bytes do not explain?

Question. On the H100 machine a cold load (cached pages dropped) of LLaDA-8B's converted
folder took 13.5-14.0 s in bf16 (16.0 GB) and 10.0-10.3 s in fp8 (8.5 GB), where its disk
reads ~2 GB/s, 8.0 / 4.3 s of bytes (bench/NOTES.md, "Load copies"): ~5.7 s a load in
both formats go elsewhere, and issue 28 asks the fp8 load for at most 0.6x the bf16 one.
Are the reads and the host-to-device copies of orbax's restore serial (read, then copy),
and would a restore that copies one array while reading the next take them back?

Method. At the LLaDA-8B shape (or `--tiny`), random weights built on the device in each
format (`dtype`, `fp8`) are written with `checkpoint.save_orbax`, as `djax convert` writes
them, into a fresh folder under `--scratch`. Then, per format, each phase timed with the
checkpoint's cached pages dropped first (`posix_fadvise(DONTNEED)`) unless it says "warm":

- `read`: orbax restores every array into host memory (numpy), no device: the reads;
- `put` (warm: the host arrays of `read`): `jax.device_put` of them, the copies alone;
- `restore`: orbax restores into device arrays, as `djax.load` does (`restore_orbax`'s
  call, without djax's checks);
- `load`: `checkpoint.restore_orbax`, the whole converted load after the config (the
  checks, the fingerprints), the figure `bench.load` times in a fresh process;
- `overlapped`: the arrays in `--groups` groups of whole layers, each group restored into
  host memory by a reader thread while the one before it is copied to the device: reads
  and copies overlapped by hand;
- `steps`: `djax.load` of the folder (its `config.json` written beside the checkpoint) in
  a fresh Python process, as `bench.load` times it, with the start and end of each of its
  steps (seconds from the call; `steps` in the row): the restore, the scans' programs
  compiled ahead and waited for, the scans, the fp8 values' move and its program's wait.
  A fresh process pays what this one paid before its first phase. The move is timed to
  its end on the device. This process does not preallocate JAX's pool (from 2026-11-28
  on), so the child finds the device as a load does.

One small restore runs first, so the process's one-time costs (tensorstore's and orbax's
first calls) fall in no phase. Predicted before any run: `restore` ~ `read` + `put` (serial)
and `overlapped` ~ max(`read`, `put`) plus a group's copy.

    python -m bench.probes.load_phases [--weights dtype fp8] [--phases read ... steps]
        [--groups 8] [--scratch DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import MODELS, TINY, model_config, save
from bench.load import drop_cached, folder_bytes
from djax import checkpoint
from djax.models import abstract_params, init_params

DTYPE = jnp.bfloat16
CHILD_ENV: dict = {}  # the steps' child's environment: this process's as it started
PHASES = ("read", "restore", "load", "overlapped", "steps")


def restore(folder: Path, names: list[str], abstract: dict, device: bool) -> dict:
    """The params `names` of the checkpoint under `folder`, restored into device arrays
    (`device`) or into host numpy arrays."""
    import orbax.checkpoint as ocp

    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    item = {name: abstract[name] for name in names}
    if device:
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=sharding), item)
    else:
        restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray), item)
    handler = ocp.PyTreeCheckpointHandler()
    with ocp.Checkpointer(handler) as reader:
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        return reader.restore(folder / checkpoint.PARAMS_DIR, args=args)


def groups_of(names: list[str], count: int) -> list[list[str]]:
    """`names` (sorted param names, `<part>_<layer>` for a layer's) cut into at most `count`
    groups of whole layers, the other params (embedding, head, norms) in the first."""
    layer_of = {n: int(n.rpartition("_")[2]) for n in names if n.rpartition("_")[2].isdigit()}
    layers = sorted(set(layer_of.values()))
    per = max(1, -(-len(layers) // count))
    cuts = [layers[i : i + per] for i in range(0, len(layers), per)]
    groups = [[n for n in names if layer_of.get(n) in set(cut)] for cut in cuts]
    groups[0] = [n for n in names if n not in layer_of] + groups[0]
    return groups


def overlapped(folder: Path, groups: list[list[str]], abstract: dict) -> float:
    """Seconds to restore `groups` into host memory in a reader thread while the main thread
    copies each finished group to the device."""
    ready: queue.Queue = queue.Queue(maxsize=2)

    def reader():
        for group in groups:
            ready.put(restore(folder, group, abstract, device=False))
        ready.put(None)

    start = time.perf_counter()
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    placed = []
    while (host := ready.get()) is not None:
        placed.append(jax.device_put(host))
    jax.block_until_ready(placed)
    thread.join()
    return time.perf_counter() - start


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def timeline(folder: Path) -> dict:
    """In this (fresh) process: `djax.load(folder)`'s seconds (`load`) and, by step, its
    calls' first start, last end (seconds from the load's start), count and seconds."""
    from djax import checkpoint, model
    from djax.models import fp8

    spans: dict = {}
    start = time.perf_counter()

    def timed_call(name: str, fn):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            out = fn(*args, **kwargs)
            end = time.perf_counter()
            span = spans.setdefault(name, {"first": begin - start, "calls": 0, "seconds": 0.0})
            span.update(last=end - start, calls=span["calls"] + 1)
            span["seconds"] += end - begin
            return out

        return call

    class TimedFuture:
        def __init__(self, future, name):
            self.result = timed_call(name, future.result)

    compile_scans = checkpoint.compile_scans

    def scans_ahead(*args):
        return timed_call("wait for a scan program", compile_scans(*args))

    compile_ahead = fp8.Layout.compile_ahead

    def layout_ahead(self, abstract):
        layout = compile_ahead(self, abstract)
        waited = TimedFuture(layout.compiled, "wait for the move's program")
        return dataclasses.replace(layout, compiled=waited)

    checkpoint.check_orbax = timed_call("check_orbax", checkpoint.check_orbax)
    checkpoint.compile_scans = timed_call("compile_scans (start)", scans_ahead)
    checkpoint._scanned = timed_call("scans", checkpoint._scanned)
    reader = checkpoint._checkpointer

    def checkpointer():
        made = reader()
        made.restore = timed_call("orbax restore", made.restore)
        return made

    checkpoint._checkpointer = checkpointer
    fp8.Layout.compile_ahead = timed_call("compile the move (start)", layout_ahead)
    move = fp8.Layout.__call__
    fp8.Layout.__call__ = timed_call("fp8 values moved", lambda *a: jax.block_until_ready(move(*a)))
    model.checkpoint.restore_orbax = timed_call("restore_orbax", checkpoint.restore_orbax)
    jax.devices()
    start = time.perf_counter()
    jax.block_until_ready(model.load(folder).params)
    spans["load"] = time.perf_counter() - start
    return spans


def measure(
    config, weights: str, work: Path, groups: int, hf_config: dict, phases: list[str]
) -> dict:
    folder = work / weights
    folder.mkdir()
    params = init_params(config, DTYPE, seed=0, weights=weights)
    checkpoint.save_orbax(folder, params, {"dtype": jnp.dtype(DTYPE).name, "weights": weights})
    del params
    abstract = abstract_params(config, DTYPE, weights)
    names = sorted(abstract)
    row = {"weights": weights, "arrays": len(names), "folder_bytes": folder_bytes(folder)}
    seconds = {}

    def cold(phase: str, fn) -> object:
        drop_cached(folder)
        seconds[phase], out = timed(fn)
        return out

    if "read" in phases:
        host = cold("read", lambda: restore(folder, names, abstract, device=False))
        seconds["put"] = timed(lambda: jax.device_put(host))[0]  # warm: `read`'s host arrays
        host = None
    if "restore" in phases:
        cold("restore", lambda: restore(folder, names, abstract, device=True))
    if "load" in phases:
        cold("load", lambda: checkpoint.restore_orbax(folder, config, DTYPE, None, weights))
    if "overlapped" in phases:
        cut = groups_of(names, groups)
        drop_cached(folder)
        seconds["overlapped"] = overlapped(folder, cut, abstract)
        row["groups"] = len(cut)
    if "steps" in phases:
        (folder / "config.json").write_text(json.dumps(hf_config))
        drop_cached(folder)
        child = [sys.executable, "-m", "bench.probes.load_phases", "--child", str(folder)]
        done = subprocess.run(child, capture_output=True, text=True, env=CHILD_ENV or None)
        if done.returncode != 0:
            raise RuntimeError(f"load_phases: the steps' child failed:\n{done.stderr}")
        steps = json.loads(done.stdout.strip().splitlines()[-1])
        seconds["steps"] = steps.pop("load")
        row["steps"] = steps
    row["seconds"] = seconds
    row["gb_per_s"] = {k: row["folder_bytes"] / 1e9 / s for k, s in seconds.items()}
    print(row, flush=True)
    shutil.rmtree(folder)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", nargs="+", choices=["dtype", "fp8"], default=["dtype", "fp8"])
    p.add_argument(
        "--phases", nargs="+", choices=PHASES, default=list(PHASES), help="(read also times put)"
    )
    p.add_argument("--groups", type=int, default=8, help="groups of layers `overlapped` uses")
    p.add_argument("--scratch", default=None, help="an existing folder (default: the temp one)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # `steps`' fresh process
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(timeline(Path(args.child))))
        return
    hf_config = TINY["dense"] if args.tiny else MODELS["dense"]
    # This process takes device memory as it goes, so the steps' child (a fresh process, as
    # `bench.load`'s) finds the device as a load does: JAX's default pool free to take.
    CHILD_ENV.update(os.environ)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    config = model_config("dense", args.tiny)
    work = Path(tempfile.mkdtemp(prefix="djax_load_phases_", dir=args.scratch))
    try:
        warm = model_config("dense", tiny=True)  # the process's first restore, untimed
        (work / "warm").mkdir()
        checkpoint.save_orbax(work / "warm", init_params(warm, DTYPE, seed=0), {})
        restore(
            work / "warm", sorted(abstract_params(warm, DTYPE)), abstract_params(warm, DTYPE), True
        )
        rows = [measure(config, w, work, args.groups, hf_config, args.phases) for w in args.weights]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save("load_phases", {"model": "dense", "tiny": args.tiny, "results": rows})


if __name__ == "__main__":
    main()
