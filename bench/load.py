"""How long `djax.load` takes to open a model: a converted checkpoint (`djax convert`, orbax)
holding bf16 weights against the same weights converted to fp8, and, for context, the HF
folder they were converted from, loaded as bf16 and quantised to fp8 as it is loaded.

    python -m bench.load [--models dense moe] [--repeats 3] [--cache warm [cold]]
        [--cases converted_bf16 ...] [--profile] [--scratch DIR] [--tiny]

Per model (`bench.common`: LLaDA-8B's or LLaDA-MoE's shape, random bf16 weights built on
the device), one preparing process writes the weights as an HF folder
(`djax.checkpoint.save_hf`: one `model.safetensors` in bf16), then converts it twice,
`djax.convert(weights="dtype")` (bf16) and `djax.convert(weights="fp8")` (e4m3 values with
fp32 scales), each conversion timed. Then each case is loaded `--repeats` times, every load
in a fresh Python process (nothing cached in the process; the parent starts the device only
to name it in the result file, after the last load, so each child has it to itself):

- `converted_bf16`, `converted_fp8`: `djax.load(folder, dtype="bfloat16")`, the format the
  folder holds;
- `hf_bf16`, `hf_fp8`: `djax.load(hf_folder, dtype="bfloat16", weights="dtype" | "fp8")`.

A child imports jax, djax and the readers `load` uses (orbax, safetensors), then starts the
device backend (`jax.devices()`), then times `djax.load` until every param is on the
device (`jax.block_until_ready(model.params)`); the import and the backend start are
reported beside it and are not part of the load figure, which does include the small
programs `load` compiles (its checks for non-finite values; `load` turns on no compile
cache). Each repeat runs every case once, the order rotated by one case per repeat, so
no case always runs first or last. A case's figure is the median of its samples; all
samples are kept.

The state of the page cache is set before every load (timed or profiled), `--cache` (one
or both; cases loaded cold are named `<case>_cold`):

- `warm` (the default): each file of the case's folder is read through once
  (`read_through`), so that the load finds them in the OS page cache where the host keeps
  them; then the load figures are deserialisation and host-to-device copies. Whether the
  cache held them is not checked (the bench's folders and the loads' host copies need not
  all fit): a read-through as slow as the disk says it did not (bench/NOTES.md, "Load
  copies").
- `cold`: every file of the folder has its cached pages dropped (`drop_cached`:
  `posix_fadvise(DONTNEED)`, no privileges needed), so the load reads the disk, as the
  first load after a download or a reboot does.

Each sample keeps `cache_s`, the seconds that took. `--cases` picks cases (default all
four).

The figure of merit is `fp8_over_bf16`, the converted fp8 load's median over the
converted bf16 load's. A model's row: `cache`, `seconds` (`write_hf`, `convert_bf16`,
`convert_fp8`), `folder_bytes` (each folder's bytes on disk), per case `loads` (`median_s`,
`samples_s`, `import_s`, `backend_s`, `cache_s`, the `weights` loaded; with `--profile`,
`profiled`: one more load under cProfile, after the timed ones and not among them, with its
slowest functions by cumulative time), and the ratios of the pairs it loaded:
`fp8_over_bf16` and `hf_fp8_over_hf_bf16`, and the same of the cold loads
(`fp8_over_bf16_cold`).

Disk: the folders live under a fresh folder made inside `--scratch` (default: the system's
temporary folder), one model at a time, and are deleted when the model is done and, on any
error, at the end; nothing the bench did not create is deleted. LLaDA-8B needs ~16 GB (HF)
+ 16 GB (bf16) + 8 GB (fp8) at once.

Writes JSON through `bench.common.save` (`load_<device>.json`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import MODELS, TINY, bench_model, model_config, save

ROOT = Path(__file__).resolve().parent.parent
DTYPE = "bfloat16"
# case -> (folder, the `weights` argument of `djax.load`; "stored": None, what the folder holds)
CASES = {
    "converted_bf16": ("converted_bf16", "stored"),
    "converted_fp8": ("converted_fp8", "stored"),
    "hf_bf16": ("hf", "dtype"),
    "hf_fp8": ("hf", "fp8"),
}
FOLDERS = ("hf", "converted_bf16", "converted_fp8")
PROFILE_TOP = 25  # functions kept from a profiled load
# Fresh processes: `python -c PROGRAM ARGS`; a load's clock starts before anything is imported.
PREPARE = "import sys; from bench.load import prepare; prepare(*sys.argv[1:])"
LOAD = (
    "import sys, time; t = time.perf_counter(); "
    "from bench.load import timed_load; timed_load(t, *sys.argv[1:])"
)
COLD = "_cold"  # a case's name loaded with its folder's pages dropped
RATIOS = {  # ratio name -> (numerator case, denominator case), before a variant's suffix
    "fp8_over_bf16": ("converted_fp8", "converted_bf16"),
    "hf_fp8_over_hf_bf16": ("hf_fp8", "hf_bf16"),
}


def prepare(name: str, tiny: str, folder: str) -> None:
    """In a fresh process: write model `name`'s random bf16 weights as an HF folder under
    `folder`, convert it to bf16 and to fp8 beside it, and print the seconds as JSON."""
    import djax
    from djax.checkpoint import save_hf

    config = model_config(name, tiny == "1")
    work = Path(folder)
    model, _ = bench_model(config)
    start = time.perf_counter()
    save_hf(work / "hf", config, model.params, TINY[name] if tiny == "1" else MODELS[name])
    seconds = {"write_hf": time.perf_counter() - start}
    del model  # the device holds only what each conversion loads
    for weights, dst in (("dtype", "converted_bf16"), ("fp8", "converted_fp8")):
        start = time.perf_counter()
        djax.convert(work / "hf", work / dst, DTYPE, progress=False, weights=weights)
        seconds[f"convert_{dst.removeprefix('converted_')}"] = time.perf_counter() - start
    print(json.dumps({key: round(value, 3) for key, value in seconds.items()}))


def timed_load(started: float, folder: str, weights: str, profile: str = "0") -> None:
    """In a fresh process: the seconds of importing, starting the backend and
    `djax.load(folder)` until its params are on the device, printed as JSON; `profile`
    "1": the load runs under cProfile and its `PROFILE_TOP` functions by cumulative time
    come with it (`profile`: "module:line(function)" -> seconds)."""
    import jax
    import orbax.checkpoint  # noqa: F401  (read by `load` for a converted folder)
    import safetensors.numpy  # noqa: F401  (read by `load` for an HF folder)

    import djax
    import djax.model  # noqa: F401

    imported = time.perf_counter()
    jax.devices()
    ready = time.perf_counter()
    profiler = cProfile.Profile() if profile == "1" else None
    if profiler:
        profiler.enable()
    model = djax.load(folder, DTYPE, weights=None if weights == "stored" else weights)
    jax.block_until_ready(model.params)
    done = time.perf_counter()
    result = {
        "import_s": round(imported - started, 3),
        "backend_s": round(ready - imported, 3),
        "load_s": round(done - ready, 4),
        "weights": model.weights,
    }
    if profiler:
        profiler.disable()
        result["profile"] = top_functions(pstats.Stats(profiler), PROFILE_TOP)
    print(json.dumps(result))


def top_functions(stats: pstats.Stats, count: int) -> dict[str, float]:
    """The `count` functions of the most cumulative seconds in `stats`, as
    "module:line(function)" -> seconds (rounded to ms), most first."""
    rows = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)[:count]
    return {
        f"{Path(file).stem}:{line}({func})": round(cumulative, 3)
        for (file, line, func), (_, _, _, cumulative, _) in rows
    }


def run_child(program: str, *args: str) -> dict:
    """`program` (`PREPARE` or `LOAD`) with `args` in a fresh Python process; its last
    output line (JSON) as a dict."""
    done = subprocess.run(
        [sys.executable, "-c", program, *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"bench.load: {program} {args} failed (rc {done.returncode}):\n{done.stderr}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def read_through(folder: Path, chunk: int = 64 << 20) -> int:
    """Read every file under `folder` once, in `chunk`-byte pieces (so they lie in the
    page cache when a load reads them); the bytes read."""
    total = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as file:
            while piece := file.read(chunk):
                total += len(piece)
    return total


def drop_cached(folder: Path) -> None:
    """Drop the page cache's clean pages of every file under `folder`
    (`posix_fadvise(DONTNEED)`: advice, no privileges, no byte of any file changes), so the
    next read of them reads the disk."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def set_cache(folder: Path, cache: str) -> float:
    """Put `folder`'s files in the page cache state `cache` (`warm`: read through; `cold`:
    dropped); the seconds it took."""
    start = time.perf_counter()
    if cache == "warm":
        read_through(folder)
    else:
        drop_cached(folder)
    return round(time.perf_counter() - start, 3)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def rotated(cases: list[str], repeat: int) -> list[str]:
    """`cases` starting at its `repeat`-th (mod its length), the rest in order after it."""
    shift = repeat % len(cases)
    return cases[shift:] + cases[:shift]


