"""Probe: where do a converted checkpoint's bytes come from when `djax.load` reads them?

Question. `bench.load` reads each folder through once before every load so that the load
finds it in the page cache, yet on the H100 machine a load of LLaDA-8B's 16 GB bf16 folder
took 12-13 s and the read-through itself ~1.6 GB/s (bench/NOTES.md, "Load copies"): does the
page cache keep a folder of that size there at all, how fast does the disk read with one
reader and with several, and does asking the kernel to read a file ahead
(`posix_fadvise(WILLNEED)`) fill the cache faster than reading it?

Answer (H100 machine, c3e6077, `bench/results/disk_read_NVIDIA_H100_80GB_HBM3.json`; 16 GB in
8 files): the disk reads at ~2 GB/s, and neither several readers (1.98 GB/s) nor asking for
the files ahead (1.71 GB/s) reads it faster. Read again right away, the same 16 GB came at
6.96 GB/s, yet the kernel's `Cached` stayed at 17.3 GB through every case: what kept them is
below the guest (the virtual disk's host), not its page cache, and it does not keep the
bench's 16 + 8.5 GB folders between alternating loads (`bench.load`'s read-throughs there run
at ~1.5 GB/s). So a load on this machine reads at the disk's rate warm or cold, and a
read-ahead in the loader cannot help it: one was built (`posix_fadvise(WILLNEED)` of the
weight files from `djax.load`'s start), measured beside the loader without it and removed
(bench/NOTES.md, "Load copies").

Method. `--files` files of `--gb` GB in all are written under a fresh folder in `--scratch`
(random bytes, so no layer below can compress them) and flushed to the disk (`fsync`);
then, each timed, with every file's cached pages dropped first (`posix_fadvise(DONTNEED)`,
which needs no privileges) where the case says "cold":

- `cold_one_reader`: read every file in turn, 64 MB at a time, in one thread;
- `again_one_reader`: the same right after, without dropping: the page cache's rate if it
  kept the files, the disk's if it did not;
- `cold_readers`: one thread per file, all at once;
- `cold_willneed`: `posix_fadvise(WILLNEED)` on every file from one thread per file, then
  the one-reader read;

and the machine's memory as the kernel and the cgroup see it (`/proc/meminfo`,
`memory.max`, `memory.current`). The folder is deleted at the end and on any error.

    python -m bench.probes.disk_read [--gb 16] [--files 8] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import save

CHUNK = 64 << 20
GB = 1e9


def memory() -> dict:
    """MemTotal, MemAvailable and Cached (GB) from /proc/meminfo, and the cgroup's limit and
    use where it has them (None elsewhere)."""
    info = {}
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "Cached"):
                info[key] = int(value.split()[0]) * 1024 / GB
    for name in ("memory.max", "memory.current"):
        path = Path("/sys/fs/cgroup") / name
        text = path.read_text().strip() if path.exists() else None
        info[name] = text if text in (None, "max") else int(text) / GB
    return info


def write_files(folder: Path, files: int, total: float) -> list[Path]:
    """`files` files of `total / files` bytes of random data, each fsynced."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    size = int(total / files)
    paths = []
    for i in range(files):
        path = folder / f"part_{i}"
        with path.open("wb") as file:
            left = size
            while left > 0:
                left -= file.write(block[: min(left, CHUNK)])
            file.flush()
            os.fsync(file.fileno())
        paths.append(path)
    return paths


def advise(paths: list[Path], advice: int) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)


def read(path: Path) -> int:
    total = 0
    with path.open("rb", buffering=0) as file:
        buffer = bytearray(CHUNK)
        while count := file.readinto(buffer):
            total += count
    return total


def in_threads(function, paths: list[Path]) -> None:
    threads = [threading.Thread(target=function, args=(p,)) for p in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def timed(label: str, paths: list[Path], cold: bool, body) -> dict:
    if cold:
        advise(paths, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    body()
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in paths)
    row = {"case": label, "seconds": seconds, "gb_per_s": size / GB / seconds, **memory()}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=16.0, help="bytes written, in GB")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--scratch", default=None, help="an existing folder (default: the temp one)")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="djax_disk_", dir=args.scratch))
    try:
        start = time.perf_counter()
        paths = write_files(folder, args.files, args.gb * GB)
        write_s = time.perf_counter() - start
        print({"written_gb": args.gb, "write_s": write_s, **memory()}, flush=True)

        def one_reader():
            for path in paths:
                read(path)

        def willneed_then_read():
            in_threads(lambda path: advise([path], os.POSIX_FADV_WILLNEED), paths)
            one_reader()

        rows = [
            timed("cold_one_reader", paths, True, one_reader),
            timed("again_one_reader", paths, False, one_reader),
            timed("cold_readers", paths, True, lambda: in_threads(read, paths)),
            timed("cold_willneed", paths, True, willneed_then_read),
        ]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    save(
        "disk_read",
        {"gb": args.gb, "files": args.files, "write_s": write_s, "results": rows},
    )


if __name__ == "__main__":
    main()
