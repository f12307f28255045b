"""The fp8 x fp8 Mosaic GPU product (`fp8_matmul_mosaic`) against a float64 numpy product of
the dequantised operands, run by Mosaic GPU's interpreter on the CPU and compiled on a GPU;
its row quantisation, its errors, its lowering for a Hopper GPU at LLaDA-8B's block
products on any host, and on a GPU the compiled kernel at those products; the same for its
SwiGLU form against float64 `silu(gate) * up`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.kernels import fp8_matmul_mosaic
from djax.kernels.tma_ring import Tiles
from djax.models.fp8 import E4M3_MAX, FP8, quantize

BF16 = jnp.bfloat16
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
# Relative (Frobenius) error against the float64 product of the same e4m3 operands: the
# interpreter multiplies in fp32 (~1e-7); Hopper's fp8 WGMMA adds its products into the
# accumulator with fewer mantissa bits than fp32 (an error growing with k), so the compiled
# kernel is held to 1e-2.
TOLERANCE = 1e-5 if jax.default_backend() != "gpu" else 1e-2
# LLaDA-8B's block products (k, n): q/k/v, attention output, down, gate/up side by side
LLADA_8B = ((4096, 12288), (4096, 4096), (12288, 4096), (4096, 24576))


def _problem(shape, k, n, seed=0):
    """x [*shape, k] bf16, and a weight [k, n] as the fp8 kernel takes it: w_t [n, k] e4m3
    with w_scale [n] fp32."""
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (*shape, k), BF16)
    w = jax.random.normal(keys[1], (n, k)) * k**-0.5
    w_t, w_scale = quantize(w, (1,))
    return x, w_t, w_scale


def _reference(xq, x_scale, w_t, w_scale) -> np.ndarray:
    """(xq * x_scale) @ (w_t * w_scale)^T in float64."""
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    return (f64(xq) * f64(x_scale)[..., None]) @ (f64(w_t) * f64(w_scale)[:, None]).T


def _rel_error(ours, ref) -> float:
    ours = np.asarray(ours, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_quantize_rows_scales_each_row_to_e4m3():
    x = jax.random.normal(jax.random.key(3), (2, 5, 256), BF16).at[1, 2].set(0)
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    assert xq.shape == x.shape and xq.dtype == FP8 and x_scale.shape == (2, 5)
    values, scale = quantize(x, (2,))  # the `scaled` product's rule, exactly
    np.testing.assert_array_equal(xq.astype(jnp.float32), values.astype(jnp.float32))
    np.testing.assert_array_equal(x_scale, scale)
    peak = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    np.testing.assert_allclose(x_scale[0], peak[0] / E4M3_MAX, rtol=1e-6)
    assert x_scale[1, 2] == 1 and not jnp.any(xq[1, 2].astype(jnp.float32))  # a zero row
    # each row's largest value is 448; every value within e4m3's half unit (2^-4 relative)
    assert jnp.all(jnp.max(jnp.abs(xq[0].astype(jnp.float32)), axis=-1) == E4M3_MAX)
    back = xq.astype(jnp.float32) * x_scale[..., None]
    xf = x.astype(jnp.float32)
    assert jnp.all(jnp.abs(back - xf) <= 2**-4 * jnp.abs(xf) + x_scale[..., None] * 2**-9)


@pytest.mark.parametrize(
    "shape, tiles",
    [
        ((32,), None),  # a block's rows, `tiles_for`: one row tile read past x's end
        ((2, 35), Tiles(block_n=64, block_k=128, splits=2, stages=2)),  # 70 rows: 2 row
        # tiles, the second ragged, its rows padded to 72 for TMA; each slice scaled
    ],
)
def test_partials_match_float64_product(shape, tiles):
    k, n = 256, 128
    x, w_t, w_scale = _problem(shape, k, n)
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    if tiles is None:  # `matmul`: the rows quantised by it
        y = fp8_matmul_mosaic.matmul(x, w_t, w_scale)
    else:
        y = fp8_matmul_mosaic.matmul_partials(xq, x_scale, w_t, w_scale, tiles=tiles)
    splits = (tiles or fp8_matmul_mosaic.tiles_for(int(np.prod(shape)), k, n)).splits
    assert y.parts.shape == (splits, *shape, n) and y.parts.dtype == jnp.float32
    assert y.shape == (*shape, n) and y.dtype == BF16
    ref = _reference(xq, x_scale, w_t, w_scale)
    assert _rel_error(y.parts.sum(0), ref) < TOLERANCE
    if splits == 2:  # each slice is its half of the contraction, scaled
        half = _reference(xq[..., : k // 2], x_scale, w_t[:, : k // 2], w_scale)
        assert _rel_error(y.parts[0], half) < TOLERANCE


def _swiglu_reference(xq, x_scale, w_t, w_scale) -> np.ndarray:
    """silu(gate) * up in float64 of the dequantised operands, w_t [2, n, k]."""
    gate, up = (_reference(xq, x_scale, w_t[side], w_scale[side]) for side in range(2))
    return gate / (1 + np.exp(-gate)) * up


def test_swiglu_matches_float64_activation():
    m, k, n = 20, 256, 128  # 20 rows: padded to 24 for TMA
    x, w_t, w_scale = _problem((m,), k, 2 * n, seed=1)
    w_t, w_scale = w_t.reshape(2, n, k), w_scale.reshape(2, n)
    tiles = Tiles(block_n=64, block_k=128, splits=1, stages=2)  # 2 column tiles, 2 steps
    ours = fp8_matmul_mosaic.swiglu(x, w_t, w_scale, tiles)
    assert ours.shape == (m, n) and ours.dtype == BF16
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    ref = _swiglu_reference(xq, x_scale, w_t, w_scale)
    assert _rel_error(ours.astype(jnp.float32), ref) < 1e-2  # bf16 output
    # against the float64 result rounded to bf16 as the kernel rounds it
    rounded = np.asarray(jnp.asarray(ref, jnp.float32).astype(BF16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(ours.astype(jnp.float32)), rounded, atol=2e-2)


def _slices_reference(aq, a_scale) -> np.ndarray:
    """Rows quantised per 128-column slice (values [m, k], scales [k / 128, m]) in float64."""
    m, k = aq.shape
    f64 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
    slices = f64(aq).reshape(m, k // fp8_matmul_mosaic.SLICE, -1) * f64(a_scale).T[..., None]
    return slices.reshape(m, k)


def _activation_and_down(m, k, n, seed):
    """Rows and a gate/up weight [2, n, k] as `_problem` makes them, and a down weight
    (w_t [256, n] e4m3, w_scale [256])."""
    x, w_t, w_scale = _problem((m,), k, 2 * n, seed=seed)
    _, down_t, down_scale = _problem((1,), n, 256, seed=seed + 1)
    return x, w_t.reshape(2, n, k), w_scale.reshape(2, n), down_t, down_scale


def test_swiglu_hands_the_down_product_e4m3_slices():
    """`out_fp8`: the gate/up kernel quantises its fp32 activation per row and 128-column
    tile (`quantize_slices`' rule: on the CPU the same values and scales bit for bit), and
    the product takes such rows, each contraction slice scaled by its own rows' scales
    (2 splits: each CTA reads the scales of its half)."""
    m, k, n = 70, 256, 256  # 2 row tiles; 70 rows: the scales padded to 72 inside
    x, w_t, w_scale, down_t, down_scale = _activation_and_down(m, k, n, seed=6)
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    tiles = Tiles(block_n=128, block_k=128, splits=1, stages=2)
    act = fp8_matmul_mosaic.swiglu_matmul(xq, x_scale, w_t, w_scale, tiles, out_fp8=True)
    assert act.values.shape == (m, n) and act.values.dtype == FP8 and act.dtype == BF16
    assert act.scale.shape == (n // 128, m) and act.scale.dtype == jnp.float32
    assert act.per_slice and act.reshape(2, 35, n).scale.shape == (n // 128, m)
    fp32 = fp8_matmul_mosaic.swiglu_matmul(xq, x_scale, w_t, w_scale, tiles, jnp.float32)
    values, scale = fp8_matmul_mosaic.quantize_slices(fp32)
    if jax.default_backend() == "gpu":  # the compilers' divisions may round apart
        assert (
            _rel_error(_slices_reference(act.values, act.scale), _slices_reference(values, scale))
            < 1e-2
        )
    else:
        np.testing.assert_array_equal(act.scale, scale)
        np.testing.assert_array_equal(act.values.astype(jnp.float32), values.astype(jnp.float32))
    rows = _slices_reference(act.values, act.scale)
    ref = (
        rows
        @ (np.asarray(down_t.astype(jnp.float32), np.float64) * np.asarray(down_scale)[:, None]).T
    )
    split = Tiles(block_n=64, block_k=128, splits=2, stages=2)
    y = fp8_matmul_mosaic.matmul_partials(act.values, act.scale, down_t, down_scale, split)
    assert y.parts.shape == (2, m, 256)
    assert _rel_error(y.parts.sum(0), ref) < TOLERANCE
    wide = Tiles(block_n=64, block_k=256, splits=1, stages=1)  # two slices a step
    y_wide = fp8_matmul_mosaic.matmul_partials(act.values, act.scale, down_t, down_scale, wide)
    assert _rel_error(y_wide.parts[0], ref) < TOLERANCE
    half = (
        rows[:, 128:]
        @ (
            np.asarray(down_t[:, 128:].astype(jnp.float32), np.float64)
            * np.asarray(down_scale)[:, None]
        ).T
    )
    assert _rel_error(y.parts[1], half) < TOLERANCE


def test_tiles_for_llada_8b():
    tiles = [fp8_matmul_mosaic.tiles_for(32, k, n) for k, n in LLADA_8B]
    assert tiles == [
        Tiles(block_n=128, block_k=128, splits=1, stages=4),
        Tiles(block_n=64, block_k=256, splits=2, stages=4),
        Tiles(block_n=64, block_k=256, splits=2, stages=4),
        Tiles(block_n=128, block_k=128, splits=1, stages=4),
    ]
    for (k, n), t in zip(LLADA_8B, tiles, strict=True):
        fp8_matmul_mosaic.check_tiles(t, k, n)
    gate_up = fp8_matmul_mosaic.swiglu_tiles_for(32, 4096, 12288)
    assert gate_up == Tiles(block_n=128, block_k=128, splits=1, stages=3)
    fp8_matmul_mosaic.check_tiles(gate_up, 4096, 12288, gated=True, out_bytes=2)


def test_bad_inputs():
    k, n = 256, 128
    x, w_t, w_scale = _problem((8,), k, n)
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    run = fp8_matmul_mosaic.matmul_partials
    with pytest.raises(ValueError, match="expected both float8_e4m3fn"):
        run(x, x_scale, w_t, w_scale)
    with pytest.raises(ValueError, match="dtype int8; expected bfloat16, float16 or float32"):
        run(xq, x_scale, w_t, w_scale, dtype=jnp.int8)
    with pytest.raises(ValueError, match="expected both float32"):
        run(xq, x_scale, w_t, w_scale.astype(BF16))
    with pytest.raises(ValueError, match=r"expected xq \[..., k\] and w_t \[..., n, k\]"):
        run(xq, x_scale, w_t.T, w_scale)  # the weight as [k, n]
    with pytest.raises(ValueError, match="k a multiple of 128"):
        run(xq[:, :192], x_scale, w_t[:, :192], w_scale)
    with pytest.raises(ValueError, match=r"x_scale \(4,\); expected x_scale \(8,\) \(per row\)"):
        run(xq, x_scale[:4], w_t, w_scale)
    with pytest.raises(ValueError, match=r"expected \(8,\) and \(128,\)"):
        run(xq, x_scale, w_t, w_scale[:64])
    with pytest.raises(ValueError, match="take at most 256 a CTA"):
        wide = jnp.zeros((8, 128 * 257), FP8)
        run(wide, jnp.ones((257, 8)), jnp.zeros((64, 128 * 257), FP8), w_scale[:64])
    with pytest.raises(ValueError, match="block_k a multiple of 128"):
        run(xq, x_scale, w_t, w_scale, tiles=Tiles(block_n=64, block_k=64))
    swiglu = fp8_matmul_mosaic.swiglu_matmul
    w2, s2 = w_t.reshape(2, 64, k), w_scale.reshape(2, 64)
    with pytest.raises(ValueError, match=r"expected \[m, k\] and \[2, n, k\]"):
        swiglu(xq, x_scale, w_t, w_scale)  # a plain [n, k] weight
    with pytest.raises(ValueError, match="takes splits=1"):
        swiglu(xq, x_scale, w2, s2, tiles=Tiles(block_n=64, block_k=128, splits=2))
    with pytest.raises(ValueError, match=r"expected \(8,\) and \(2, 64\)"):
        swiglu(xq, x_scale, w2, w_scale)
    with pytest.raises(ValueError, match=r"expected x_scale \(8,\) \(per row\) or \(2, 8\)"):
        run(xq, jnp.ones((3, 8)), w_t, w_scale)  # per slice, but 3 slices of a 256-wide k
    with pytest.raises(ValueError, match="an e4m3 output takes 128-column tiles"):
        swiglu(xq, x_scale, w2, s2, tiles=Tiles(block_n=64, block_k=128), out_fp8=True)
    with pytest.raises(ValueError, match="at most 256"):
        fp8_matmul_mosaic.check_tiles(Tiles(block_n=512, block_k=128), 4096, 4096)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        fp8_matmul_mosaic.check_tiles(Tiles(block_n=128, block_k=256, stages=4), 4096, 4096)


def _lowered(k: int, n: int, m: int = 32, tiles=None) -> str:
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in (((m, k), FP8), ((m,), jnp.float32), ((n, k), FP8), ((n,), jnp.float32))
    ]

    def product(*operands):
        return fp8_matmul_mosaic.matmul_partials(*operands, tiles=tiles, interpret=False).parts

    return jax.jit(product).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowers_for_hopper():
    """At LLaDA-8B's block products and 32 rows the kernel lowers to Mosaic GPU's custom call
    for CUDA (the fp8 WGMMA's operand layouts and swizzles, TMA slices and the rows read past
    x's end are checked here, on any host; only the compile to PTX needs the GPU), also at
    32 columns a tile and in 4 slices."""
    for k, n in LLADA_8B:
        assert "mosaic_gpu" in _lowered(k, n)
    assert "mosaic_gpu" in _lowered(4096, 4096, 20, Tiles(32, 128, splits=4, stages=8))
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in (
            ((32, 4096), FP8),
            ((32,), jnp.float32),
            ((2, 12288, 4096), FP8),
            ((2, 12288), jnp.float32),
        )
    ]
    for out_fp8 in (False, True):  # bf16 out; e4m3 out with its scales
        gate_up = functools.partial(
            fp8_matmul_mosaic.swiglu_matmul, interpret=False, out_fp8=out_fp8
        )
        text = jax.jit(gate_up).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    # the down product on rows scaled per slice (96 slices; 2 splits of 48)
    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in (
            ((32, 12288), FP8),
            ((96, 32), jnp.float32),
            ((4096, 12288), FP8),
            ((4096,), jnp.float32),
        )
    ]
    down = functools.partial(fp8_matmul_mosaic.matmul_partials, interpret=False)
    text = jax.jit(lambda *a: down(*a).parts).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()


@needs_gpu
def test_compiled_kernel_on_gpu():
    """The compiled kernel at LLaDA-8B's block products (32 rows) against the float64
    product of its e4m3 operands, and its sum against XLA's dequantising product."""
    for i, (k, n) in enumerate(LLADA_8B):
        x, w_t, w_scale = _problem((32,), k, n, seed=i)
        xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
        y = fp8_matmul_mosaic.matmul_partials(xq, x_scale, w_t, w_scale)
        assert _rel_error(y.parts.sum(0), _reference(xq, x_scale, w_t, w_scale)) < TOLERANCE
        dequantised = x.astype(jnp.float32) @ (w_t.astype(jnp.float32) * w_scale[:, None]).T
        assert _rel_error(y.total(), np.asarray(dequantised, np.float64)) < 0.05
    x, w_t, w_scale = _problem((32,), 4096, 2 * 12288, seed=4)
    w_t, w_scale = w_t.reshape(2, 12288, 4096), w_scale.reshape(2, 12288)
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    ours = fp8_matmul_mosaic.swiglu_matmul(xq, x_scale, w_t, w_scale)
    ref = _swiglu_reference(xq, x_scale, w_t, w_scale)
    assert _rel_error(ours.astype(jnp.float32), ref) < 1e-2
    # the activation in e4m3 slices, then the down product (12288 -> 4096) on them
    act = fp8_matmul_mosaic.swiglu_matmul(xq, x_scale, w_t, w_scale, out_fp8=True)
    rows = _slices_reference(act.values, act.scale)
    assert _rel_error(rows, ref) < 0.05  # e4m3's rounding of the activation
    _, down_t, down_scale = _problem((1,), 12288, 4096, seed=5)
    y = fp8_matmul_mosaic.matmul_partials(act.values, act.scale, down_t, down_scale)
    down = (np.asarray(down_t.astype(jnp.float32), np.float64) * np.asarray(down_scale)[:, None]).T
    assert _rel_error(y.parts.sum(0), rows @ down) < TOLERANCE
