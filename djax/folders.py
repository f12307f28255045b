"""Writing a folder atomically: build it in a staging folder beside the destination, then
rename it into place, so an error or an interrupt leaves the destination as it was.

A staging folder is named `.<destination name>.djax-staging-<random>`; the old
destination, while it is replaced, `.<destination name>.djax-old-<random>`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def check_apart(src: Path, dst: Path) -> Path:
    """`dst` with symlinks resolved, refused (ValueError) when it is, lies inside, or holds
    the folder `src`: writing or replacing it would touch the source."""
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src:
        relation = "is"
    elif real_src in real_dst.parents:
        relation = "lies inside"
    elif real_dst in real_src.parents:
        relation = "holds"
    else:
        return real_dst
    raise ValueError(
        f"destination {str(dst)!r} {relation} the source folder {str(src)!r}; expected a "
        "folder apart from the source"
    )


@contextlib.contextmanager
def staged(dst: Path) -> Iterator[Path]:
    """A new empty folder beside `dst` (on its file system, so a rename moves it), deleted
    when the block raises or is interrupted; SIGTERM raises SystemExit(143) in the block
    (main thread) so it unwinds the same way. An unwritable parent raises PermissionError
    here, before the block runs."""
    staging = dst.parent / f".{dst.name}.djax-staging-{secrets.token_hex(4)}"
    created = False
    with _terminate_raises(), _stops_noted(staging):
        try:
            with _signals_deferred():  # no interrupt between creating and recording it
                try:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    staging.mkdir()
                except OSError as err:
                    raise PermissionError(
                        f"cannot write beside {str(dst)!r}: {err.strerror or err} in "
                        f"{str(dst.parent)!r}; expected a writable folder"
                    ) from err
                created = True
            yield staging
        except BaseException:
            if created:
                shutil.rmtree(staging, ignore_errors=True)
            raise


def leftovers(dst: Path) -> list[Path]:
    """The staging and set-aside folders beside `dst` that a killed run left behind (a run
    in progress holds one too)."""
    return sorted(
        p
        for pattern in (f".{dst.name}.djax-staging-*", f".{dst.name}.djax-old-*")
        for p in dst.parent.glob(pattern)
    )


def replace(staging: Path, dst: Path, replaceable: Callable[[Path], bool] | None = None) -> None:
    """Move `staging` to `dst`. Without `replaceable` only an absent or empty `dst` is
    taken (a rename, which refuses anything else: FileExistsError naming `dst`). With it, a
    `dst` for which `replaceable(dst)` holds is renamed aside, the new folder renamed in,
    and only then the old one deleted; any other `dst` is refused (FileExistsError), so a
    folder that appeared since the caller's own checks is never deleted. SIGINT and SIGTERM
    (main thread) take effect once all that is done. A stop that reached `staged`'s block
    before, but whose exception was lost (Python drops one raised inside a garbage-collector
    callback), is raised again here instead: nothing is replaced after a stop."""
    with _signals_deferred():
        _raise_lost_stop(staging)
        if not dst.is_dir() or replaceable is None or not any(dst.iterdir()):
            try:
                os.rename(staging, dst)
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
                raise FileExistsError(
                    f"output {str(dst)!r} appeared and holds files since the convert began; "
                    "it was left as it is"
                ) from None
            return
        if not replaceable(dst):
            raise FileExistsError(
                f"output {str(dst)!r} changed since the convert began and is no longer a "
                "folder it may replace; it was left as it is"
            )
        aside = dst.parent / f".{dst.name}.djax-old-{secrets.token_hex(4)}"
        os.rename(dst, aside)
        try:
            os.rename(staging, dst)
        except BaseException:
            os.rename(aside, dst)
            raise
        shutil.rmtree(aside)


# Per staging folder, the stop signals seen during its block and the handlers they met.
_STOPS: dict[Path, tuple[list[int], dict[int, Any]]] = {}


@contextlib.contextmanager
def _stops_noted(staging: Path) -> Iterator[None]:
    """Note every SIGINT and SIGTERM (main thread) before the handler in place acts on it,
    so `replace` can tell a stop happened even when its exception was lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def note(signum, frame):
        handler = handlers[signum]
        if handler == signal.SIG_IGN:
            return
        seen.append(signum)
        if not callable(handler):  # SIG_DFL: the process would end
            raise SystemExit(128 + signum)
        handler(signum, frame)  # raises the stop, or defers it as its owner asked

    for signum in handlers:
        signal.signal(signum, note)
    _STOPS[staging] = seen, handlers
    try:
        yield
    finally:
        del _STOPS[staging]
        for signum, handler in handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _raise_lost_stop(staging: Path) -> None:
    """Raise the first stop `_stops_noted` saw for `staging` again, as its handler raises
    it (a handler that defers it returns, and its owner stops after the block)."""
    seen, handlers = _STOPS.get(staging, ([], {}))
    if not seen:
        return
    handler = handlers[seen[0]]
    if not callable(handler):
        raise SystemExit(128 + seen[0])
    handler(seen[0], None)


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {
        signum: signal.signal(signum, lambda signum, frame: pending.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for signum in pending:
            signal.raise_signal(signum)
