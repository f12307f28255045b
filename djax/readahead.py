"""Reading a model folder's weight files ahead of the loader.

`djax.load` spends its first moments on work that reads no weight bytes (the tokenizer, the
config, the params' shapes, the checkpoint's metadata, compiling its checks) before its
reader asks for the first array. `start(paths)` asks the OS to read the files into the page
cache at once (`posix_fadvise(POSIX_FADV_WILLNEED)`, one background thread a file), so a
load whose files are not cached keeps the disk busy from its first moment.

The rules:
- advice only: the files are opened read-only, nothing is read into the process and
  nothing is written; a file that cannot be opened or advised is skipped, and the loader
  reads every byte it needs itself either way;
- only where the files fit in half the memory the OS reports available
  (`/proc/meminfo`'s MemAvailable): reading ahead more than the cache keeps would evict
  pages read ahead before the loader reaches them, and read them twice;
- nothing happens where the OS has no `posix_fadvise` (not Linux, say).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """The memory the OS reports available for new pages (MemAvailable), or None where it
    reports none."""
    try:
        for line in MEMINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _advise(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def start(paths: Iterable[Path]) -> list[threading.Thread]:
    """Ask the OS to read each file of `paths` into the page cache, one daemon thread a file
    (the threads, already started; none where the rules above say no). Returns at once."""
    if not hasattr(os, "posix_fadvise"):
        return []
    files = [p for p in paths if p.is_file()]
    available = available_bytes()
    total = sum(p.stat().st_size for p in files)
    if not files or available is None or total > available // 2:
        return []
    threads = [threading.Thread(target=_advise, args=(p,), daemon=True) for p in files]
    for thread in threads:
        thread.start()
    return threads
