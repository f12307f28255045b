"""The Mosaic GPU split-K, SwiGLU and residual products (`split_k_mosaic`, `swiglu_mosaic`,
`residual_product_mosaic`) against fp32 products and XLA's twins, run by Mosaic GPU's
interpreter on the CPU and compiled on a GPU; their errors, their lowering for a Hopper GPU
on any host, and a SwiGLU MLP layer taking them; on a GPU also the compiled kernels at
LLaDA-8B's block shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.kernels import residual_product_mosaic, split_k_mosaic, swiglu_mosaic, tma_ring
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


def swiglu_reference(x, w):
    """`silu(x @ gate) * (x @ up)` in fp32."""
    h = jnp.einsum("tm,mcf->tcf", x.astype(jnp.float32), w.astype(jnp.float32))
    return jax.nn.silu(h[:, 0]) * h[:, 1]


def residual_xla(x, w, residual, scale, block_n, eps=EPS):
    """XLA's twin of the residual product: the fp32 product rounded to the residual's dtype,
    `h = residual + y` in fp32 rounded, and `ScaledRows`: `h * scale` rounded and each
    `block_n`-column tile's sums of squares of h as stored."""
    y = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    h = (residual.astype(jnp.float32) + y.astype(residual.dtype)).astype(residual.dtype)
    hf = h.astype(jnp.float32)
    scaled = (hf * scale.astype(jnp.float32)).astype(h.dtype)
    *lead, n = h.shape
    squares = jnp.sum((hf * hf).reshape(*lead, n // block_n, block_n), axis=-1)
    return h, ScaledRows(scaled, jnp.moveaxis(squares, -1, 0), eps)


def _rel_error(ours, ref):
    ours, ref = ours.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize(
    "shape, tiles",
    [
        ((1, 32), None),  # a block's rows, `tiles_for`: one row tile read past x's end
        ((2, 35), Tiles(block_n=64, block_k=64, splits=2, stages=2)),  # 70 rows: 2 row tiles,
        # the second ragged, its rows padded to 72 for TMA
        ((1, 32), Tiles(block_n=64, block_k=64, splits=1, stages=2)),  # 4 steps through 2
        # slots: each slot refilled as the ring goes round
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
    "m, k, tiles",
    [
        (32, 128, None),
        (20, 128, Tiles(block_n=64, block_k=64, splits=1, stages=2)),  # 20: padded to 24
        (32, 256, Tiles(block_n=64, block_k=64, splits=1, stages=2)),  # 4 steps, 2 slots
    ],
)
def test_swiglu_matches_einsum_and_activation(m, k, tiles):
    x, w = _swiglu_problem(m, k, 128, seed=1)
    ours = swiglu_mosaic.swiglu_matmul(x, w, tiles=tiles)
    assert ours.shape == (m, 128) and ours.dtype == BF16
    assert _rel_error(ours, swiglu_reference(x, w)) < 1e-2  # bf16 output
    # against the fp32 result rounded as the kernel rounds it
    np.testing.assert_allclose(
        ours.astype(jnp.float32), swiglu_reference(x, w).astype(BF16).astype(jnp.float32),
        rtol=1e-2, atol=1e-2,
    )  # fmt: skip


def test_tiles_for_llada_8b():
    """q/k/v unsplit in 96 CTAs of 128 columns; output and down 64 x 2 slices; the SwiGLU
    product 96 CTAs of 128 gate and 128 up columns; every ring within shared memory (the
    SwiGLU one with a tiled add's 128 tiles of sums of squares beside it)."""
    assert split_k_mosaic.tiles_for(32, 4096, 12288) == Tiles(128, 64, 1, 4)
    assert split_k_mosaic.tiles_for(32, 4096, 4096) == Tiles(64, 128, 2, 4)
    assert split_k_mosaic.tiles_for(32, 12288, 4096) == Tiles(64, 128, 2, 4)
    assert split_k_mosaic.tiles_for(32, 128, 64) == Tiles(64, 128, 1, 4)  # too short to split
    assert swiglu_mosaic.tiles_for(32, 4096, 12288) == Tiles(128, 64, 1, 3)
    for k, n in ((4096, 12288), (4096, 4096), (12288, 4096)):
        split_k_mosaic.tiles_for(32, k, n).check(k, n, weights=1, out_bytes=4)
    gate_up = swiglu_mosaic.tiles_for(32, 4096, 12288)
    gate_up.check(4096, 12288, weights=2, out_bytes=2, extra=128 * 64 * 4)  # + 128 squares
    with pytest.raises(ValueError, match="245760 bytes of shared memory"):
        Tiles(128, 64, 1, 4).check(4096, 12288, weights=2, out_bytes=2, extra=256 * 64 * 4)


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
    with pytest.raises(ValueError, match="a multiple of 64 dividing n = 64"):
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
    residual = lambda x, w, r, s: residual_product_mosaic.residual_product(  # noqa: E731
        x, w, r, s, EPS, interpret=False
    )
    assert "mosaic_gpu" in lowered(residual, (1, 20, 4096), (4096, 4096), (1, 20, 4096), (4096,))


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
    """bf16 rows h as an output product leaves them (`ScaledRows` of 32-column tiles, by XLA's
    twin), and XLA's norm of h."""
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (m, d), BF16)
    w = (jax.random.normal(keys[1], (d, d)) * d**-0.5).astype(BF16)
    residual = jax.random.normal(keys[2], (m, d), BF16)
    scale = (1 + 0.1 * jax.random.normal(keys[3], (d,))).astype(BF16)
    h, rows = residual_xla(x, w, residual, scale, block_n=32)
    return rows, layers.rms_norm(h, scale, EPS)


def test_swiglu_applies_the_norm_of_scaled_rows():
    """Given `ScaledRows` the kernel scales its rows by 1 / rms after the product: as on
    XLA's normed rows, and as the fp32 product of those rows."""
    rows, normed = _scaled_rows(20, 128)
    _, w = _swiglu_problem(20, 128, 64, seed=6)
    ours = swiglu_mosaic.swiglu_matmul(rows, w)
    assert _rel_error(ours, swiglu_mosaic.swiglu_matmul(normed, w)) < 2e-2
    assert _rel_error(ours, swiglu_reference(normed, w)) < 2e-2
    with pytest.raises(ValueError, match=r"squares \(4, 19\), rows \(20, 128\)"):
        bad = ScaledRows(rows.scaled, rows.squares[:, :19], EPS)
        swiglu_mosaic.swiglu_matmul(bad, w)


def _residual_problem(lead, k, n, seed=7):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (*lead, k), BF16)
    w = (jax.random.normal(keys[1], (k, n)) * k**-0.5).astype(BF16)
    residual = jax.random.normal(keys[2], (*lead, n), BF16)
    scale = (1 + 0.1 * jax.random.normal(keys[3], (n,))).astype(BF16)
    return x, w, residual, scale


@pytest.mark.parametrize(
    "lead, n, tiles",
    [
        ((1, 32), 128, None),  # a block's rows, `tiles_for`: 32-column tiles
        ((2, 10), 128, Tiles(block_n=64, block_k=64, splits=1, stages=2)),  # 20 rows, padded
    ],
)
def test_residual_product_matches_xla(lead, n, tiles):
    """h, `h * scale` and the per-tile sums of squares as XLA's twin computes them (at the
    same column tiles), and h as residual + the fp32 product."""
    x, w, residual, scale = _residual_problem(lead, 128, n)
    h, rows = residual_product_mosaic.residual_product(x, w, residual, scale, EPS, tiles=tiles)
    block_n = (tiles or residual_product_mosaic.tiles_for(20, 128, n)).block_n
    want_h, want = residual_xla(x, w, residual, scale, block_n)
    assert h.shape == residual.shape and h.dtype == BF16
    assert rows.squares.shape == (n // block_n, *lead)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    np.testing.assert_allclose(f32(h), f32(want_h), atol=1e-2)
    np.testing.assert_allclose(f32(rows.scaled), f32(want.scaled), atol=1e-2)
    np.testing.assert_allclose(rows.squares, want.squares, rtol=1e-4)
    y = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w.astype(jnp.float32))
    assert _rel_error(h, residual.astype(jnp.float32) + y) < 1e-2


def test_residual_product_errors():
    x, w, residual, scale = _residual_problem((8,), 128, 64)
    run = residual_product_mosaic.residual_product
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., 128\], residual \[\.\.\., 64\]"):
        run(x, w, residual[:, :32], scale, EPS)
    with pytest.raises(ValueError, match="k and n multiples of 64, n at most 8192"):
        run(x, w[:, :32], residual[:, :32], scale[:32], EPS)
    with pytest.raises(ValueError, match="residual float32, scale bfloat16; expected x's"):
        run(x, w, residual.astype(jnp.float32), scale, EPS)
    with pytest.raises(ValueError, match=r"takes splits in \(1, 2, 4\)"):
        run(x, w, residual, scale, EPS, tiles=Tiles(block_n=32, splits=3))


