"""The split-K matmul (run by Pallas's interpreter on the CPU) against an fp32 product, its
partials summed by each consumer, its errors, and whole generations
(alone, with the fused consumers, and under tensor parallelism)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices

import djax
from djax.kernels.handoff import finish
from djax.kernels.split_k import Tiles, matmul_partials, tiles_for
from djax.models import kernel_choice, layers


def _problem(shape, k, n, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (*shape, k), dtype)
    w = (jax.random.normal(keys[1], (k, n)) * k**-0.5).astype(dtype)
    return x, w


def _rel_error(ours, ref):
    ours, ref = ours.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize(
    "shape, tiles",
    [
        ((1, 32), None),  # the engine's choice, `tiles_for`
        ((2, 10), Tiles(block_m=16, block_n=32, block_k=32, splits=4)),  # rows over two tiles
        ((7,), Tiles(block_m=16, block_n=64, block_k=16, splits=1, num_stages=2)),
    ],
)
def test_matches_fp32_product(shape, tiles):
    x, w = _problem(shape, 256, 128)
    y = matmul_partials(x, w, tiles=tiles, interpret=True)
    splits = (tiles or tiles_for(int(np.prod(shape)), 256, 128)).splits
    assert y.parts.shape == (splits, *shape, 128) and y.parts.dtype == jnp.float32
    assert y.shape == (*shape, 128) and y.dtype == x.dtype
    assert _rel_error(y.total(), x @ w) < 1e-6
    assert finish(y) is not y and finish(x) is x


def test_bf16_close_to_fp32():
    x, w = _problem((32,), 512, 256, jnp.bfloat16, seed=1)
    y = matmul_partials(x, w, interpret=True).total()
    assert y.dtype == jnp.bfloat16
    assert _rel_error(y, x.astype(jnp.float32) @ w.astype(jnp.float32)) < 1e-2


def test_tiles_for_fill_the_gpu():
    """LLaDA-8B's block products get one wave of programs: q/k/v 96 column tiles unsplit,
    attention output and down 32 x 4 slices (bench.split_k's best on an H200)."""
    assert tiles_for(32, 4096, 12288) == Tiles(32, 128, 128, 1)
    assert tiles_for(32, 4096, 4096) == Tiles(32, 128, 64, 4)
    assert tiles_for(32, 12288, 4096) == Tiles(32, 128, 64, 4)
    assert tiles_for(8, 64, 96).splits == 1  # too short to split


def test_shape_and_tile_errors():
    x, w = _problem((8,), 64, 32)
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., 32\]"):
        matmul_partials(x, w.T, interpret=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        matmul_partials(x, jnp.zeros((64, 40)), interpret=True)
    with pytest.raises(ValueError, match="block_n dividing n = 32"):
        matmul_partials(x, w, tiles=Tiles(block_n=64), interpret=True)
    with pytest.raises(ValueError, match="splits x block_k dividing k = 64"):
        matmul_partials(x, w, tiles=Tiles(block_n=32, block_k=32, splits=4), interpret=True)


def test_partials_consumers_sum_them():
    """add_rms_norm and the XLA paths agree on a product left in partials."""
    x, w = _problem((2, 5), 128, 64, seed=2)
    y = matmul_partials(x, w, tiles=Tiles(block_m=16, block_n=32, block_k=16, splits=4))
    residual = jax.random.normal(jax.random.key(3), (2, 5, 64))
    norm = layers.RMSNorm(1e-5, jnp.float32)
    params = norm.init(jax.random.key(0), residual)
    ours = norm.apply(params, y, residual=residual, impl="pallas")
    ref = norm.apply(params, y, residual=residual, impl="xla")
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


XLA = {"matmul_impl": "xla", "norm_impl": "xla", "rope_impl": "xla"}


@pytest.mark.parametrize(
    "cache, consumers",
    # XLA's consumers sum the partials the same way in every forward: the dual cache's
    # refreshes and block forwards cover them; the kernels' consumers run under each cache.
    [("dual", "xla"), ("dual", "pallas"), ("vicinity", "pallas"), ("none", "pallas")],
)
def test_generation_tokens_unchanged(assert_same_generation, cache, consumers):
    ours = {"matmul_impl": "pallas", "norm_impl": consumers, "rope_impl": consumers}
    assert_same_generation(ours, XLA, cache)


@needs_devices
def test_tensor_parallel_generation_tokens_unchanged(dense_folder):
    """Under TP the partials are summed before each all-reduce."""
    from djax.sharding import make_mesh

    mesh = make_mesh(tensor_parallel=2)
    pallas = {"matmul_impl": "pallas", "norm_impl": "pallas", "rope_impl": "pallas"}
    sharded = djax.load(dense_folder[0], jnp.float32, mesh=mesh, **pallas)
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    prompts = [[0, 10, 20, 30, 40, 50]]
    ours = djax.generate(sharded, prompts, config)
    ref = djax.generate(djax.load(dense_folder[0], jnp.float32, **XLA), prompts, config)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernel_on_gpu():
    """On a GPU: the Triton-compiled kernel at LLaDA-8B's three block products (bf16,
    32 rows) and a ragged row count."""
    for m in (32, 20):
        for k, n in ((4096, 12288), (4096, 4096), (12288, 4096)):
            x, w = _problem((m,), k, n, jnp.bfloat16, seed=3)
            ref = x.astype(jnp.float32) @ w.astype(jnp.float32)
            err = _rel_error(matmul_partials(x, w).total(), ref)
            assert err <= 1e-2, (m, k, n, err)


def test_generation_with_several_slices(assert_same_generation, monkeypatch):
    """The tiny model's products are too short for `tiles_for` to split them: force two
    slices, so the norm and RoPE kernels add partials inside a generation."""
    from djax import engine
    from djax.kernels import split_k

    shapes = []

    def two_slices(m, k, n):
        shapes.append((m, k, n))
        return Tiles(block_m=16, block_n=16, block_k=16, splits=2)

    monkeypatch.setattr(split_k, "tiles_for", two_slices)
    monkeypatch.setattr(engine, "_EXECUTABLES", {})  # programs built with the real tiles_for
    jax.clear_caches()  # and the products' traces
    try:
        ours = {"matmul_impl": "pallas", "norm_impl": "pallas", "rope_impl": "pallas"}
        assert_same_generation(ours, XLA, "dual")
        assert {(k, n) for _, k, n in shapes} == {(64, 128), (64, 64), (96, 64)}  # the 3 products
    finally:
        jax.clear_caches()


def test_moe_shared_expert_follows_matmul_impl(moe_model):
    """A LLaDA-MoE layout with a shared expert (random weights): its down product takes the
    split-K path too, and a ragged two-row batch's tokens match XLA's. This is also the
    LLaDA-MoE layout's generation test (its attention and expert products split-K)."""
    import dataclasses

    from djax.model import Model
    from djax.models import init_params

    config = dataclasses.replace(moe_model.config, shared_expert_hidden=16)
    params = init_params(config, jnp.float32, seed=4)
    assert "shared" in params["ff_1"]
    model = Model(config, params, None, jnp.float32)
    gen = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    prompts = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]
    pallas = {"matmul_impl": "pallas", "norm_impl": "pallas", "rope_impl": "pallas"}
    ours = djax.generate(model.with_options(**pallas), prompts, gen)
    ref = djax.generate(model.with_options(**XLA), prompts, gen)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_generation_with_qkv_product_in_rope_kernel(dense_model, moe_model, monkeypatch, family):
    """Heads of 32 (rotary halves of 16, a matmul tile) let the q/k/v product run inside the
    RoPE/K/V-write kernel (`fuse_qkv_rope`): GQA on the dense layout, q/k norms on LLaDA-MoE's
    (random weights). The kernel must run, and the tokens match XLA's."""
    import dataclasses

    from djax import engine
    from djax.kernels import rope_write
    from djax.model import Model
    from djax.models import init_params

    base = (dense_model if family == "dense" else moe_model).config
    kv_heads = 1 if family == "dense" else 2
    config = dataclasses.replace(base, n_heads=2, n_kv_heads=kv_heads, head_dim=32)
    model = Model(config, init_params(config, jnp.float32, seed=5), None, jnp.float32)
    windows = []
    fused = rope_write.project_rope_and_write

    def spy(x, *args, **kwargs):
        windows.append(x.shape)
        return fused(x, *args, **kwargs)

    monkeypatch.setattr(rope_write, "project_rope_and_write", spy)
    monkeypatch.setattr(
        kernel_choice, "MIN_FUSED_PROGRAMS", 1
    )  # a speed rule; these have 4-8 heads
    monkeypatch.setattr(engine, "_EXECUTABLES", {})  # programs traced before the spy
    jax.clear_caches()
    try:
        gen = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
        prompts = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]
        pallas = {"matmul_impl": "pallas", "norm_impl": "pallas", "rope_impl": "pallas"}
        ours = djax.generate(model.with_options(**pallas), prompts, gen)
        assert (2, 8, config.d_model) in windows  # the blocks' forwards took the kernel
        ref = djax.generate(model.with_options(**XLA), prompts, gen)
        np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
    finally:
        jax.clear_caches()
