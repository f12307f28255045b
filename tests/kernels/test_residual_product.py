"""The residual add inside the output/down product and the RMSNorm inside the next product
(`residual_product`, run by Pallas's interpreter on the CPU): the kernel against XLA's add
and norm, the gate/up and q/k/v kernels taking `ScaledRows` against them taking normed
rows, the errors, and whole generations."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.kernels import residual_product, rope_write
from djax.kernels.handoff import Partials, ScaledRows
from djax.kernels.residual_norm import add_rms_norm, add_scaled
from djax.kernels.swiglu import swiglu_matmul
from djax.models import kernel_choice, layers

EPS = 1e-5


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(dtype)


def _fused_norm(rows: ScaledRows) -> jax.Array:
    """What the consuming kernels apply: the scaled rows times 1 / rms(h), in fp32."""
    return rows.scaled.astype(jnp.float32) * rows.inv_rms()


# lead dims, k, n, tiles: ragged rows and a tile count that is not a power of two (96 / 32)
CASES = {
    "block rows": ((2, 5), 64, 96, None),
    "several row tiles": ((40,), 128, 64, residual_product.Tiles(16, 16, 32, 4, 2)),
}


@pytest.mark.parametrize("case", CASES)
def test_residual_product_matches_add_and_norm(case):
    lead, k, n, tiles = CASES[case]
    x, w = _normal(0, (*lead, k)), _normal(1, (k, n), scale=k**-0.5)
    residual, scale = _normal(2, (*lead, n)), _normal(3, (n,), scale=0.1) + 1
    h, rows = residual_product.residual_product(x, w, residual, scale, EPS, tiles, True)
    want_h = residual + jnp.einsum("...k,kn->...n", x, w, precision="highest")
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows.scaled, h * scale, rtol=1e-6)
    assert rows.squares.shape[1:] == lead and rows.eps == EPS
    np.testing.assert_allclose(
        _fused_norm(rows), layers.rms_norm(h, scale, EPS), rtol=1e-5, atol=1e-6
    )


def test_residual_product_rounds_like_the_norm_kernel():
    """bf16: h is rounded as `add_rms_norm` rounds it (the product first, then the sum)."""
    x, w = _normal(0, (32, 128), jnp.bfloat16), _normal(1, (128, 64), jnp.bfloat16, 0.1)
    residual = _normal(2, (32, 64), jnp.bfloat16)
    h, _ = residual_product.residual_product(x, w, residual, jnp.ones(64, jnp.bfloat16), EPS)
    product = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    want = (residual.astype(jnp.float32) + product.astype(jnp.float32)).astype(jnp.bfloat16)
    assert h.dtype == jnp.bfloat16
    np.testing.assert_allclose(h.astype(jnp.float32), want.astype(jnp.float32), rtol=1e-2)


def test_residual_product_errors():
    x, w, r, s = jnp.zeros((4, 64)), jnp.zeros((64, 32)), jnp.zeros((4, 32)), jnp.ones(32)
    with pytest.raises(ValueError, match=r"residual \(4, 16\).*expected x \[\.\.\., 64\]"):
        residual_product.residual_product(x, w, r[:, :16], s, EPS, interpret=True)
    with pytest.raises(ValueError, match=r"scale \(16,\)"):
        residual_product.residual_product(x, w, r, s[:16], EPS, interpret=True)
    with pytest.raises(ValueError, match="block_n dividing n = 32"):
        tiles = residual_product.Tiles(16, 64, 32)
        residual_product.residual_product(x, w, r, s, EPS, tiles, True)
    rows = ScaledRows(jnp.zeros((2, 3, 32)), jnp.zeros((1, 2, 3)), EPS)
    assert rows.reshape(6, 32).squares.shape == (1, 6)
    with pytest.raises(ValueError, match="the last dim must stay 32"):
        rows.reshape(3, 64)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("lead, d, block_n", [((2, 5), 96, 32), ((40,), 64, 16)])
def test_add_scaled_matches_add_and_norm(lead, d, block_n, splits):
    """The tiled residual add (`add_scaled`, ragged rows, a column tile count that is not a
    power of two) leaves h and the rows whose norm the consumer applies, as XLA computes
    them, from a plain sum or split-K partials."""
    x, scale = _normal(0, (*lead, d)), _normal(1, (d,), scale=0.1) + 1
    y = (
        _normal(2, (*lead, d))
        if splits is None
        else Partials(_normal(2, (splits, *lead, d)), jnp.float32)
    )
    h, rows = add_scaled(x, y, scale, EPS, block_n=block_n, interpret=True)
    want_h = x + (y if splits is None else y.parts.sum(0))
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows.scaled, h * scale, rtol=1e-6)
    assert rows.squares.shape == (d // block_n, *lead) and rows.eps == EPS
    np.testing.assert_allclose(
        _fused_norm(rows), layers.rms_norm(h, scale, EPS), rtol=1e-5, atol=1e-6
    )


def test_add_scaled_rounds_like_the_norm_kernel():
    """bf16 partials: h is `add_rms_norm`'s h bit for bit (the slices summed and rounded,
    then the add rounded)."""
    x = _normal(0, (32, 64), jnp.bfloat16)
    y = Partials(_normal(1, (4, 32, 64)), jnp.bfloat16)
    scale = jnp.ones(64, jnp.bfloat16)
    h, rows = add_scaled(x, y, scale, EPS, interpret=True)
    want, _ = add_rms_norm(x, y, scale, EPS, interpret=True)
    assert h.dtype == rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(h, want)


def test_add_scaled_errors():
    x, s = jnp.zeros((4, 64)), jnp.ones(64)
    with pytest.raises(ValueError, match=r"y \(4, 32\).*expected y shaped and typed like x"):
        add_scaled(x, jnp.zeros((4, 32)), s, EPS, interpret=True)
    with pytest.raises(ValueError, match=r"scale \(32,\)"):
        add_scaled(x, x, s[:32], EPS, interpret=True)
    with pytest.raises(ValueError, match="block_n 48"):
        add_scaled(x, x, s, EPS, block_n=48, interpret=True)


def _scaled_rows(lead, d, seed=0):
    """Rows h as the output product leaves them (`ScaledRows`), and XLA's norm of h."""
    x, w = _normal(seed, (*lead, d)), _normal(seed + 1, (d, d), scale=d**-0.5)
    residual, scale = _normal(seed + 2, (*lead, d)), _normal(seed + 3, (d,), scale=0.1) + 1
    h, rows = residual_product.residual_product(x, w, residual, scale, EPS, interpret=True)
    return rows, layers.rms_norm(h, scale, EPS)


