"""The split-K/V Pallas attention kernel (run by Pallas's interpreter on the CPU) against the
einsum attention, its shape errors, its tiles per window, and whole generations with
it."""

import jax
import jax.numpy as jnp
import pytest

from djax.kernels.flash_attention import KEYS_PER_SLICE, Tiles, split_kv_attention, tiles_for
from djax.models import layers


def _problem(b, t, n, kv, d, s, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, n, d), dtype)
    k = jax.random.normal(keys[1], (b, s, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, s, kv, d), dtype)
    return q, k, v


def _einsum_attention(q, k, v, key_valid):
    b, t, n, d = q.shape
    kv = k.shape[2]
    return layers.attend(q.reshape(b, t, kv, n // kv, d), k, v, key_valid, "xla").reshape(q.shape)


TILES = [
    Tiles(block_q=16, block_k=16, splits=1),  # one program per head and query tile
    Tiles(block_q=32, block_k=32, splits=3),  # key slices merged by log-sum-exp
    None,  # the engine's tiles_for(t, s)
]
SHAPES = [(40, 200), (8, 37), (32, 384), (32, 700), (100, 200)]
# More splits asked than key blocks: every shape has fewer than 50 blocks of 16 keys, so the
# two short ones cover the clamp (the interpreter runs one program per split and tile).
MANY_SPLITS = Tiles(block_q=16, block_k=16, splits=50)


@pytest.mark.parametrize(
    "tiles, t, s",
    [(tiles, t, s) for tiles in TILES for t, s in SHAPES]
    + [(MANY_SPLITS, t, s) for t, s in SHAPES[:2]],
)
def test_matches_einsum_attention(tiles, t, s):
    """GQA (group 2), a batch whose second row is left-padded past a whole key slice, and
    query and key counts that are not multiples of the tiles."""
    q, k, v = _problem(2, t, 4, 2, 32, s)
    key_valid = jnp.arange(s)[None, :] >= jnp.array([[0], [min(s - 1, 70)]])
    ours = split_kv_attention(q, k, v, key_valid, tiles=tiles, interpret=True)
    ref = _einsum_attention(q, k, v, key_valid)
    err = float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))
    assert err <= 1e-5, err
    assert not jnp.isnan(ours).any()


def test_bf16_close_to_fp32():
    """bf16 inputs, three key slices, the second row padded past the first slice."""
    q, k, v = _problem(2, 32, 4, 4, 64, 160, jnp.bfloat16, seed=1)
    key_valid = jnp.arange(160)[None, :] >= jnp.array([[0], [70]])
    ours = split_kv_attention(q, k, v, key_valid, tiles=Tiles(splits=3), interpret=True)
    assert not jnp.isnan(ours).any()
    assert ours.dtype == jnp.bfloat16
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), key_valid)
    err = float(jnp.linalg.norm(ours.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err <= 1e-2, err


def test_shape_and_tile_errors():
    q, k, v = _problem(1, 8, 4, 2, 24, 32)
    with pytest.raises(ValueError, match=r"q \(1, 8, 4, 24\).*power-of-two head dim >= 16"):
        split_kv_attention(q, k, v, jnp.ones((1, 32), bool), interpret=True)
    q, k, v = _problem(1, 8, 3, 2, 16, 32)
    with pytest.raises(ValueError, match="heads a multiple of kv heads"):
        split_kv_attention(q, k, v, jnp.ones((1, 32), bool), interpret=True)
    q, k, v = _problem(1, 8, 4, 2, 16, 32)
    with pytest.raises(ValueError, match="block_q and block_k must be powers of two >= 16"):
        split_kv_attention(q, k, v, jnp.ones((1, 32), bool), tiles=Tiles(block_k=48))


@pytest.mark.parametrize("cache", ["dual", "none"])
def test_generation_tokens_unchanged(assert_same_generation, cache):
    assert_same_generation({"attention_impl": "split_kv"}, {"attention_impl": "xla"}, cache)


def test_tiles_for_blocks_and_refreshes():
    """A block takes 16-query tiles and a key slice per KEYS_PER_SLICE keys (no merge at
    384 keys); a longer window takes 64-query tiles over all keys where that makes at least
    64 programs, else the block tiling."""
    block = Tiles(block_q=16, block_k=64, splits=1, num_stages=3)
    window = Tiles(block_q=64, block_k=64, splits=1, num_stages=2)
    assert tiles_for(32, 384, 32) == block
    assert tiles_for(32, KEYS_PER_SLICE + 1, 32).splits == 2
    assert tiles_for(64, 1280, 32).splits == 2
    assert tiles_for(65, 384, 32) == window
    assert tiles_for(128, 384, 32) == window  # LLaDA-8B's heads: 64 programs
    assert tiles_for(128, 384, 16) == block  # LLaDA-MoE's heads: 32 programs
    assert tiles_for(384, 384, 16) == window  # its refresh: 96 programs


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("t, s", [(32, 384), (32, 1000), (384, 384)])
def test_compiled_kernel_on_gpu(t, s):
    """On a GPU: the Triton-compiled kernel at the model's shapes (bf16, head dim 128, GQA
    group 2, a left-padded row): the engine's tiles, and 6 and 12 key slices merged."""
    q, k, v = _problem(2, t, 16, 8, 128, s, jnp.bfloat16, seed=2)
    key_valid = jnp.arange(s)[None, :] >= jnp.array([[0], [100]])
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), key_valid)
    for tiles in (None, Tiles(), Tiles(block_k=32, splits=12)):  # None: tiles_for(t, s)
        ours = split_kv_attention(q, k, v, key_valid, tiles=tiles).astype(jnp.float32)
        err = float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))
        assert err <= 1e-2, (tiles, err)
