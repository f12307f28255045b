"""`bench.parallel` on the tiny dense model over fake CPU devices: one device against TP=2,
fp8 weights, each row with what `auto` resolved."""

import json

import jax
import pytest

from bench import parallel


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (the CPU run fakes them)")
def test_parallel_rows_carry_the_weights_and_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = ["--tiny", "--sizes", "1", "2", "--models", "dense", "--weights", "fp8"]
    parallel.main([*args, "--repeats", "1"])
    (path,) = tmp_path.glob("parallel_fp8_*.json")
    record = json.loads(path.read_text())
    rows = record["results"]
    assert [row["devices"] for row in rows] == [1, 2]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert (row["weights"], row["routing"]) == ("fp8", "model")
        assert row["tokens_per_s"] > 0 and row["block_forward_ms"] > 0
        assert row["kernels"].endswith("weights: fp8, as stored")
    assert rows[1]["tensor_parallel"] == 2 and rows[1]["speedup_vs_1"] > 0
    assert record["options"]["weights"] == ["fp8"]