def test_swiglu_applies_the_norm_of_scaled_rows():
    rows, normed = _scaled_rows((20,), 64)
    w = _normal(9, (64, 2, 96), scale=0.2)
    ours = swiglu_matmul(rows, w, interpret=True)
    want = swiglu_matmul(normed, w, interpret=True)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)


def test_qkv_kernel_applies_the_norm_of_scaled_rows():
    rows, normed = _scaled_rows((2, 12), 64)
    w = _normal(9, (64, 2, 4, 32), scale=3.0 * 64**-0.5)
    positions = 5 + jnp.broadcast_to(jnp.arange(12), (2, 12))
    cos, sin = layers.rope_tables(positions, 10000.0, 32)
    buffers = (_normal(10, (2, 48, 2, 32)), _normal(11, (2, 48, 2, 32)))
    bounds = jnp.array([5, 5, 17])
    ops = rope_write.HeadOps(True, 1e-5, 2.0)
    scales = (_normal(12, (32,), scale=0.1) + 1, _normal(13, (32,), scale=0.1) + 1)
    run = rope_write.project_rope_and_write
    ours = run(rows, w, cos, sin, buffers, bounds, scales, ops, interpret=True)
    want = run(normed, w, cos, sin, buffers, bounds, scales, ops, interpret=True)
    for name, o, ref in zip(("q", "keys", "values"), ours, want, strict=True):
        np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-5, err_msg=name)


def test_scaled_rows_need_the_kernels():
    """ScaledRows reach only kernels that apply the norm; anything else is a loud error."""
    rows = ScaledRows(jnp.zeros((1, 4, 32)), jnp.zeros((1, 1, 4)), EPS)
    mlp = layers.GatedMLP(48, jnp.float32)  # XLA's gate/up path
    params = mlp.init(jax.random.key(0), jnp.zeros((1, 4, 32)))
    with pytest.raises(ValueError, match="GatedMLP: ScaledRows need the gate/up product"):
        mlp.apply(params, rows)


FUSED = {"matmul_impl": "pallas", "norm_impl": "fused", "rope_impl": "pallas"}
XLA = {"matmul_impl": "xla", "norm_impl": "xla", "rope_impl": "xla", "mlp_impl": "xla"}
GEN = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
PROMPTS = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]


@pytest.fixture(scope="module")
def heads_of_32(dense_model):
    """The dense layout with heads of 32 (random weights), and its generation on XLA's
    path: the reference of both residual forms."""
    from djax.model import Model
    from djax.models import init_params

    config = dataclasses.replace(dense_model.config, n_heads=2, n_kv_heads=1, head_dim=32)
    model = Model(config, init_params(config, jnp.float32, seed=5), None, jnp.float32)
    return model, djax.generate(model.with_options(**XLA), PROMPTS, GEN)