def measure(
    name: str,
    tiny: bool,
    repeats: int,
    work: Path,
    profile: bool = False,
    cases: tuple[str, ...] = tuple(CASES),
    caches: tuple[str, ...] = ("warm",),
) -> dict:
    """One model's row: prepare its folders under `work`, then `repeats` rotated rounds of
    fresh-process loads of every case in every page cache state of `caches`, each after
    `set_cache`, then with `profile` one profiled load of each."""
    row: dict = {"model": name, "dtype": DTYPE, "repeats": repeats, "caches": list(caches)}
    row["seconds"] = run_child(PREPARE, name, "1" if tiny else "0", str(work))
    row["folder_bytes"] = {folder: folder_bytes(work / folder) for folder in FOLDERS}
    suffixes = {cache: "" if cache == "warm" else COLD for cache in caches}
    # label -> (folder, weights, cache)
    runs = {
        case + suffix: (*CASES[case], cache) for cache, suffix in suffixes.items() for case in cases
    }
    samples: dict[str, list[dict]] = {label: [] for label in runs}
    for repeat in range(repeats):
        for label in rotated(list(runs), repeat):
            folder, weights, cache = runs[label]
            cache_s = set_cache(work / folder, cache)
            sample = {**run_child(LOAD, str(work / folder), weights), "cache_s": cache_s}
            samples[label].append(sample)
            print(f"{name} {label} (repeat {repeat + 1}): {sample}", flush=True)
    row["loads"] = {}
    for label, done in samples.items():
        loads = [run["load_s"] for run in done]
        row["loads"][label] = {
            "median_s": statistics.median(loads),
            "samples_s": loads,
            "import_s": [run["import_s"] for run in done],
            "backend_s": [run["backend_s"] for run in done],
            "cache_s": [run["cache_s"] for run in done],
            "weights": done[0]["weights"],
        }
    medians = {label: row["loads"][label]["median_s"] for label in runs}
    for suffix in suffixes.values():
        for ratio, (top, bottom) in RATIOS.items():
            if top + suffix in medians and bottom + suffix in medians:
                row[ratio + suffix] = round(medians[top + suffix] / medians[bottom + suffix], 4)
    if profile:  # after the timed loads: cProfile slows what it watches
        for label, (folder, weights, cache) in runs.items():
            set_cache(work / folder, cache)
            sample = run_child(LOAD, str(work / folder), weights, "1")
            row["loads"][label]["profiled"] = sample
            print(f"{name} {label} (profiled): {sample}", flush=True)
    return row


