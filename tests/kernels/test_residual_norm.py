"""The residual add with its RMSNorm in one kernel (`residual_norm.add_rms_norm`, run by
Pallas's interpreter on the CPU) against the XLA path, and its errors. (`add_scaled`, the
add that leaves the norm to the next product, is tested with `residual_product`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.kernels.residual_norm import add_rms_norm
from djax.models import layers


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(dtype)


@pytest.mark.parametrize("shape, dtype", [((2, 5, 48), jnp.float32), ((32, 256), jnp.bfloat16)])
def test_add_rms_norm_matches_xla(shape, dtype):
    x, y = _normal(0, shape, dtype), _normal(1, shape, dtype)
    scale = _normal(2, shape[-1:], dtype, 0.1) + 1
    h, normed = add_rms_norm(x, y, scale, 1e-5, interpret=True)
    assert h.shape == normed.shape == shape and h.dtype == normed.dtype == dtype
    np.testing.assert_array_equal(h, x + y)
    np.testing.assert_allclose(
        normed.astype(jnp.float32),
        layers.rms_norm(x + y, scale, 1e-5).astype(jnp.float32),
        rtol=1e-6 if dtype == jnp.float32 else 1e-2,
    )


def test_add_rms_norm_errors():
    x = jnp.zeros((4, 32))
    with pytest.raises(ValueError, match=r"expected y shaped and typed like x and scale \[32\]"):
        add_rms_norm(x, jnp.zeros((4, 16)), jnp.ones(32), 1e-5, interpret=True)
    with pytest.raises(ValueError, match=r"scale \(16,\)"):
        add_rms_norm(x, x, jnp.ones(16), 1e-5, interpret=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernel_on_gpu():
    """On a GPU: the Triton-compiled kernel at LLaDA-8B's widths, a block's 32 rows and a
    refresh's 384, against the XLA path."""
    for rows in (32, 384):
        x, y = _normal(0, (1, rows, 4096), jnp.bfloat16), _normal(1, (1, rows, 4096), jnp.bfloat16)
        scale = _normal(2, (4096,), jnp.bfloat16, 0.1) + 1
        h, normed = add_rms_norm(x, y, scale, 1e-5)
        np.testing.assert_array_equal(h, x + y)
        ref = layers.rms_norm(x + y, scale, 1e-5).astype(jnp.float32)
        assert float(jnp.abs(normed.astype(jnp.float32) - ref).max()) <= 0.05
