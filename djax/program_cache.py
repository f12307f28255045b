"""Generation programs kept after tracing and lowering, so a new process skips both.

JAX's persistent compilation cache (`engine.enable_compile_cache`) stores XLA's executables
under a key computed from the lowered module, so every new process first traces and lowers
the whole generation program again, the Mosaic GPU kernels' lowering in Python most of it
(figures in bench/README.md). Here a lowered program
is saved as a `jax.export` artifact (serialized StableHLO) in a `programs/` folder inside
the XLA cache folder. A new process reads it back, lowers only the call into it, and XLA's
cache answers the compile.

The key is a digest of everything that shapes the program: djax's own source files, the
jax, jaxlib and flax versions, every `jax.config` value, the devices, the caller's description
of the program (model config, dtype, options, mesh, plan) and the structure, shapes, dtypes
and shardings of its arguments. Any change gives a new key, never a stale program.

The folders djax creates are private to the user (0700), and so are the saved programs
(0600). The saved programs, like XLA's executables beside them, are kept under
`max_bytes()` (default 2 GiB, `$DJAX_COMPILE_CACHE_MAX_SIZE`), the least recently used
deleted first. A saved program that cannot be read or lowered is deleted and saved again.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import importlib
import importlib.metadata
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import jaxlib

FOLDER = "programs"
SUFFIX = ".jax_exported"
MAX_SIZE_VARIABLE = "DJAX_COMPILE_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 2 * 1024**3
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
# The artifacts never leave this machine's cache and are keyed by the exact jax and jaxlib
# versions, so custom calls without a cross-version stability promise (Pallas
# kernels, cuDNN attention) are safe to keep.
_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("ALL"),)
# Custom calls whose runtime is registered with XLA when a Python module is imported. A
# process that reads a program back never traces its kernels, so it imports them itself.
_RUNTIMES = {b"mosaic_gpu": "jax.experimental.mosaic.gpu"}


@functools.cache
def _source_digest() -> str:
    """sha256 of every djax source file (path and bytes)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def max_bytes() -> int:
    """The size cap of each part of the cache folder: `$DJAX_COMPILE_CACHE_MAX_SIZE`, bytes
    with an optional K, M, G or T suffix (powers of 1024), else 2 GiB."""
    text = os.environ.get(MAX_SIZE_VARIABLE, "").strip().upper().removesuffix("IB")
    if not text:
        return DEFAULT_MAX_BYTES
    number, unit = (text[:-1], text[-1]) if text[-1] in _UNITS else (text, "")
    try:
        size = float(number) * _UNITS[unit]
    except ValueError:
        size = -1.0
    if not 0 <= size < math.inf:
        raise ValueError(
            f"{MAX_SIZE_VARIABLE}={os.environ[MAX_SIZE_VARIABLE]!r}; expected a size in bytes "
            "such as 2147483648 or 2G"
        )
    return int(size)


_PLAIN = {bool, int, float, str, type(None)}  # hashable config values, with enums


def config_values() -> tuple:
    """Every `jax.config` value, by name, in jax's order (values other than plain ones and
    enums as their repr, so the tuple hashes): what a traced program may depend on beside
    its arguments (the PRNG's partitioning, matmul precision, x64...). Part of the
    in-process key of every block call, so nothing is sorted or printed that need not be."""
    return tuple(
        (name, value if type(value) in _PLAIN or isinstance(value, enum.Enum) else repr(value))
        for name, value in jax.config.values.items()
    )


def program_key(description: tuple, args: tuple) -> str:
    """The cache key of the program `description` names, called with `args`."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    arguments = [
        (leaf.shape, str(leaf.dtype), str(getattr(leaf, "sharding", None))) for leaf in leaves
    ]
    parts = (
        _source_digest(),
        jax.__version__,
        jaxlib.__version__,
        importlib.metadata.version("flax"),
        config_values(),
        [(d.platform, d.device_kind, d.id) for d in jax.devices()],
        description,
        str(tree),
        arguments,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def lower(
    program: Any, args: tuple, description: tuple, folder: str | None, donate_argnums=()
) -> jax.stages.Lowered:
    """`program.lower(*args)`, through the saved export of the same program when `folder`
    (the XLA cache folder) holds one; else the program is exported and saved there first.
    With no folder, or a remote one (`gs://...`), nothing is read or written. A saved
    program that cannot be read or lowered is exported again; a program that cannot be
    exported is lowered directly and not saved. Each of those warns."""
    if not folder or "://" in folder:
        return program.lower(*args)
    path = Path(folder) / FOLDER / f"{program_key(description, args)}{SUFFIX}"
    exported = _read(path)
    if exported is not None:
        try:
            return jax.jit(exported.call, donate_argnums=donate_argnums).lower(*args)
        except Exception as err:
            _warn(f"{path}: the saved program does not lower ({err}); exporting it again")
            _delete(path)
    try:
        exported = jax.export.export(program, disabled_checks=_CHECKS)(*args)
    except Exception as err:  # tracing errors recur, and surface, in the direct lowering
        _warn(f"cannot export the generation program ({err}); lowering it without saving")
        return program.lower(*args)
    _write(path, exported.serialize())
    return jax.jit(exported.call, donate_argnums=donate_argnums).lower(*args)


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def _read(path: Path) -> jax.export.Exported | None:
    """The saved program, its use recorded in its modification time (for eviction) where
    the folder allows it (a read-only cache is read all the same); a damaged one is deleted."""
    try:
        blob = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        _warn(f"{path}: cannot read the saved program ({err}); exporting it again")
        return None
    with contextlib.suppress(OSError):  # a read-only folder: no eviction order, no harm
        os.utime(path)
    for call_target, module in _RUNTIMES.items():
        if call_target in blob:
            importlib.import_module(module)
    try:
        return jax.export.deserialize(bytearray(blob))
    except Exception as err:  # a truncated or foreign file: delete it and export again
        _warn(f"{path}: unreadable saved program ({err}); deleting it and exporting it again")
        _delete(path)
        return None


def _delete(path: Path) -> None:
    """Delete a saved program; where the folder does not allow it, warn and go on (the
    program is exported again, and saved if the folder takes it)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        _warn(f"{path}: cannot delete the saved program ({err}); leaving it")


def _write(path: Path, blob: bytes) -> None:
    """Write atomically (a rename), so a concurrent reader never sees half a file; the
    file private to the user (0600, in a 0700 folder when djax creates it). Then evict the
    least recently used programs beyond `max_bytes()`."""
    limit = max_bytes()
    if len(blob) > limit:
        _warn(f"{path}: the program ({len(blob)} bytes) exceeds the cache's {limit}; not saved")
        return
    tmp = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
            tmp.write(blob)  # NamedTemporaryFile creates it 0600
        os.replace(tmp.name, path)
        evict(path.parent, limit)
    except OSError as err:
        if tmp is not None and os.path.exists(tmp.name):
            os.unlink(tmp.name)
        _warn(f"{path}: could not save the lowered program ({err}); continuing")


def evict(folder: Path, limit: int) -> None:
    """Delete the least recently used (oldest modification time) saved programs in
    `folder` until they take at most `limit` bytes."""
    entries = []
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # evicted by another process
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda e: e[:2]):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size