@pytest.mark.parametrize("form", ["tiled", "fused"])
def test_norm_moved_into_the_mosaic_products(form):
    """A norm moved into the output product runs it in Mosaic GPU (`tiled`: the split-K
    product, then the tiled add; `fused`: the residual product) as XLA's add and norm do,
    and the Mosaic GPU gate/up kernel applies it."""
    norm = layers.RMSNorm(EPS, BF16)
    x, w, residual, _ = _residual_problem((1, 20), 128, 128)
    params = norm.init(jax.random.key(0), residual)
    h, rows = norm.apply(params, layers.Product(x, w), residual, impl=form)
    want_h, want = norm.apply(params, x @ w, residual, impl="xla")
    assert _rel_error(h, want_h) < 1e-2
    assert _rel_error(rows.scaled.astype(jnp.float32) * rows.inv_rms(), want) < 1e-2
    _, gate_up = _swiglu_problem(20, 128, 64, seed=9)
    ours = swiglu_mosaic.swiglu_matmul(rows.reshape(20, 128), gate_up)
    assert _rel_error(ours, swiglu_reference(want.reshape(20, 128), gate_up)) < 2e-2


@needs_gpu
def test_compiled_kernels_on_gpu():
    """On a Hopper GPU: the compiled Mosaic GPU kernels at LLaDA-8B's block products and MLP
    (bf16, 32 rows and a ragged 20) against fp32; the SwiGLU kernel also on `ScaledRows` of
    LLaDA-8B's width, and the residual product at the output and down products' shapes
    against XLA's twin."""
    for m in (32, 20):
        for k, n in ((4096, 12288), (4096, 4096), (12288, 4096)):
            x, w = _matmul_problem((m,), k, n, seed=3)
            ref = x.astype(jnp.float32) @ w.astype(jnp.float32)
            ours = split_k_mosaic.matmul_partials(x, w).total()
            assert _rel_error(ours, ref) <= 1e-2, (m, k, n)
        x, w = _swiglu_problem(m, 4096, 12288, seed=4)
        assert _rel_error(swiglu_mosaic.swiglu_matmul(x, w), swiglu_reference(x, w)) <= 1e-2, m
        rows, normed = _scaled_rows(m, 4096)  # 128 tiles of sums of squares
        ours = swiglu_mosaic.swiglu_matmul(rows, w)
        assert _rel_error(ours, swiglu_mosaic.swiglu_matmul(normed, w)) <= 2e-2, m
        assert _rel_error(ours, swiglu_reference(normed, w)) <= 2e-2, m
        for k in (4096, 12288):
            x, w, residual, scale = _residual_problem((1, m), k, 4096, seed=10)
            h, rows = residual_product_mosaic.residual_product(x, w, residual, scale, EPS)
            block_n = residual_product_mosaic.tiles_for(m, k, 4096).block_n
            want_h, want = residual_xla(x, w, residual, scale, block_n)
            assert _rel_error(h, want_h) <= 1e-2, (m, k)
            assert _rel_error(rows.scaled, want.scaled) <= 1e-2, (m, k)
            assert _rel_error(rows.squares, want.squares) <= 1e-2, (m, k)


def test_takes_16_bit_operands_only():
    assert tma_ring.takes_dtype(BF16) and tma_ring.takes_dtype(jnp.float16)
    assert not tma_ring.takes_dtype(jnp.float32)
    assert tma_ring.fits(4096, 12288) and not tma_ring.fits(4096, 1000)
