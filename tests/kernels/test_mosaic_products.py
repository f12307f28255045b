"""The Mosaic GPU ports of the split-K and SwiGLU kernels (`split_k_mosaic`, `swiglu_mosaic`)
against fp32 products (the references of test_split_k and test_swiglu), run by Mosaic GPU's
interpreter on the CPU and compiled on a GPU; their errors, their lowering for a Hopper GPU
on any host, and a SwiGLU MLP layer taking them; on a GPU also the compiled kernels at
LLaDA-8B's block shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.kernels import residual_product, split_k, split_k_mosaic, swiglu, swiglu_mosaic, tma_ring
from djax.kernels.handoff import Partials, ScaledRows
from djax.kernels.tma_ring import Tiles
from djax.models import layers
from djax.models.kernel_choice import Kernels

BF16 = jnp.bfloat16
EPS = 1e-5
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _matmul_problem(shape, k, n, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (*shape, k), BF16)
    w = (jax.random.normal(keys[1], (k, n)) * k**-0.5).astype(BF16)
    return x, w


def _swiglu_problem(m, k, n, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (m, k), BF16)
    w = (jax.random.normal(keys[1], (k, 2, n)) * k**-0.5).astype(BF16)
    return x, w


def _swiglu_reference(x, w):
    h = jnp.einsum("tm,mcf->tcf", x.astype(jnp.float32), w.astype(jnp.float32))
    return jax.nn.silu(h[:, 0]) * h[:, 1]


def _rel_error(ours, ref):
    ours, ref = ours.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize(
    "shape, tiles",
    [
        ((1, 32), None),  # a block's rows, `tiles_for`: one row tile read past x's end
        ((2, 35), Tiles(block_n=64, block_k=64, splits=2, stages=2)),  # 70 rows: 2 row tiles,
        # the second ragged, its rows padded to 72 for TMA
    ],
)
def test_partials_match_fp32_product(shape, tiles):
    k, n = 256, 128
    x, w = _matmul_problem(shape, k, n)
    y = split_k_mosaic.matmul_partials(x, w, tiles=tiles)
    splits = (tiles or split_k_mosaic.tiles_for(int(np.prod(shape)), k, n)).splits
    assert y.parts.shape == (splits, *shape, n) and y.parts.dtype == jnp.float32
    assert y.shape == (*shape, n) and y.dtype == x.dtype
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    assert _rel_error(y.parts.sum(0), xf @ wf) < 1e-5
    if splits == 2:  # each slice is its half of the contraction
        assert _rel_error(y.parts[0], xf[..., : k // 2] @ wf[: k // 2]) < 1e-5


@pytest.mark.parametrize(
    "m, tiles",
    [(32, None), (20, Tiles(block_n=64, block_k=64, splits=1, stages=2))],  # 20: padded to 24
)
def test_swiglu_matches_einsum_and_activation(m, tiles):
    x, w = _swiglu_problem(m, 128, 128, seed=1)
    ours = swiglu_mosaic.swiglu_matmul(x, w, tiles=tiles)
    assert ours.shape == (m, 128) and ours.dtype == BF16
    assert _rel_error(ours, _swiglu_reference(x, w)) < 1e-2  # bf16 output
    # against the fp32 result rounded as the kernel rounds it
    np.testing.assert_allclose(
        ours.astype(jnp.float32), _swiglu_reference(x, w).astype(BF16).astype(jnp.float32),
        rtol=1e-2, atol=1e-2,
    )  # fmt: skip


def test_tiles_for_llada_8b():
    """q/k/v unsplit in 96 CTAs of 128 columns; output and down 64 x 2 slices; the SwiGLU
    product 96 CTAs of 128 gate and 128 up columns; every ring within shared memory (the
    SwiGLU one with a tiled add's 128 tiles of sums of squares beside it)."""
    assert split_k_mosaic.tiles_for(32, 4096, 12288) == Tiles(128, 64, 1, 6)
    assert split_k_mosaic.tiles_for(32, 4096, 4096) == Tiles(64, 128, 2, 4)
    assert split_k_mosaic.tiles_for(32, 12288, 4096) == Tiles(64, 128, 2, 4)
    assert split_k_mosaic.tiles_for(32, 128, 64) == Tiles(64, 128, 1, 4)  # too short to split
    assert swiglu_mosaic.tiles_for(32, 4096, 12288) == Tiles(128, 64, 1, 4)
    for k, n in ((4096, 12288), (4096, 4096), (12288, 4096)):
        split_k_mosaic.tiles_for(32, k, n).check(k, n, weights=1, out_bytes=4)
    gate_up = swiglu_mosaic.tiles_for(32, 4096, 12288)
    gate_up.check(4096, 12288, weights=2, out_bytes=2, extra=128 * 64 * 4)  # + 128 squares
    with pytest.raises(ValueError, match="245760 bytes of shared memory"):
        gate_up.check(4096, 12288, weights=2, out_bytes=2, extra=256 * 64 * 4)


def test_shape_dtype_and_tile_errors():
    x, w = _matmul_problem((8,), 128, 64)
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., 64\] and k, n multiples of 64"):
        split_k_mosaic.matmul_partials(x, w.T)
    with pytest.raises(ValueError, match="multiples of 64"):
        split_k_mosaic.matmul_partials(x, jnp.zeros((128, 48), BF16))
    with pytest.raises(ValueError, match="x float32, w bfloat16; expected both bfloat16"):
        split_k_mosaic.matmul_partials(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match="splits x block_k dividing k = 128"):
        split_k_mosaic.matmul_partials(x, w, tiles=Tiles(block_n=64, block_k=64, splits=4))
    with pytest.raises(ValueError, match="bytes of shared memory; at most 229376"):
        split_k_mosaic.matmul_partials(x, w, tiles=Tiles(block_n=64, block_k=128, stages=9))
    x, w = _swiglu_problem(8, 128, 64)
    with pytest.raises(ValueError, match=r"expected w \[128, 2, n\]"):
        swiglu_mosaic.swiglu_matmul(x, w.reshape(128, 1, 128))
    with pytest.raises(ValueError, match="takes splits=1"):
        swiglu_mosaic.swiglu_matmul(x, w, tiles=Tiles(block_n=64, splits=2))
    with pytest.raises(ValueError, match="block_n dividing n = 64"):
        swiglu_mosaic.swiglu_matmul(x, w, tiles=Tiles(block_n=128))


