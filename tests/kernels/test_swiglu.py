"""The SwiGLU gate/up Pallas kernel (run by Pallas's interpreter on the CPU) against XLA's
einsum and activation, its errors, and whole generations."""

import jax
import jax.numpy as jnp
import pytest

from djax.kernels.swiglu import Tiles, swiglu_matmul


def _problem(m, k, n, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = (jax.random.normal(keys[1], (k, 2, n)) * k**-0.5).astype(dtype)
    return x, w


def _reference(x, w):
    h = jnp.einsum("tm,mcf->tcf", x.astype(jnp.float32), w.astype(jnp.float32))
    return jax.nn.silu(h[:, 0]) * h[:, 1]


def _rel_error(ours, ref):
    return float(jnp.linalg.norm(ours.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize(
    "m, tiles",
    [
        (32, None),  # the engine's choice, `tiles_for`
        (20, Tiles(block_m=16, block_n=32, block_k=32)),  # rows over two tiles, the last masked
        (7, Tiles(block_m=16, block_n=16, block_k=64, num_stages=2)),
    ],
)
def test_matches_einsum_and_activation(m, tiles):
    x, w = _problem(m, 128, 64)
    ours = swiglu_matmul(x, w, tiles=tiles, interpret=True)
    assert ours.shape == (m, 64) and ours.dtype == x.dtype
    assert _rel_error(ours, _reference(x, w)) < 1e-6


def test_bf16_close_to_fp32():
    x, w = _problem(32, 256, 128, jnp.bfloat16, seed=1)
    ours = swiglu_matmul(x, w, interpret=True)
    assert ours.dtype == jnp.bfloat16
    assert _rel_error(ours, _reference(x, w)) < 1e-2


def test_shape_and_tile_errors():
    x, w = _problem(8, 64, 32)
    with pytest.raises(ValueError, match=r"expected w \[64, 2, n\]"):
        swiglu_matmul(x, w[:, 0], interpret=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        swiglu_matmul(x, jnp.zeros((64, 2, 40)), interpret=True)
    with pytest.raises(ValueError, match="block_n dividing n = 32"):
        swiglu_matmul(x, w, tiles=Tiles(block_n=64), interpret=True)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        swiglu_matmul(x, w, tiles=Tiles(block_k=48), interpret=True)


@pytest.mark.parametrize("cache", ["dual", "none"])
def test_generation_tokens_unchanged(assert_same_generation, cache):
    assert_same_generation({"mlp_impl": "pallas"}, {"mlp_impl": "xla"}, cache)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernel_on_gpu():
    """On a GPU: the Triton-compiled kernel at LLaDA-8B's shape (bf16, 32 rows, 4096 ->
    2 x 12288) and a ragged row count, each tiling of the benchmark's best."""
    for m in (32, 20):
        x, w = _problem(m, 4096, 12288, jnp.bfloat16, seed=3)
        ref = _reference(x, w)
        for tiles in (None, Tiles(block_n=64, block_k=128, num_stages=3)):
            err = _rel_error(swiglu_matmul(x, w, tiles=tiles), ref)
            assert err <= 1e-2, (m, tiles, err)