@pytest.mark.parametrize("form", ["fused", "tiled"])
def test_generation_with_fused_norms(heads_of_32, monkeypatch, form):
    """Heads of 32 let the q/k/v product run in the RoPE kernel, so both norms of every
    block layer move into the next product (the first layer's norm and the final norm stay
    whole); the tokens match XLA's path, and the residual add ran where `form` puts it
    (the unsplit product's epilogue, or the tiled kernel after the split-K product) after
    both products of the blocks."""
    from djax import engine
    from djax.kernels import residual_norm, split_k

    model, ref = heads_of_32
    config = model.config
    products = []
    if form == "fused":
        fused = residual_product.residual_product

        def spy(x, w, *args, **kwargs):
            products.append((x.shape, w.shape))
            return fused(x, w, *args, **kwargs)

        monkeypatch.setattr(residual_product, "residual_product", spy)
    else:
        partials, tiled = split_k.matmul_partials, residual_norm.add_scaled
        last = []

        def product_spy(x, w, *args, **kwargs):
            last[:] = [(x.shape, w.shape)]
            return partials(x, w, *args, **kwargs)

        def spy(residual, y, *args, **kwargs):
            products.extend(last)  # the product whose partials this add finishes
            return tiled(residual, y, *args, **kwargs)

        monkeypatch.setattr(split_k, "matmul_partials", product_spy)
        monkeypatch.setattr(residual_norm, "add_scaled", spy)
    monkeypatch.setattr(kernel_choice, "MIN_FUSED_PROGRAMS", 1)  # a speed rule; this has 3 heads
    monkeypatch.setattr(engine, "_EXECUTABLES", {})  # programs traced before the spy
    jax.clear_caches()
    try:
        options = {**FUSED, "norm_impl": form, "mlp_impl": "pallas"}
        ours = djax.generate(model.with_options(**options), PROMPTS, GEN)
        block = (2, 8)
        out_k, hidden = config.n_heads * config.head_dim, config.mlp_hidden
        assert ((*block, out_k), (out_k, config.d_model)) in products
        assert ((*block, hidden), (hidden, config.d_model)) in products
        np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
        assert (ours.stats.forwards, ours.stats.refreshes) == (
            ref.stats.forwards,
            ref.stats.refreshes,
        )
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("form", ["fused", "tiled"])
def test_generation_fused_without_the_qkv_kernel(assert_same_generation, form):
    """The tiny model's 6 heads are below `MIN_FUSED_PROGRAMS`: only the feed-forward norm
    fuses (into the gate/up kernel), the attention norm stays a kernel of its own."""
    assert_same_generation({**FUSED, "norm_impl": form, "mlp_impl": "pallas"}, XLA, "dual")


def test_moe_generation_with_fused_norm_option(moe_model):
    """LLaDA-MoE's MoE layers keep their norms; its dense layer fuses where it can."""
    ours = djax.generate(moe_model.with_options(**FUSED, mlp_impl="pallas"), PROMPTS, GEN)
    ref = djax.generate(moe_model.with_options(**XLA), PROMPTS, GEN)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernels_on_gpu():
    """On a GPU: the Triton-compiled kernels at LLaDA-8B's block shapes (bf16): the output
    and down products with their residual add (32 and a ragged 20 rows; in the unsplit
    product, or the split-K product and the tiled add), then the gate/up and q/k/v kernels
    applying the norm, against the same kernels on XLA's normed rows."""
    from djax.kernels.split_k import matmul_partials

    bf16 = jnp.bfloat16
    for m, k, form in itertools.product((32, 20), (4096, 12288), ("fused", "tiled")):
        x, w = _normal(0, (1, m, k), bf16), _normal(1, (k, 4096), bf16, k**-0.5)
        residual, scale = _normal(2, (1, m, 4096), bf16), _normal(3, (4096,), bf16, 0.1) + 1
        if form == "fused":
            h, rows = residual_product.residual_product(x, w, residual, scale, EPS)
        else:
            h, rows = add_scaled(residual, matmul_partials(x, w), scale, EPS)
        want = residual.astype(jnp.float32) + jnp.einsum(
            "btk,kn->btn", x.astype(jnp.float32), w.astype(jnp.float32)
        )
        err = jnp.linalg.norm(h.astype(jnp.float32) - want) / jnp.linalg.norm(want)
        assert err <= 1e-2, (m, k, float(err))
        normed = layers.rms_norm(h, scale, EPS)
        gate_up = _normal(4, (4096, 2, 12288), bf16, 4096**-0.5)
        ours = swiglu_matmul(rows.reshape(m, 4096), gate_up).astype(jnp.float32)
        ref = swiglu_matmul(normed.reshape(m, 4096), gate_up).astype(jnp.float32)
        assert jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref) <= 2e-2, (m, k)
    qkv = _normal(5, (4096, 32, 3, 128), bf16, 4096**-0.5)
    positions = 128 + jnp.arange(32)[None]
    cos, sin = layers.rope_tables(positions, 10000.0, 128)
    buffers = (jnp.zeros((1, 384, 32, 128), bf16),) * 2
    bounds = jnp.array([128, 128, 160])
    run = rope_write.project_rope_and_write
    x, w = _normal(0, (1, 32, 4096), bf16), _normal(1, (4096, 4096), bf16, 4096**-0.5)
    residual, scale = _normal(2, (1, 32, 4096), bf16), _normal(3, (4096,), bf16, 0.1) + 1
    h, rows = residual_product.residual_product(x, w, residual, scale, EPS)
    ours = run(rows, qkv, cos, sin, buffers, bounds)
    want = run(layers.rms_norm(h, scale, EPS), qkv, cos, sin, buffers, bounds)
    for name, o, r in zip(("q", "keys", "values"), ours, want, strict=True):
        o, r = o.astype(jnp.float32), r.astype(jnp.float32)
        assert jnp.linalg.norm(o - r) / jnp.linalg.norm(r) <= 2e-2, name
