"""The loader's read-ahead of weight files: advice only, asked for the files a load reads,
skipped where the files would not fit the page cache or the OS has no `posix_fadvise`."""

import os

import jax.numpy as jnp
import pytest

import djax
from djax import checkpoint, readahead


@pytest.fixture
def advised(monkeypatch):
    """Every (file, advice) `posix_fadvise` is asked for, by path."""
    calls = []
    real_open, real = os.open, os.posix_fadvise
    paths = {}

    def opened(path, flags, *args):
        fd = real_open(path, flags, *args)
        assert flags == os.O_RDONLY, "read-ahead opens files read-only"
        paths[fd] = str(path)
        return fd

    def advise(fd, offset, length, advice):
        calls.append((paths[fd], offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    return calls


def _join(threads):
    for thread in threads:
        thread.join(timeout=10)
    return threads


def test_each_file_is_advised_whole_and_left_as_it_was(tmp_path, advised):
    files = [tmp_path / name for name in ("a.bin", "b.bin")]
    for i, path in enumerate(files):
        path.write_bytes(bytes([i]) * 4096)
    threads = _join(readahead.start([*files, tmp_path / "missing", tmp_path]))
    assert len(threads) == 2 and all(t.daemon for t in threads)
    assert sorted(advised) == [(str(p), 0, 0, os.POSIX_FADV_WILLNEED) for p in files]
    assert [p.read_bytes() for p in files] == [b"\x00" * 4096, b"\x01" * 4096]


def test_nothing_is_read_ahead_past_half_the_available_memory(tmp_path, advised, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 1000)
    monkeypatch.setattr(readahead, "available_bytes", lambda: 1999)
    assert readahead.start([path]) == []
    monkeypatch.setattr(readahead, "available_bytes", lambda: 2000)
    assert len(_join(readahead.start([path]))) == 1
    monkeypatch.setattr(readahead, "available_bytes", lambda: None)
    assert readahead.start([path]) == []
    assert len(advised) == 1


def test_no_posix_fadvise_no_read_ahead(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x")
    monkeypatch.delattr(os, "posix_fadvise")
    assert readahead.start([path]) == []


def test_a_file_that_cannot_be_advised_is_skipped(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x")

    def refuse(*args):
        raise OSError(22, "not supported here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    (thread,) = _join(readahead.start([path]))
    assert not thread.is_alive() and path.read_bytes() == b"x"


def test_available_bytes_reads_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:   64 kB\nCached: 3 kB\n")
    monkeypatch.setattr(readahead, "MEMINFO", meminfo)
    assert readahead.available_bytes() == 64 * 1024
    meminfo.write_text("MemTotal:  100 kB\n")
    assert readahead.available_bytes() is None
    monkeypatch.setattr(readahead, "MEMINFO", tmp_path / "absent")
    assert readahead.available_bytes() is None


def test_load_reads_ahead_the_files_it_loads(dense_folder, tmp_path, monkeypatch):
    """An HF folder: its safetensors shards; a converted one: its checkpoint's files (not
    its config or tokenizer); a folder of .bin weights alone: those."""
    asked = []
    monkeypatch.setattr(readahead, "start", lambda paths: asked.append(list(paths)) or [])
    hf = dense_folder[0]
    djax.load(hf, jnp.float32)
    assert [p.name for p in asked[-1]] == sorted(p.name for p in hf.glob("*.safetensors"))
    assert len(asked[-1]) == 2
    out = tmp_path / "converted"
    djax.convert(hf, out, jnp.float32, progress=False)
    djax.load(out, jnp.float32)
    files = asked[-1]
    assert files and all(checkpoint.PARAMS_DIR in p.relative_to(out).parts for p in files)
    assert sum(p.stat().st_size for p in files) > 0.9 * sum(
        p.stat().st_size for p in hf.glob("*.safetensors")
    )
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "pytorch_model.bin").write_bytes(b"")
    assert checkpoint.weight_files(bins) == [bins / "pytorch_model.bin"]
