"""The residual norms' Mosaic GPU kernels (`residual_norm_mosaic`) and the residual
product's sweepable tilings (`residual_product_mosaic`), run by Mosaic GPU's
interpreter on the CPU against numpy references, their lowering for a Hopper GPU at
LLaDA-8B's widths on any host, and on a GPU the compiled kernels."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_mosaic_products import residual_xla

from bench.kernels.mosaic import sweep_tiles
from djax.kernels import (
    fp8_matmul_mosaic,
    residual_norm_mosaic,
    residual_product_mosaic,
    split_k_mosaic,
)
from djax.kernels.handoff import Partials, QuantizedRows
from djax.kernels.tma_ring import Tiles

BF16 = jnp.bfloat16
EPS = 1e-5
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _bf16(a: np.ndarray) -> np.ndarray:
    """numpy fp32 values rounded to bf16 and back."""
    return _f32(jnp.asarray(a, jnp.float32).astype(BF16))


def _round(a) -> np.ndarray:
    """float64 values rounded to bf16 (by way of fp32, as ml_dtypes casts) and back."""
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _f64(a) -> np.ndarray:
    return _f32(a).astype(np.float64)


# The contract (`handoff`, `residual_norm_mosaic`): y's slices summed in fp32 and rounded to h's
# dtype, then `h = x + y` in fp32 rounded to h's dtype, `h * scale` rounded, and the sums of
# squares over h as stored (rounded). The references below follow it in float64, rounding
# to bf16 at those points. The kernels' fp32 sums of slices run in other orders than
# float64's, which moves y's rounding by one bf16 step of y where its exact value lies
# within an fp32 step of a bf16 rounding boundary (about once in 2**15 values), and h by
# that step and its own rounding's. Hence the tolerances: h within a bf16 step of y plus
# one of h everywhere, and at most this share of h's values off at all (a rounding the
# compiler dropped puts about a third off):
MAX_STEPS_OFF = 1e-3
# h**2 of a bf16 h is exact in fp32 (8-bit significands), so a tile's sum of 32 squares in
# fp32 is within 31 * 2**-24 (< 2e-6) relative of the float64 sum over the same h; the
# sum over h before its rounding is about 1e-3 off.
SQUARES_RTOL = 4e-6


def _step(size) -> np.ndarray:
    """The bf16 step (unit in the last place) at magnitudes `size`."""
    tiny = float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_normal)
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(size), tiny))) - 7)


def _assert_steps(got, want, step, steps=1, what="h"):
    """bf16 `got` within `steps` of `step` (bf16 steps, [shape of want]) of the float64
    reference `want` everywhere, and with `steps` 1 at most MAX_STEPS_OFF of its values
    off at all."""
    off = np.abs(_f64(got) - np.asarray(want, np.float64))
    assert (off <= steps * step).all(), (what, float((off / step).max()))
    if steps == 1:
        assert (off > 0).mean() <= MAX_STEPS_OFF, (what, float((off > 0).mean()))


def _assert_squares(squares, h, columns):
    """`squares` [tiles, m] the per-`columns` tile sums of the squares of bf16 `h` [m, d]
    as stored, within SQUARES_RTOL."""
    hf = _f64(h)
    m, d = hf.shape
    want = (hf * hf).reshape(m, d // columns, columns).sum(-1).T
    np.testing.assert_allclose(_f64(squares), want, rtol=SQUARES_RTOL, atol=0)


def _contract_h(x, parts) -> tuple[np.ndarray, np.ndarray]:
    """float64: y, y's slices [splits, m, d] summed and rounded, and h, x + y rounded."""
    y = _round(_f64(parts).sum(0))
    return _round(_f64(x) + y), y


def _assert_h(h, x, parts):
    """h against the contract's, within a bf16 step of y plus one of h."""
    want, y = _contract_h(x, parts)
    _assert_steps(h, want, _step(y) + _step(want))


def _assert_add_scaled(h, rows, x, parts, scale, columns):
    """The outputs of an `add_scaled` kernel (h and `ScaledRows` with `columns`-wide tiles)
    against the float64 contract: h within a bf16 step; `h * scale` the rounding of the
    kernel's own h times the scale (a product of two bf16 values is exact in fp32, so
    there is one rounding and no order: exact); the sums of squares over that h."""
    _assert_h(h, x, parts)
    np.testing.assert_array_equal(_f64(rows.scaled), _round(_f64(h) * _f64(scale)))
    _assert_squares(rows.squares, h, columns)