def scratch_folder(text: str) -> Path:
    """`--scratch`: an existing folder (the bench makes its own folder inside it)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"scratch {text!r} is not a folder; expected one")
    return path


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"repeats {text!r}; expected a positive integer")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=["dense", "moe"], default=["dense"])
    p.add_argument("--repeats", type=positive, default=3, help="fresh processes per case")
    p.add_argument(
        "--scratch",
        type=scratch_folder,
        default=None,
        help="an existing folder; the bench writes and deletes a folder of its own inside it",
    )
    p.add_argument(
        "--profile", action="store_true", help="then one load of each case under cProfile"
    )
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument(
        "--cache", nargs="+", choices=["warm", "cold"], default=["warm"], help="see the docstring"
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    args = p.parse_args(argv)
    rows = []
    root = Path(tempfile.mkdtemp(prefix="djax_load_", dir=args.scratch))
    try:
        for name in args.models:
            work = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=root))
            rows.append(
                measure(
                    name,
                    args.tiny,
                    args.repeats,
                    work,
                    args.profile,
                    tuple(args.cases),
                    tuple(dict.fromkeys(args.cache)),
                )
            )
            shutil.rmtree(work)  # before the next model's folders are written
            medians = {case: v["median_s"] for case, v in rows[-1]["loads"].items()}
            print(f"{name}: {medians}, fp8/bf16 {rows[-1].get('fp8_over_bf16')}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if root.exists():
            print(f"bench.load: could not delete {root}: delete it by hand", file=sys.stderr)
    options = {**vars(args), "scratch": None if args.scratch is None else str(args.scratch)}
    save("load", {"options": options, "results": rows})


if __name__ == "__main__":
    main()