def test_lowers_for_hopper():
    """Both kernels at LLaDA-8B's block shapes lower to Mosaic GPU's custom call for CUDA
    (layouts, swizzles, TMA slices and the rows read past x's end are checked here, on any
    host; only the compile to PTX needs the GPU)."""

    def lowered(fn, *shapes):
        args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    partials = lambda x, w: split_k_mosaic.matmul_partials(x, w, interpret=False).parts  # noqa: E731
    for k, n in ((4096, 4096), (12288, 4096)):
        assert "mosaic_gpu" in lowered(partials, (32, k), (k, n))
    gate_up = lambda x, w: swiglu_mosaic.swiglu_matmul(x, w, interpret=False)  # noqa: E731
    assert "mosaic_gpu" in lowered(gate_up, (20, 4096), (4096, 2, 12288))
    args = [jax.ShapeDtypeStruct(s, t) for s, t in (((20, 4096), BF16), ((128, 20), jnp.float32))]
    normed_gate_up = lambda x, squares, w: gate_up(ScaledRows(x, squares, EPS), w)  # noqa: E731
    text = jax.jit(normed_gate_up).trace(*args, jax.ShapeDtypeStruct((4096, 2, 12288), BF16))
    assert "mosaic_gpu" in text.lower(lowering_platforms=("cuda",)).as_text()


def test_mlp_layer_takes_the_mosaic_kernels():
    """A SwiGLU MLP layer with `mlp` and `down` on the Mosaic GPU kernels (the down product's
    partials summed after it) against its XLA path, in bf16."""
    mlp = layers.GatedMLP(hidden=128, dtype=BF16)
    x = jax.random.normal(jax.random.key(2), (1, 16, 64), BF16)
    params = mlp.init(jax.random.key(3), x)
    ours = mlp.apply(params, x, Kernels(mlp="mosaic", down="mosaic"))
    assert isinstance(ours, Partials)
    ref = mlp.apply(params, x, Kernels())
    assert _rel_error(ours.total(), ref) < 1e-2