def _assert_add_rms_norm(h, normed, x, parts, scale):
    """The outputs of an `add_rms_norm` kernel against the float64 contract: h within a
    bf16 step; the normed rows (the kernel's h times its fp32 `1 / rms`, rounded, times
    the scale, rounded) within two bf16 steps, one per rounding."""
    _assert_h(h, x, parts)
    hf = _f64(h)
    inv_rms = 1 / np.sqrt((hf * hf).mean(-1, keepdims=True) + EPS)
    want = _round(_round(hf * inv_rms) * _f64(scale))
    _assert_steps(normed, want, _step(want), steps=2, what="normed")


def _norm_problem(m, d, splits, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, d), BF16)
    parts = jax.random.normal(keys[1], (splits, m, d), jnp.float32)
    scale = (1 + 0.1 * jax.random.normal(keys[2], (d,))).astype(BF16)
    return x, parts, scale


@pytest.mark.parametrize("m, splits", [(32, 2), (20, 1)])  # 20 rows: padded to 24 for TMA
def test_add_scaled_matches_numpy(m, splits):
    """h, `h * scale` and the 32-column tiles' sums of squares from split-K partials (fp32)
    or from a plain y in x's dtype, against the float64 contract."""
    x, parts, scale = _norm_problem(m, 96, splits)
    y = Partials(parts, BF16) if splits > 1 else parts[0].astype(BF16)
    h, rows = residual_norm_mosaic.add_scaled(x, y, scale, EPS)
    assert h.shape == rows.shape == (m, 96) and h.dtype == rows.dtype == BF16
    assert rows.squares.shape == (3, m) and rows.eps == EPS
    parts = parts if splits > 1 else _bf16(_f32(parts))
    _assert_add_scaled(h, rows, x, parts, scale, residual_norm_mosaic.COLUMNS)


def test_add_scaled_errors():
    x, parts, scale = _norm_problem(8, 64, 2)
    run = residual_norm_mosaic.add_scaled
    with pytest.raises(ValueError, match=r"y \(8, 32\).*expected y shaped and typed like x"):
        run(x, x[:, :32], scale, EPS)
    with pytest.raises(ValueError, match="multiple of 32, at most 8192"):
        run(x[:, :48], x[:, :48], scale[:48], EPS)
    with pytest.raises(ValueError, match="x float32, scale float32; expected both bfloat16"):
        run(x.astype(jnp.float32), Partials(parts, jnp.float32), scale.astype(jnp.float32), EPS)


def _lowers(fn, *shapes) -> bool:
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return "mosaic_gpu" in text


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_add_scaled_lowers_for_hopper(splits):
    """At LLaDA-8B's width, a block's 32 rows and a ragged 20, after split-K products of
    1, 2 and 4 slices: Mosaic GPU's lowering for CUDA (TMA sizes, swizzles, layouts)."""
    for m in (32, 20):
        fn = lambda x, p, s: residual_norm_mosaic.add_scaled(  # noqa: E731
            x, Partials(p, BF16), s, EPS, interpret=False
        )
        shapes = (((1, m, 4096), BF16), ((splits, 1, m, 4096), jnp.float32), ((4096,), BF16))
        assert _lowers(fn, *shapes), (m, splits)


@needs_gpu
def test_compiled_residual_product_tilings_on_gpu():
    """On a Hopper GPU: the residual product at every (block_n, block_k, splits) the sweep
    may pick, the cluster splits included, at LLaDA-8B's output and down products (32 rows;
    the splits also at a ragged 20) against XLA's product, add and squares: h and
    `h * scale` within bf16 rounding of a differently ordered fp32 sum, the tiles' sums of
    squares adding up to the same."""
    for m in (32, 20):
        for k in (4096, 12288):
            x, w, residual, scale = _residual_problem(m, k, 4096, seed=10)
            want_h, want = residual_xla(x, w, residual, scale, block_n=4096)
            tilings = _sweep_tilings("out_residual", k, 4096)
            for tiles in tilings if m == 32 else [t for t in tilings if t.splits > 1]:
                h, rows = residual_product_mosaic.residual_product(
                    x, w, residual, scale, EPS, tiles=tiles
                )
                np.testing.assert_allclose(
                    _f32(h), _f32(want_h), rtol=2e-2, atol=2e-2, err_msg=str(tiles)
                )
                np.testing.assert_allclose(
                    _f32(rows.scaled), _f32(want.scaled), rtol=2e-2, atol=2e-2, err_msg=str(tiles)
                )
                np.testing.assert_allclose(
                    rows.squares.sum(0), want.squares.sum(0), rtol=1e-2, err_msg=str(tiles)
                )


