"""`bench.fp8_error` on the tiny models: the fp8 rows and their control (weights perturbed
by noise of the fp8 rounding's size, no fp8 in it)."""

import json

import jax
import jax.numpy as jnp
import pytest

from bench import fp8_error


def test_matched_noise_has_the_size_of_the_fp8_rounding():
    w = jax.random.normal(jax.random.key(0), (512, 256), jnp.float32)
    out, (eps,) = fp8_error.matched_noise({"down": w}, jax.random.key(1))
    noisy = out["down"]
    # e4m3 keeps 3 mantissa bits: a relative rounding error of ~2.5% RMS
    assert 0.015 < eps < 0.04
    moved = jnp.linalg.norm(noisy - w) / jnp.linalg.norm(w)
    assert float(moved) == pytest.approx(eps, rel=0.05)
    qkv = jax.random.normal(jax.random.key(3), (128, 2, 3, 8))
    params, epsilons = fp8_error.matched_noise(
        {"layer": {"qkv": qkv, "norm": jnp.ones((128,))}}, jax.random.key(2)
    )
    # only what fp8 quantises is perturbed
    assert len(epsilons) == 1 and bool((params["layer"]["norm"] == 1).all())
    assert not bool((params["layer"]["qkv"] == qkv).all())


def test_fp8_error_rows_carry_the_control(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    fp8_error.main(["--tiny", "--models", "dense"])
    (path,) = tmp_path.glob("fp8_error_*.json")
    (row,) = json.loads(path.read_text())["results"]
    assert row["layers"] == 2
    for part in ("dequant", "scaled", "rounded_in_bf16", "matched_noise"):
        for where in ("all", "masked"):
            assert 0 < row[part][where]["logits_rel_l2"] < 0.5, (part, where)
            assert 0 <= row[part][where]["argmax_equal"] <= 1
    assert 0.015 < row["matched_noise"]["weight_rel_rms"] < 0.04
    # the same weight values through both programs: far closer than either to bf16
    gap = row["program_gap"]["all"]["logits_rel_l2"]
    assert gap < 0.5 * row["rounded_in_bf16"]["all"]["logits_rel_l2"]
    assert 0 <= row["generation_tokens_equal"] <= 1


def test_layers_cut_a_model_to_its_first_layers():
    from bench.common import model_config

    moe = model_config("moe", tiny=True)
    cut = fp8_error.with_layers(moe, 1)
    assert cut.n_layers == 1 and cut.moe_layers == moe.moe_layers[:1]
    assert fp8_error.with_layers(moe, None) is moe
    with pytest.raises(SystemExit, match="--layers 9"):
        fp8_error.with_layers(moe, 9)