def _scaled_rows(m, d, seed=5):
    """bf16 rows h as the Triton output product leaves them (`ScaledRows`), and XLA's norm
    of h."""
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (m, d), BF16)
    w = (jax.random.normal(keys[1], (d, d)) * d**-0.5).astype(BF16)
    residual = jax.random.normal(keys[2], (m, d), BF16)
    scale = (1 + 0.1 * jax.random.normal(keys[3], (d,))).astype(BF16)
    h, rows = residual_product.residual_product(x, w, residual, scale, EPS)
    return rows, layers.rms_norm(h, scale, EPS)


def test_swiglu_applies_the_norm_of_scaled_rows():
    """Given `ScaledRows` the kernel scales its rows by 1 / rms after the product: as on
    XLA's normed rows, and as the Triton kernel does."""
    rows, normed = _scaled_rows(20, 128)
    _, w = _swiglu_problem(20, 128, 64, seed=6)
    ours = swiglu_mosaic.swiglu_matmul(rows, w)
    assert _rel_error(ours, swiglu_mosaic.swiglu_matmul(normed, w)) < 2e-2
    assert _rel_error(ours, swiglu.swiglu_matmul(rows, w)) < 1e-2
    with pytest.raises(ValueError, match=r"squares \(4, 19\), rows \(20, 128\)"):
        bad = ScaledRows(rows.scaled, rows.squares[:, :19], EPS)
        swiglu_mosaic.swiglu_matmul(bad, w)


def test_tiled_norm_takes_the_mosaic_product():
    """A norm moved after the output product (`tiled`) runs the Mosaic GPU split-K product,
    then the tiled add, as XLA's add and norm do."""
    norm = layers.RMSNorm(EPS, BF16)
    x, w = _matmul_problem((1, 20), 128, 128, seed=7)
    residual = jax.random.normal(jax.random.key(8), (1, 20, 128), BF16)
    params = norm.init(jax.random.key(0), residual)
    h, rows = norm.apply(params, layers.Product(x, w, "mosaic"), residual, impl="tiled")
    want_h, want = norm.apply(params, x @ w, residual, impl="xla")
    assert _rel_error(h, want_h) < 1e-2
    assert _rel_error(rows.scaled.astype(jnp.float32) * rows.inv_rms(), want) < 1e-2
    with pytest.raises(ValueError, match="a Product of 'mosaic' takes impl 'tiled'"):
        norm.apply(params, layers.Product(x, w, "mosaic"), residual, impl="fused")


@needs_gpu
def test_compiled_kernels_on_gpu():
    """On a Hopper GPU: the compiled Mosaic GPU kernels at LLaDA-8B's block products and MLP
    (bf16, 32 rows and a ragged 20) against fp32 and against the Triton kernels' results; the
    SwiGLU kernel also on `ScaledRows` of LLaDA-8B's width."""
    for m in (32, 20):
        for k, n in ((4096, 12288), (4096, 4096), (12288, 4096)):
            x, w = _matmul_problem((m,), k, n, seed=3)
            ref = x.astype(jnp.float32) @ w.astype(jnp.float32)
            ours = split_k_mosaic.matmul_partials(x, w).total()
            assert _rel_error(ours, ref) <= 1e-2, (m, k, n)
            assert _rel_error(ours, split_k.matmul_partials(x, w).total()) <= 1e-2, (m, k, n)
        x, w = _swiglu_problem(m, 4096, 12288, seed=4)
        assert _rel_error(swiglu_mosaic.swiglu_matmul(x, w), _swiglu_reference(x, w)) <= 1e-2, m
        rows, normed = _scaled_rows(m, 4096)  # 128 tiles of sums of squares
        ours = swiglu_mosaic.swiglu_matmul(rows, w)
        assert _rel_error(ours, swiglu_mosaic.swiglu_matmul(normed, w)) <= 2e-2, m
        assert _rel_error(ours, swiglu.swiglu_matmul(rows, w)) <= 1e-2, m


def test_takes_16_bit_operands_only():
    assert tma_ring.takes_dtype(BF16) and tma_ring.takes_dtype(jnp.float16)
    assert not tma_ring.takes_dtype(jnp.float32)
    assert tma_ring.fits(4096, 12288) and not tma_ring.fits(4096, 1000)
