"""`bench.parallel` on the tiny dense model over fake CPU devices: one device against TP=2,
fp8 weights under a kernel-option variant, each row with its options and what they
resolved to, its speedup against one device under the same options and the share of its tokens
equal to one device's."""

import json
import math

import jax
import pytest

from bench import parallel


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (the CPU run fakes them)")
def test_parallel_rows_carry_the_weights_and_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = ["--tiny", "--sizes", "1", "2", "--models", "dense", "--weights", "fp8"]
    parallel.main([*args, "--variants", "fp8_impl=scaled", "--repeats", "1"])
    (path,) = tmp_path.glob("parallel_fp8_*.json")
    record = json.loads(path.read_text())
    rows = record["results"]
    options = {"fp8_impl": "scaled"}  # auto takes `dequant` on a CPU
    assert [(row["devices"], row["options"]) for row in rows] == [(1, options), (2, options)]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert (row["weights"], row["routing"]) == ("fp8", "model")
        assert row["tokens_per_s"] > 0 and row["forwards"] > 0
        # By difference of two timed generations: on a loaded CPU the tiny model's
        # difference is noise around zero, so only that it was computed is checked.
        assert math.isfinite(row["block_forward_ms"])
        assert row["kernels"].endswith("weights: fp8, as stored")
        assert "fp8=scaled" in row["kernels"]
    one, two = rows
    assert two["tensor_parallel"] == 2
    assert two["speedup_vs_1"] == pytest.approx(two["tokens_per_s"] / one["tokens_per_s"])
    assert 0.0 <= two["tokens_equal_vs_1"] <= 1.0 and "tokens_equal_vs_1" not in one
    assert not any("answer_ids" in row for row in rows)
    assert record["options"]["weights"] == ["fp8"]
