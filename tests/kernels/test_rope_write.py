"""The q/k norm, clip, RoPE and K/V buffer-write kernels (`rope_write`, run by Pallas's
interpreter on the CPU), with and without the q/k/v product, against the XLA path they
replace; their errors, and whole generations with them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.kernels.handoff import Partials
from djax.kernels.rope_write import HeadOps, project_rope_and_write, rope_and_write
from djax.models import layers


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(dtype)


def _xla_rope_and_write(qkv, positions, buffers, window, rotary, scales, ops):
    return layers.rope_and_write_xla(qkv, positions, buffers, window, scales, ops, 10000.0, rotary)


ROPE_CASES = {
    # t, kv heads, group, head dim, rotary dim, buffer len, window, ops, dtype
    "dual block, tiles masked": (20, 2, 2, 16, 16, 48, layers.Window(5), HeadOps(), jnp.float32),
    "vicinity write range, two tiles": (
        40,
        2,
        1,
        32,
        16,
        64,
        layers.Window(10, 12, 30),
        HeadOps(True, 1e-5, 2.0),
        jnp.float32,
    ),
    "whole sequence, partial rotary": (
        12,
        3,
        3,
        24,
        16,
        None,
        layers.Window(),
        HeadOps(True, 1e-5),
        jnp.float32,
    ),
    "whole window at position 3": (
        12,
        2,
        1,
        16,
        16,
        None,
        layers.Window(3),
        HeadOps(),
        jnp.float32,
    ),
    "window past the buffer's end": (
        20,
        2,
        1,
        16,
        16,
        48,
        layers.Window(40),
        HeadOps(),
        jnp.float32,
    ),
    "LLaDA-8B block, bf16": (32, 4, 1, 128, 128, 384, layers.Window(128), HeadOps(), jnp.bfloat16),
    "LLaDA-MoE-like, bf16": (
        32,
        4,
        2,
        128,
        64,
        384,
        layers.Window(128),
        HeadOps(True, 1e-6, 8.0),
        jnp.bfloat16,
    ),
}


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_and_write_matches_xla(case, splits):
    """Against the XLA path, from a plain q/k/v product or from 3 split-K partials."""
    t, kv, group, d, rotary, s, window, ops, dtype = ROPE_CASES[case]
    qkv = _normal(0, (2, t, kv, group + 2, d), dtype, 3.0)
    product = qkv
    if splits:
        product = Partials(_normal(5, (splits, *qkv.shape), jnp.float32, 2.0), dtype)
        qkv = product.total()
    positions = window.start + jnp.broadcast_to(jnp.arange(t), (2, t))
    buffers = (
        None if s is None else (_normal(1, (2, s, kv, d), dtype), _normal(2, (2, s, kv, d), dtype))
    )
    scales = (
        (_normal(3, (d,), dtype, 0.1) + 1, _normal(4, (d,), dtype, 0.1) + 1)
        if ops.qk_norm
        else None
    )
    lo = window.start if window.write_lo is None else window.write_lo
    hi = window.start + t if window.write_hi is None else window.write_hi
    cos, sin = layers.rope_tables(positions, 10000.0, rotary)
    ours = rope_and_write(
        product, cos, sin, buffers, jnp.array([window.start, lo, hi]), scales, ops, interpret=True
    )
    want = _xla_rope_and_write(qkv, positions, buffers, window, rotary, scales, ops)
    for name, o, w in zip(("q", "keys", "values"), ours, want, strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype, name
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(
            o.astype(jnp.float32), w.astype(jnp.float32), atol=tol, rtol=tol, err_msg=name
        )
    if buffers is not None:  # rows not written are the old buffer's, bit for bit
        base = min(max(window.start, 0), s - t)  # where `write_window` puts the window
        written = [base + i for i in range(t) if lo <= window.start + i < hi]
        untouched = ~np.isin(np.arange(s), written)
        np.testing.assert_array_equal(ours[1][:, untouched], buffers[0][:, untouched])
        np.testing.assert_array_equal(ours[2][:, untouched], buffers[1][:, untouched])


def test_rope_and_write_errors():
    qkv = jnp.zeros((1, 8, 2, 3, 32))
    cos = sin = jnp.zeros((1, 8, 16))
    bounds = jnp.array([0, 0, 8])
    with pytest.raises(ValueError, match=r"qkv \(1, 8, 2, 3, 32\) with cos \(1, 4, 16\)"):
        rope_and_write(qkv, cos[:, :4], sin[:, :4], None, bounds, interpret=True)
    with pytest.raises(ValueError, match="rotary dim 24 for head dim 32"):
        rope_and_write(qkv, cos[..., :12], sin[..., :12], None, bounds, interpret=True)
    with pytest.raises(ValueError, match=r"buffers \[\(1, 16, 4, 32\)"):
        bad = jnp.zeros((1, 16, 4, 32))
        rope_and_write(qkv, cos, sin, (bad, bad), bounds, interpret=True)
    with pytest.raises(ValueError, match="qk_norm=True with scales None"):
        rope_and_write(qkv, cos, sin, None, bounds, ops=HeadOps(qk_norm=True), interpret=True)
    with pytest.raises(ValueError, match="group >= 1"):
        rope_and_write(qkv[:, :, :, :2], cos, sin, None, bounds, interpret=True)


PROJECTION_CASES = {
    # b, t, model, kv heads, group, head dim, rotary dim, buffer len, window, ops, dtype
    "two sequences, rows masked": (
        2,
        12,
        64,
        2,
        2,
        32,
        32,
        48,
        layers.Window(5),
        HeadOps(),
        jnp.float32,
    ),
    "vicinity write range": (
        1,
        24,
        256,
        2,
        1,
        32,
        32,
        64,
        layers.Window(10, 12, 30),
        HeadOps(True, 1e-5, 2.0),
        jnp.float32,
    ),
    "whole sequence, partial rotary": (
        1,
        12,
        48,
        3,
        2,
        64,
        32,
        None,
        layers.Window(3),
        HeadOps(True, 1e-5),
        jnp.float32,
    ),
    "window past the buffer's end": (
        2,
        16,
        64,
        1,
        1,
        32,
        32,
        40,
        layers.Window(30),
        HeadOps(),
        jnp.float32,
    ),
    "LLaDA-8B block, bf16": (
        1,
        32,
        256,
        4,
        1,
        128,
        128,
        384,
        layers.Window(128),
        HeadOps(),
        jnp.bfloat16,
    ),
}


def _projection_inputs(case):
    b, t, model, kv, group, d, rotary, s, window, ops, dtype = case
    x = _normal(0, (b, t, model), dtype)
    w = _normal(1, (model, kv, group + 2, d), dtype, 3.0 * model**-0.5)
    positions = window.start + jnp.broadcast_to(jnp.arange(t), (b, t))
    buffers = (
        None if s is None else (_normal(2, (b, s, kv, d), dtype), _normal(3, (b, s, kv, d), dtype))
    )
    scales = (
        (_normal(4, (d,), dtype, 0.1) + 1, _normal(5, (d,), dtype, 0.1) + 1)
        if ops.qk_norm
        else None
    )
    lo = window.start if window.write_lo is None else window.write_lo
    hi = window.start + t if window.write_hi is None else window.write_hi
    cos, sin = layers.rope_tables(positions, 10000.0, rotary)
    return x, w, positions, buffers, scales, jnp.array([window.start, lo, hi]), cos, sin


@pytest.mark.parametrize("case", PROJECTION_CASES)
def test_project_rope_and_write_matches_xla(case):
    """The q/k/v product inside the kernel against XLA's product (rounded to the activation
    dtype) and XLA's RoPE and buffer writes; rows outside the write range keep the buffer's."""
    b, t, model, kv, group, d, rotary, s, window, ops, dtype = PROJECTION_CASES[case]
    x, w, positions, buffers, scales, bounds, cos, sin = _projection_inputs(PROJECTION_CASES[case])
    ours = project_rope_and_write(x, w, cos, sin, buffers, bounds, scales, ops, interpret=True)
    qkv = jnp.einsum(
        "btm,mkgd->btkgd", x, w, precision="highest", preferred_element_type=jnp.float32
    )
    want = _xla_rope_and_write(qkv.astype(dtype), positions, buffers, window, rotary, scales, ops)
    for name, o, ref in zip(("q", "keys", "values"), ours, want, strict=True):
        assert o.shape == ref.shape and o.dtype == ref.dtype, name
        tol = 1e-4 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(
            o.astype(jnp.float32), ref.astype(jnp.float32), atol=tol, rtol=tol, err_msg=name
        )
    if buffers is not None:
        lo, hi = int(bounds[1]), int(bounds[2])
        base = min(max(window.start, 0), s - t)
        written = [base + i for i in range(t) if lo <= window.start + i < hi]
        untouched = ~np.isin(np.arange(s), written)
        assert untouched.sum() > 0
        np.testing.assert_array_equal(ours[1][:, untouched], buffers[0][:, untouched])
        np.testing.assert_array_equal(ours[2][:, untouched], buffers[1][:, untouched])


def test_project_rope_and_write_errors():
    x, w = jnp.zeros((1, 8, 64)), jnp.zeros((64, 2, 3, 32))
    cos = sin = jnp.zeros((1, 8, 16))
    bounds = jnp.array([0, 0, 8])
    with pytest.raises(ValueError, match=r"x \(1, 8, 64\) with w \(48, 2, 3, 32\)"):
        project_rope_and_write(x, w[:48], cos, sin, None, bounds, interpret=True)
    with pytest.raises(ValueError, match=r"x \(1, 8, 64\) with cos \(1, 4, 16\)"):
        project_rope_and_write(x, w, cos[:, :4], sin[:, :4], None, bounds, interpret=True)
    with pytest.raises(ValueError, match="40 window rows, model width 64, rotary dim 32 of 32"):
        x40, table = jnp.zeros((1, 40, 64)), jnp.zeros((1, 40, 16))
        project_rope_and_write(x40, w, table, table, None, bounds, interpret=True)
    with pytest.raises(ValueError, match="rotary dim 16 of 32"):  # halves of 8: no matmul tile
        project_rope_and_write(x, w, cos[..., :8], sin[..., :8], None, bounds, interpret=True)
    with pytest.raises(ValueError, match=r"buffers \[\(1, 16, 4, 32\)"):
        bad = jnp.zeros((1, 16, 4, 32))
        project_rope_and_write(x, w, cos, sin, (bad, bad), bounds, interpret=True)
    with pytest.raises(ValueError, match="qk_norm=True with scales None"):
        ops = HeadOps(qk_norm=True)
        project_rope_and_write(x, w, cos, sin, None, bounds, ops=ops, interpret=True)


@pytest.mark.parametrize("cache", ["dual", "vicinity", "prefix", "none"])
def test_generation_tokens_unchanged(assert_same_generation, cache):
    xla = {"norm_impl": "xla", "rope_impl": "xla"}
    assert_same_generation({"norm_impl": "pallas", "rope_impl": "pallas"}, xla, cache)


def test_moe_generation_tokens_unchanged(moe_model):
    """LLaDA-MoE's heads carry q/k norms: the kernel applies them before RoPE."""
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    prompts = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]
    fused = moe_model.with_options(norm_impl="pallas", rope_impl="pallas")
    ours = djax.generate(fused, prompts, config)
    ref = djax.generate(moe_model.with_options(norm_impl="xla", rope_impl="xla"), prompts, config)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernels_on_gpu():
    """On a GPU: the Triton-compiled kernel at LLaDA-8B's block shapes (bf16, 32 rows, a
    384-position buffer written at 128), against the XLA path."""
    for case in ("LLaDA-8B block, bf16", "LLaDA-MoE-like, bf16"):
        t, kv, group, d, rotary, s, window, ops, dtype = ROPE_CASES[case]
        qkv = _normal(0, (1, t, kv, group + 2, d), dtype, 3.0)
        positions = window.start + jnp.arange(t)[None]
        buffers = (_normal(1, (1, s, kv, d), dtype), _normal(2, (1, s, kv, d), dtype))
        scales = (_normal(3, (d,), dtype, 0.1) + 1,) * 2 if ops.qk_norm else None
        cos, sin = layers.rope_tables(positions, 10000.0, rotary)
        bounds = jnp.array([window.start, window.start, window.start + t])
        ours = rope_and_write(qkv, cos, sin, buffers, bounds, scales, ops)
        want = _xla_rope_and_write(qkv, positions, buffers, window, rotary, scales, ops)
        for o, w in zip(ours, want, strict=True):
            np.testing.assert_allclose(
                o.astype(jnp.float32), w.astype(jnp.float32), atol=0.1, rtol=0.02
            )


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_projection_on_gpu():
    """On a GPU: the Triton-compiled q/k/v product inside the RoPE/K/V-write kernel at
    LLaDA-8B's block shape, LLaDA-MoE's (q/k norms) and two 16-row sequences, against XLA's
    product and head ops."""
    cases = [
        (1, 32, 4096, 32, 1, 128, 128, 384, layers.Window(128), HeadOps(), jnp.bfloat16),
        (1, 32, 2048, 16, 1, 128, 128, 384, layers.Window(128), HeadOps(True, 1e-6), jnp.bfloat16),
        (2, 16, 4096, 8, 1, 128, 128, 384, layers.Window(370), HeadOps(), jnp.bfloat16),
    ]
    for case in cases:
        b, t, model, kv, group, d, rotary, s, window, ops, dtype = case
        x, w, positions, buffers, scales, bounds, cos, sin = _projection_inputs(case)
        ours = project_rope_and_write(x, w, cos, sin, buffers, bounds, scales, ops)
        qkv = jnp.einsum("btm,mkgd->btkgd", x, w, preferred_element_type=jnp.float32)
        want = _xla_rope_and_write(
            qkv.astype(dtype), positions, buffers, window, rotary, scales, ops
        )
        for o, ref in zip(ours, want, strict=True):
            np.testing.assert_allclose(
                o.astype(jnp.float32), ref.astype(jnp.float32), atol=0.1, rtol=0.02
            )