@needs_gpu
def test_compiled_add_scaled_on_gpu():
    """On a Hopper GPU: the compiled kernel at LLaDA-8B's width against the float64
    contract (as `test_add_scaled_matches_numpy`)."""
    for m, splits in ((32, 2), (20, 4), (32, 1)):
        x, parts, scale = _norm_problem(m, 4096, splits, seed=3)
        y = Partials(parts, BF16)
        h, rows = residual_norm_mosaic.add_scaled(x, y, scale, EPS)
        _assert_add_scaled(h, rows, x, parts, scale, residual_norm_mosaic.COLUMNS)


def _residual_problem(m, k, n, seed=7):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (m, k), BF16)
    w = (jax.random.normal(keys[1], (k, n)) * k**-0.5).astype(BF16)
    residual = jax.random.normal(keys[2], (m, n), BF16)
    scale = (1 + 0.1 * jax.random.normal(keys[3], (n,))).astype(BF16)
    return x, w, residual, scale


def test_residual_product_at_128_columns_matches_numpy():
    """The widest tiling the sweep may pick (128 columns per CTA, 20 rows padded to 24): h
    (the product rounded first, then the add), `h * scale` and the 128-column tiles' sums
    of squares as numpy computes them from the fp32 product."""
    x, w, residual, scale = _residual_problem(20, 128, 256)
    tiles = Tiles(block_n=128, block_k=64, splits=1, stages=2)
    h, rows = residual_product_mosaic.residual_product(x, w, residual, scale, EPS, tiles=tiles)
    want_h, _ = _contract_h(residual, (_f64(x) @ _f64(w))[None])
    m, d = want_h.shape
    want_squares = (want_h * want_h).reshape(m, d // tiles.block_n, tiles.block_n).sum(-1).T
    assert rows.squares.shape == (2, 20)
    # a bf16 step apart at most: the fp32 sums run in another order
    np.testing.assert_allclose(_f32(h), want_h, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(
        _f32(rows.scaled), _round(want_h * _f64(scale)), rtol=1e-2, atol=1e-2
    )
    np.testing.assert_allclose(rows.squares, want_squares, rtol=1e-3)


def test_cluster_split_has_no_interpreter():
    """A residual product split over a cluster's CTAs (which read each other's shared
    memory) is refused by the interpreter with a clear error, not run wrongly."""
    x, w, residual, scale = _residual_problem(8, 256, 128)
    with pytest.raises(ValueError, match="splits > 1 .* has no Mosaic GPU interpreter"):
        tiles = Tiles(block_n=64, block_k=64, splits=2, stages=2)
        residual_product_mosaic.residual_product(
            x, w, residual, scale, EPS, tiles=tiles, interpret=True
        )


def _sweep_tilings(name, k, n, fields=("block_n", "block_k", "splits")):
    """The tilings `bench.kernels.mosaic --sweep` runs for product `name`, one per distinct
    value of `fields` at its deepest ring (and widest step): the stages change only the
    ring's depth, which `Tiles.check` bounds."""
    deepest = {}
    for tiles in sorted(sweep_tiles(name, k, n), key=lambda t: (t.stages, t.block_k)):
        deepest[tuple(getattr(tiles, field) for field in fields)] = tiles
    return list(deepest.values())


@pytest.mark.parametrize("k", [4096, 12288])
def test_swept_tilings_lower_for_hopper(k):
    """Every tiling the sweep may pick for the residual product (unsplit, and split over a
    cluster's CTAs: its cluster barriers and reads of a peer's shared memory) and the
    split-K product at LLaDA-8B's output (4096 -> 4096) product, and at the down product
    (12288 -> 4096, where only the steps' count differs) one per column tile and split;
    32 rows: Mosaic GPU's lowering for CUDA."""
    residual = (((32, k), BF16), ((k, 4096), BF16), ((32, 4096), BF16), ((4096,), BF16))
    fields = ("block_n", "block_k", "splits") if k == 4096 else ("block_n", "splits")
    for tiles in _sweep_tilings("out_residual", k, 4096, fields):
        fn = lambda x, w, r, s, tiles=tiles: residual_product_mosaic.residual_product(  # noqa: E731
            x, w, r, s, EPS, tiles=tiles, interpret=False
        )
        assert _lowers(fn, *residual), tiles
    for tiles in _sweep_tilings("out", k, 4096, fields):
        fn = lambda x, w, tiles=tiles: (
            split_k_mosaic.matmul_partials(  # noqa: E731
                x, w, tiles=tiles, interpret=False
            ).parts
        )
        assert _lowers(fn, *residual[:2]), tiles


@pytest.mark.parametrize("splits", [2, 1])
def test_add_rms_norm_matches_numpy(splits):
    """The per-row add and norm in Mosaic GPU (3 rows of 512) from fp32 partials or a plain
    y against the float64 contract."""
    x, parts, scale = _norm_problem(3, 512, splits, seed=4)
    y = Partials(parts, BF16) if splits > 1 else parts[0].astype(BF16)
    h, normed = residual_norm_mosaic.add_rms_norm(x, y, scale, EPS)
    assert h.shape == normed.shape == (3, 512) and h.dtype == normed.dtype == BF16
    parts = parts if splits > 1 else _bf16(_f32(parts))
    _assert_add_rms_norm(h, normed, x, parts, scale)


def test_add_rms_norm_errors():
    x, parts, scale = _norm_problem(2, 512, 2)
    run = residual_norm_mosaic.add_rms_norm
    with pytest.raises(ValueError, match=r"scale \(256,\); expected y shaped"):
        run(x, Partials(parts, BF16), scale[:256], EPS)
    with pytest.raises(ValueError, match="rows of 256; expected a multiple of 512"):
        run(x[:, :256], x[:, :256], scale[:256], EPS)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_add_rms_norm_lowers_for_hopper(splits):
    fn = lambda x, p, s: residual_norm_mosaic.add_rms_norm(  # noqa: E731
        x, Partials(p, BF16), s, EPS, interpret=False
    )
    shapes = (((1, 32, 4096), BF16), ((splits, 1, 32, 4096), jnp.float32), ((4096,), BF16))
    assert _lowers(fn, *shapes)


@needs_gpu
def test_compiled_add_rms_norm_on_gpu():
    """On a Hopper GPU: the compiled per-row kernel at LLaDA-8B's width (a block's 32 rows
    and a refresh's 384) against the float64 contract."""
    for m, splits in ((32, 2), (384, 1), (32, 4)):
        x, parts, scale = _norm_problem(m, 4096, splits, seed=5)
        h, normed = residual_norm_mosaic.add_rms_norm(x, Partials(parts, BF16), scale, EPS)
        _assert_add_rms_norm(h, normed, x, parts, scale)


# The compiled kernel divides the values by their scale with `div.full.f32` (Mosaic GPU's
# choice, within 2 ulp), so against IEEE division a value at an e4m3 rounding midpoint may
# round the other way (about 4e-6 of them).
MAX_E4M3_OFF = 1e-3


def _assert_quantized(rows, normed, exact):
    """`QuantizedRows` against the quantisation of the normed rows: bit for bit against
    XLA's `quantize_rows(normed)` where `exact` (Mosaic GPU's interpreter, whose arithmetic
    is XLA's); else against numpy's (IEEE arithmetic, ml_dtypes' rounding to nearest even),
    the scales equal and at most MAX_E4M3_OFF of the values off, each by one e4m3 step
    (the next code of the same sign: e4m3 codes are sign and magnitude)."""
    assert isinstance(rows, QuantizedRows) and rows.dtype == normed.dtype
    assert rows.values.dtype == fp8_matmul_mosaic.FP8 and rows.scale.dtype == jnp.float32
    assert rows.shape == normed.shape and rows.scale.shape == normed.shape[:-1]
    if exact:
        values, scale = fp8_matmul_mosaic.quantize_rows(normed)
    else:
        wf = _f32(normed)
        peak = np.abs(wf).max(-1)
        scale = np.where(peak > 0, peak * np.float32(1 / 448), np.float32(1))
        values = np.clip(wf / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    got, want = (np.asarray(v).view(np.uint8).astype(np.int32) for v in (rows.values, values))
    np.testing.assert_array_equal(rows.scale, scale)
    if exact:
        np.testing.assert_array_equal(got, want)
        return
    off = got != want
    assert off.mean() <= MAX_E4M3_OFF, float(off.mean())
    assert (np.abs(got[off] - want[off]) == 1).all()


@pytest.mark.parametrize("splits", [2, 1])
def test_add_rms_norm_into_fp8_is_quantize_rows(splits):
    """`into_fp8`: the per-row kernel's e4m3 values and fp32 scales are `quantize_rows` of
    the normed rows it returns without `into_fp8`, bit for bit (in the interpreter; on a
    GPU within its division, `_assert_quantized`), from fp32 partials or a
    plain y (3 rows of 512: one all zero, scale 1 and values 0; one whose outlier sets its
    scale, the outlier at 448 and the rest near zero), and h is the same."""
    x, parts, scale = _norm_problem(3, 512, splits, seed=8)
    x, parts = x.at[0].set(0), parts.at[:, 0].set(0)
    parts = parts.at[0, 1, 100].set(-3e4)
    y = Partials(parts, BF16) if splits > 1 else parts[0].astype(BF16)
    h, rows = residual_norm_mosaic.add_rms_norm(x, y, scale, EPS, into_fp8=True)
    want_h, normed = residual_norm_mosaic.add_rms_norm(x, y, scale, EPS)
    np.testing.assert_array_equal(_f32(h), _f32(want_h))
    _assert_quantized(rows, normed, exact=jax.default_backend() != "gpu")
    values = _f32(rows.values)
    assert float(rows.scale[0]) == 1 and not values[0].any()
    assert values[1, 100] == -448 and np.abs(values[1]).max() == 448
    assert np.median(np.abs(values[1])) < 0.1 * np.median(np.abs(values[2]))
    assert rows.rows is None
    # keep_rows: the same values and scales, and the normed rows beside them
    kept_h, kept = residual_norm_mosaic.add_rms_norm(
        x, y, scale, EPS, into_fp8=True, keep_rows=True
    )
    np.testing.assert_array_equal(_f32(kept_h), _f32(want_h))
    np.testing.assert_array_equal(_f32(kept.rows), _f32(normed))
    np.testing.assert_array_equal(kept.scale, rows.scale)
    np.testing.assert_array_equal(_f32(kept.values), values)
    assert kept.reshape(1, 3, 512).rows.shape == (1, 3, 512)
    with pytest.raises(ValueError, match="keep_rows keeps rows beside their e4m3 values"):
        residual_norm_mosaic.add_rms_norm(x, y, scale, EPS, keep_rows=True)


@pytest.mark.parametrize("d", [4096, 2048])  # LLaDA-8B's and LLaDA-MoE's widths
def test_add_rms_norm_into_fp8_lowers_for_hopper(d):
    """The quantising kernel at a block's 32 rows after a split-K product of 2 slices:
    Mosaic GPU's lowering for CUDA (the e4m3 conversion and block, the scale's store)."""
    shapes = (((1, 32, d), BF16), ((2, 1, 32, d), jnp.float32), ((d,), BF16))
    for keep_rows in (False, True):  # the rows kept too: a MoE layer's norm
        fn = lambda x, p, s, k=keep_rows: residual_norm_mosaic.add_rms_norm(  # noqa: E731
            x, Partials(p, BF16), s, EPS, into_fp8=True, keep_rows=k, interpret=False
        )
        assert _lowers(fn, *shapes)


@needs_gpu
def test_compiled_add_rms_norm_into_fp8_on_gpu():
    """On a Hopper GPU: the compiled quantising kernel at LLaDA-8B's and LLaDA-MoE's widths
    (32 rows) against numpy's quantisation of the compiled kernel's normed rows, within
    the kernel's division (`_assert_quantized`); the rows it keeps are those normed rows."""
    for d, splits in ((4096, 2), (2048, 1), (4096, 4)):
        x, parts, scale = _norm_problem(32, d, splits, seed=9)
        y = Partials(parts, BF16)
        h, rows = residual_norm_mosaic.add_rms_norm(x, y, scale, EPS, into_fp8=True, keep_rows=True)
        want_h, normed = residual_norm_mosaic.add_rms_norm(x, y, scale, EPS)
        np.testing.assert_array_equal(_f32(h), _f32(want_h))
        np.testing.assert_array_equal(_f32(rows.rows), _f32(normed))
        _assert_quantized(rows, normed, exact=False)


def test_rms_norm_layer_takes_the_mosaic_kernel():
    """`layers.RMSNorm` with `impl="mosaic"` (`Kernels.norm` under Mosaic GPU products) on a
    split-K product's partials, as its XLA path."""
    from djax.models import layers

    norm = layers.RMSNorm(EPS, BF16)
    x, parts, _ = _norm_problem(4, 512, 2, seed=6)
    params = norm.init(jax.random.key(0), x)
    h, normed = norm.apply(params, Partials(parts, BF16), x, impl="mosaic")
    want_h, want = norm.apply(params, Partials(parts, BF16), x, impl="xla")
    np.testing.assert_array_equal(_f32(h), _f32(want_h))
    np.testing.assert_allclose(_f32(normed), _f32(want), rtol=1e-2, atol=1e-2)
