"""`bench.load` end to end on the tiny dense model: its folders written, converted, loaded in
fresh processes, the result written, and only its own folders deleted."""

import json
import shutil
from pathlib import Path

import pytest

from bench import load as bench_load


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny dense model's folders and seconds from one real preparing process, which
    the two end-to-end runs below share (it is the same for both: a fresh process writing
    and converting the same random weights)."""
    work = tmp_path_factory.mktemp("prepared")
    seconds = bench_load.run_child(bench_load.PREPARE, "dense", "1", str(work))
    return work, seconds


@pytest.fixture
def prepare_once(prepared, monkeypatch):
    """`run_child` as the bench's own for the loads; its preparing child (asked for the tiny
    dense model, into the bench's folder) is `prepared`'s, copied into that folder."""
    work, seconds = prepared
    real = bench_load.run_child
    asked = []

    def run_child(program, *args):
        if program != bench_load.PREPARE:
            return real(program, *args)
        asked.append(args)
        assert args[:2] == ("dense", "1") and not any(Path(args[2]).iterdir()), args
        for folder in bench_load.FOLDERS:
            shutil.copytree(work / folder, Path(args[2]) / folder)
        return dict(seconds)

    monkeypatch.setattr(bench_load, "run_child", run_child)
    return asked


def test_load_bench_times_every_case_and_deletes_only_its_folders(
    tmp_path, monkeypatch, capsys, prepare_once
):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "keep.txt").write_text("a user's file")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    bench_load.main(["--tiny", "--repeats", "1", "--scratch", str(scratch)])
    # prepared once, inside the bench's own folder
    ((*_, work),) = prepare_once
    assert Path(work).parent.parent == scratch
    # the bench's own folder (HF, bf16 and fp8 folders inside) is gone, the user's file not
    assert [p.name for p in scratch.iterdir()] == ["keep.txt"]
    (path,) = (tmp_path / "out").glob("load_*.json")
    record = json.loads(path.read_text())
    assert record["benchmark"] == "load" and record["options"]["scratch"] == str(scratch)
    (row,) = record["results"]
    assert row["model"] == "dense" and row["dtype"] == "bfloat16"
    assert set(row["seconds"]) == {"write_hf", "convert_bf16", "convert_fp8"}
    assert all(s > 0 for s in row["seconds"].values())
    sizes = row["folder_bytes"]
    # fp8 values (1 byte) and fp32 scales per output channel against bf16 (2 bytes)
    assert 0 < sizes["converted_fp8"] < 0.8 * sizes["converted_bf16"]
    assert sizes["hf"] > 0
    assert set(row["loads"]) == {"converted_bf16", "converted_fp8", "hf_bf16", "hf_fp8"}
    for case, load in row["loads"].items():
        assert len(load["samples_s"]) == 1 and load["median_s"] == load["samples_s"][0] > 0
        assert load["import_s"][0] > 0 and load["cache_s"][0] >= 0, case
        assert load["weights"] == ("fp8" if case.endswith("fp8") else "dtype"), case
    medians = {case: load["median_s"] for case, load in row["loads"].items()}
    ratio = medians["converted_fp8"] / medians["converted_bf16"]
    assert row["fp8_over_bf16"] == pytest.approx(ratio, abs=1e-4)
    assert row["caches"] == ["warm"] and "fp8_over_bf16_cold" not in row
    assert "dense converted_fp8 (repeat 1)" in capsys.readouterr().out


def test_load_bench_loads_warm_and_cold_cases_in_one_run(tmp_path, monkeypatch, prepare_once):
    """`--cache warm cold --cases ...`: only the cases asked for, each read through before
    its warm load and its pages dropped (not read) before its cold one, and the ratio of
    each pair."""
    events = []
    real_drop, real_read = bench_load.drop_cached, bench_load.read_through
    monkeypatch.setattr(
        bench_load, "drop_cached", lambda f: (events.append(("drop", f.name)), real_drop(f))
    )
    monkeypatch.setattr(
        bench_load, "read_through", lambda f: (events.append(("read", f.name)), real_read(f))[1]
    )
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    argv = ["--tiny", "--repeats", "1", "--scratch", str(tmp_path), "--cache", "warm", "cold"]
    bench_load.main([*argv, "--cases", "converted_bf16", "converted_fp8"])
    (path,) = (tmp_path / "out").glob("load_*.json")
    (row,) = json.loads(path.read_text())["results"]
    assert row["caches"] == ["warm", "cold"]
    labels = {"converted_bf16", "converted_fp8", "converted_bf16_cold", "converted_fp8_cold"}
    assert set(row["loads"]) == labels
    folders = ["converted_bf16", "converted_fp8"]
    assert sorted(events) == sorted([("drop", f) for f in folders] + [("read", f) for f in folders])
    for label, load in row["loads"].items():
        assert load["weights"] == ("fp8" if "fp8" in label else "dtype"), label
    loads = {label: load["median_s"] for label, load in row["loads"].items()}
    for suffix in ("", "_cold"):
        ratio = loads[f"converted_fp8{suffix}"] / loads[f"converted_bf16{suffix}"]
        assert row[f"fp8_over_bf16{suffix}"] == pytest.approx(ratio, abs=1e-4)
    assert "hf_fp8_over_hf_bf16" not in row and "hf_fp8_over_hf_bf16_cold" not in row


def test_drop_cached_changes_no_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"\x01" * 5000)
    bench_load.drop_cached(tmp_path)
    assert (tmp_path / "a" / "x.bin").read_bytes() == b"\x01" * 5000


def test_read_through_reads_every_file_of_a_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"\x01" * 1000)
    (tmp_path / "y.json").write_text("{}")
    assert bench_load.read_through(tmp_path, chunk=64) == 1002
    assert bench_load.read_through(tmp_path) == bench_load.folder_bytes(tmp_path)


def test_load_bench_rotates_the_cases_and_checks_its_arguments(tmp_path):
    assert bench_load.rotated(["a", "b", "c", "d"], 0) == ["a", "b", "c", "d"]
    assert bench_load.rotated(["a", "b", "c", "d"], 1) == ["b", "c", "d", "a"]
    assert bench_load.rotated(["a", "b", "c", "d"], 5) == ["b", "c", "d", "a"]
    for bad in (["--scratch", str(tmp_path / "missing")], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_load.main(["--tiny", *bad])


def test_load_bench_deletes_its_folders_when_a_step_fails(tmp_path, monkeypatch):
    """A failing child (here the preparing one) propagates its error; the bench's folder
    inside `--scratch` is deleted all the same and nothing is saved."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    seen = []

    def failing(program, *args):
        seen.append(args[-1])
        raise RuntimeError("bench.load: prepare failed")

    monkeypatch.setattr(bench_load, "run_child", failing)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="prepare failed"):
        bench_load.main(["--tiny", "--scratch", str(scratch)])
    (work,) = seen
    assert work.startswith(str(scratch)) and list(scratch.iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_a_profiled_load_names_its_slowest_functions():
    import cProfile
    import pstats
    import time

    def slow():
        time.sleep(0.05)

    profiler = cProfile.Profile()
    profiler.runcall(slow)
    top = bench_load.top_functions(pstats.Stats(profiler), 2)
    assert len(top) == 2
    (name, seconds), _ = top.items()
    assert "(slow)" in name and seconds >= 0.04
    assert list(top.values()) == sorted(top.values(), reverse=True)
