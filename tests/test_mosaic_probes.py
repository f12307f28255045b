"""The Mosaic GPU probes (`bench.probes.pdl`, `bench.probes.tma_matmul`): the TMA/WGMMA
split-K product's arithmetic in Mosaic GPU's interpreter, the tilings the sweep keeps, and
the refusal off GPUs."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.probes import pdl, tma_matmul


def test_tma_partials_sum_to_the_product():
    """Each CTA's slice of the contraction, summed over the slices, is x @ w (padded rows
    stay zero); the interpreter runs the kernel's TMA ring and WGMMA steps on the CPU."""
    params = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    k, n = 512, 256
    x = jnp.zeros((tma_matmul.PAD_ROWS, k), jnp.bfloat16)
    x = x.at[:32].set(jax.random.normal(jax.random.key(0), (32, k), jnp.bfloat16))
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
    parts = tma_matmul.tma_partials(x, w, 128, 64, 2, 3, interpret=params.InterpretGPUParams())
    assert parts.shape == (2, tma_matmul.PAD_ROWS, n) and parts.dtype == jnp.float32
    want = x.astype(jnp.float32) @ w.astype(jnp.float32)
    np.testing.assert_allclose(parts.sum(0), want, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(parts[0], x[:, :256].astype(jnp.float32) @ w[:256], atol=1e-3)
    assert not np.asarray(parts[:, 32:]).any()
    with pytest.raises(ValueError, match=r"x \(32, 512\), w \(512, 256\): no 128x64 tiles in 2"):
        tma_matmul.tma_partials(x[:32], w, 128, 64, 2, 3)


def test_tilings_that_fit():
    """A tiling is kept when it divides the product into 48-528 CTAs of >= 4 steps and its
    rings fit in 224 KB of shared memory."""
    assert tma_matmul.fits(12288, 4096, (128, 128, 4, 4))  # 128 CTAs, 224 KB
    assert not tma_matmul.fits(12288, 4096, (128, 128, 4, 5))  # 272 KB
    assert tma_matmul.fits(12288, 4096, (128, 128, 4, 5), x_rows=32)  # unpadded x: 216 KB
    assert not tma_matmul.fits(4096, 4096, (256, 64, 1, 3))  # 16 CTAs
    assert not tma_matmul.fits(4096, 12288, (128, 128, 16, 3))  # 2 steps per slice


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is for other devices")
@pytest.mark.parametrize("module", [pdl, tma_matmul])
def test_probes_refuse_other_devices(module, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__name__])
    with pytest.raises(SystemExit, match="needs a Hopper GPU.*CpuDevice"):
        module.main()
