"""The Mosaic GPU q/k/v product with the q/k norm, clip, RoPE and K/V buffer writes in its
epilogue (`rope_write_mosaic`), run by Mosaic GPU's interpreter on the CPU, against XLA's
product and `layers.rope_and_write_xla`; its errors, its lowering for a Hopper GPU at
LLaDA-8B's and LLaDA-MoE's shapes, an attention layer taking it, and on a GPU the compiled
kernel against XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.config import DENSE, ModelConfig
from djax.kernels import fp8_matmul_mosaic, rope_write_mosaic, split_k_mosaic
from djax.kernels.handoff import Partials
from djax.kernels.rope_write_mosaic import HeadOps
from djax.kernels.tma_ring import Tiles
from djax.models import layers
from djax.models.kernel_choice import Kernels

BF16 = jnp.bfloat16
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

CASES = {
    # b, t, model, kv heads, group, head dim, rotary dim, buffer len, window, ops
    "GQA, two sequences in one row tile, window at the cache's start": (
        2, 16, 64, 1, 2, 64, 64, 48, layers.Window(0), HeadOps(),
    ),
    "q/k norm and clip, write range in the cache's middle": (
        1, 16, 64, 1, 1, 64, 64, 64, layers.Window(20, 22, 30), HeadOps(True, 1e-5, 2.0),
    ),
    "three sequences over two row tiles, window past the cache's end": (
        3, 32, 64, 1, 1, 64, 64, 48, layers.Window(40), HeadOps(),
    ),
    "whole sequence, 128-wide heads, partial rotary, q/k norm": (
        1, 8, 64, 1, 1, 128, 64, None, layers.Window(3), HeadOps(True, 1e-5),
    ),
}  # fmt: skip


def _normal(seed, shape, dtype=BF16, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(dtype)


def _problem(case):
    b, t, model, kv, group, d, rotary, s, window, ops = case
    x = _normal(0, (b, t, model))
    w = _normal(1, (model, kv, group + 2, d), scale=3.0 * model**-0.5)
    positions = window.start + jnp.broadcast_to(jnp.arange(t), (b, t))
    buffers = None if s is None else (_normal(2, (b, s, kv, d)), _normal(3, (b, s, kv, d)))
    scales = (_normal(4, (d,), scale=0.1) + 1, _normal(5, (d,), scale=0.1) + 1)
    lo = window.start if window.write_lo is None else window.write_lo
    hi = window.start + t if window.write_hi is None else window.write_hi
    cos, sin = layers.rope_tables(positions, 10000.0, rotary)
    bounds = jnp.array([window.start, lo, hi])
    return x, w, positions, buffers, scales if ops.qk_norm else None, bounds, cos, sin


def _xla(case, x, w, positions, buffers, scales):
    """XLA's product (fp32, rounded to bf16) and XLA's head ops and buffer writes."""
    *_, rotary, _, window, ops = case
    qkv = jnp.einsum("btm,mkgd->btkgd", x, w, preferred_element_type=jnp.float32)
    return layers.rope_and_write_xla(
        qkv.astype(x.dtype), positions, buffers, window, scales, ops, 10000.0, rotary
    )


# The q/k norm and clip in the cache's middle run through the same epilogue in
# `test_rope_and_write_matches_xla`.
@pytest.mark.parametrize("name", [name for name in CASES if "middle" not in name])
def test_matches_xla(name):
    """q, keys and values against XLA's; the buffer rows outside the write range are the old
    buffer's, bit for bit."""
    case = CASES[name]
    x, w, positions, buffers, scales, bounds, cos, sin = _problem(case)
    ops = case[-1]
    ours = rope_write_mosaic.project_rope_and_write(x, w, cos, sin, buffers, bounds, scales, ops)
    want = _xla(case, x, w, positions, buffers, scales)
    for label, o, ref in zip(("q", "keys", "values"), ours, want, strict=True):
        assert o.shape == ref.shape and o.dtype == ref.dtype, label
        np.testing.assert_allclose(
            o.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2, rtol=2e-2, err_msg=label
        )
    if buffers is not None:
        t, s, window = x.shape[1], buffers[0].shape[1], case[-2]
        lo, hi = int(bounds[1]), int(bounds[2])
        base = min(max(window.start, 0), s - t)
        written = [base + i for i in range(t) if lo <= window.start + i < hi]
        untouched = ~np.isin(np.arange(s), written)
        assert untouched.sum() > 0 and len(written) > 0
        np.testing.assert_array_equal(ours[1][:, untouched], buffers[0][:, untouched])
        np.testing.assert_array_equal(ours[2][:, untouched], buffers[1][:, untouched])


@pytest.mark.parametrize("block_k, stages", [(128, 2), (128, 3), (64, 6)])
def test_other_rings_match_xla(block_k, stages):
    """The fused kernel at rings other than `tiles_for`'s (`bench.kernels.mosaic --sweep`
    times them): 128-value contraction steps, and more stages than steps, give XLA's q,
    keys and values."""
    case = (2, 16, 256, 2, 1, 64, 64, 48, layers.Window(8), HeadOps(True, 1e-5))
    x, w, positions, buffers, scales, bounds, cos, sin = _problem(case)
    tiles = Tiles(block_n=64, block_k=block_k, splits=1, stages=stages)
    ours = rope_write_mosaic.project_rope_and_write(
        x, w, cos, sin, buffers, bounds, scales, case[-1], tiles=tiles
    )
    want = _xla(case, x, w, positions, buffers, scales)
    for label, o, ref in zip(("q", "keys", "values"), ours, want, strict=True):
        np.testing.assert_allclose(
            o.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2, rtol=2e-2, err_msg=label
        )


@pytest.mark.parametrize(
    "name, splits",
    [
        ("q/k norm and clip, write range in the cache's middle", 3),
        ("GQA, two sequences in one row tile, window at the cache's start", None),
    ],
)
def test_rope_and_write_matches_xla(name, splits):
    """The epilogue alone, from 3 split-K partial products or a plain product, against XLA's
    head ops on the summed product; rows outside the write range keep the buffer's."""
    b, t, model, kv, group, d, rotary, s, window, ops = CASES[name]
    x, w, positions, buffers, scales, bounds, cos, sin = _problem(CASES[name])
    qkv = _normal(9, (b, t, kv, group + 2, d), scale=3.0)
    product = qkv
    if splits:
        product = Partials(_normal(10, (splits, *qkv.shape), jnp.float32, 2.0), BF16)
        qkv = product.total()
    ours = rope_write_mosaic.rope_and_write(product, cos, sin, buffers, bounds, scales, ops)
    want = layers.rope_and_write_xla(qkv, positions, buffers, window, scales, ops, 1e4, rotary)
    for label, o, ref in zip(("q", "keys", "values"), ours, want, strict=True):
        assert o.shape == ref.shape and o.dtype == ref.dtype, label
        np.testing.assert_allclose(
            o.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2, rtol=2e-2, err_msg=label
        )
    lo, hi = int(bounds[1]), int(bounds[2])
    written = [
        min(max(window.start, 0), s - t) + i for i in range(t) if lo <= window.start + i < hi
    ]
    untouched = ~np.isin(np.arange(s), written)
    np.testing.assert_array_equal(ours[1][:, untouched], buffers[0][:, untouched])


def _turns(d, rotary, t=8):
    """A product whose features say where they are: feature j of row r holds (j + 1) times
    (-1)^r (exact in bf16), with cos/sin tables that give each (row, pair) either no turn or
    a quarter turn by the parity of row + pair; and the exact results: a quarter-turned
    pair (x1, x2) becomes (-x2, x1), features past the rotary ones are kept."""
    half = rotary // 2
    row_sign = np.where(np.arange(t) % 2, -1.0, 1.0)[:, None]
    head = row_sign * (np.arange(d) + 1.0)  # [t, d]
    turn = (np.arange(t)[:, None] + np.arange(half)) % 2 == 1  # [t, half]
    x1, x2 = head[:, :half], head[:, half:rotary]
    want = head.copy()
    want[:, :half] = np.where(turn, -x2, x1)
    want[:, half:rotary] = np.where(turn, x1, x2)
    qkv = jnp.asarray(np.broadcast_to(head[None, :, None, None], (1, t, 1, 3, d)), BF16)
    cos = jnp.asarray(np.where(turn, 0.0, 1.0)[None], jnp.float32)
    sin = jnp.asarray(np.where(turn, 1.0, 0.0)[None], jnp.float32)
    return qkv, cos, sin, head, want


def _check_turns(d, rotary, interpret):
    """From the product and from the kernel's own q/k/v product (x picking rows of w):
    queries and keys are turned pair by pair exactly (feature j with j + rotary / 2 of
    the same row, by that row and pair's cos/sin), values kept: a swap of the halves, of
    features within a half, or of cos/sin columns shows as exact mismatches."""
    qkv, cos, sin, head, want = _turns(d, rotary)
    t = qkv.shape[1]
    bounds = jnp.array([0, 0, t])
    x = jnp.eye(t, 64, dtype=BF16)[None]  # row r picks weight row r: the product is qkv
    w = jnp.zeros((64, 1, 3, d), BF16).at[:t].set(qkv[0])
    args = (cos, sin, None, bounds)
    for q, keys, values in (
        rope_write_mosaic.rope_and_write(qkv, *args, interpret=interpret),
        rope_write_mosaic.project_rope_and_write(x, w, *args, interpret=interpret),
    ):
        np.testing.assert_array_equal(np.asarray(q[0, :, 0, 0], np.float32), want)
        np.testing.assert_array_equal(np.asarray(keys[0, :, 0], np.float32), want)
        np.testing.assert_array_equal(np.asarray(values[0, :, 0], np.float32), head)


@pytest.mark.parametrize("d, rotary", [(128, 128), (128, 64)])
def test_turns_pair_each_feature_with_its_half(d, rotary):
    _check_turns(d, rotary, interpret=None)


def test_errors():
    x, w = jnp.zeros((1, 8, 64), BF16), jnp.zeros((64, 2, 3, 64), BF16)
    cos = sin = jnp.zeros((1, 8, 32))
    bounds = jnp.array([0, 0, 8])
    run = rope_write_mosaic.project_rope_and_write
    with pytest.raises(ValueError, match=r"x \(1, 8, 64\) with w \(48, 2, 3, 64\)"):
        run(x, w[:48], cos, sin, None, bounds)
    with pytest.raises(ValueError, match="x float32, w bfloat16; expected both bfloat16"):
        run(x.astype(jnp.float32), w, cos, sin, None, bounds)
    with pytest.raises(ValueError, match="12 window rows, rotary dim 64 of 64; expected"):
        table = jnp.zeros((1, 12, 32))
        run(jnp.zeros((1, 12, 64), BF16), w, table, table, None, bounds)
    with pytest.raises(ValueError, match="rotary dim 12 of 64"):  # halves of 6
        run(x, w, cos[..., :6], sin[..., :6], None, bounds)
    with pytest.raises(ValueError, match="buffers of 4 rows for a 8-row window"):
        short = jnp.zeros((1, 4, 2, 64), BF16)
        run(x, w, cos, sin, (short, short), bounds)
    with pytest.raises(ValueError, match="qk_norm=True with scales None"):
        run(x, w, cos, sin, None, bounds, ops=HeadOps(qk_norm=True))
    with pytest.raises(ValueError, match="model width 96, not a multiple of 64"):
        run(jnp.zeros((1, 8, 96), BF16), w[:1].repeat(96, 0), cos, sin, None, bounds)
    qkv = jnp.zeros((1, 8, 2, 3, 64), BF16)
    with pytest.raises(ValueError, match="5 slices of float32 for bfloat16 rows"):
        parts = Partials(jnp.zeros((5, *qkv.shape)), BF16)
        rope_write_mosaic.rope_and_write(parts, cos, sin, None, bounds)
    with pytest.raises(ValueError, match="1 slices of float32 for float32 rows"):
        rope_write_mosaic.rope_and_write(qkv.astype(jnp.float32), cos, sin, None, bounds)


FP8_CASES = {
    # as CASES: the model width a multiple of 128, as 8-bit products take it
    "fp8: GQA, two sequences in one row tile, window at the cache's start": (
        2, 16, 128, 1, 2, 64, 64, 48, layers.Window(0), HeadOps(),
    ),
    "fp8: whole sequence, 128-wide heads, partial rotary, q/k norm": (
        1, 8, 256, 1, 1, 128, 64, None, layers.Window(3), HeadOps(True, 1e-5),
    ),
}  # fmt: skip


def _fp8_problem(case):
    """`_problem`'s window with its rows and weight quantised as the fp8 products take
    them: rows by `quantize_rows`, the weight per output column, K-major."""
    x, w, *rest = _problem(case)
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    w_values, w_scale = fp8_matmul_mosaic.quantize(w, (0,))  # [model, kv, g + 2, d]
    return xq, x_scale, jnp.moveaxis(w_values, 0, -1), w_scale, *rest


def _fp8_xla(case, xq, x_scale, w_t, w_scale, positions, buffers, scales):
    """XLA's fp8 product (fp32 of the e4m3 values, both scales, rounded to bf16) and XLA's
    head ops and buffer writes."""
    *_, rotary, _, window, ops = case
    f32 = jnp.float32
    qkv = jnp.einsum("btm,kgdm->btkgd", xq.astype(f32), w_t.astype(f32))
    qkv = (qkv * x_scale[:, :, None, None, None] * w_scale).astype(BF16)
    return layers.rope_and_write_xla(qkv, positions, buffers, window, scales, ops, 1e4, rotary)


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_product_matches_xla(name):
    """The fp8 q/k/v product inside the kernel (e4m3 rows and K-major weight, their scales
    on the fp32 product) against the same product in XLA (fp32, scaled, rounded to bf16)
    and XLA's head ops; the buffer rows outside the write range are the old buffer's."""
    case = FP8_CASES[name]
    xq, x_scale, w_t, w_scale, positions, buffers, scales, bounds, cos, sin = _fp8_problem(case)
    ops, window, f32 = case[-1], case[-2], jnp.float32
    ours = rope_write_mosaic.project_rope_and_write_fp8(
        xq, x_scale, w_t, w_scale, cos, sin, buffers, bounds, scales, ops
    )
    want = _fp8_xla(case, xq, x_scale, w_t, w_scale, positions, buffers, scales)
    for label, o, ref in zip(("q", "keys", "values"), ours, want, strict=True):
        assert o.shape == ref.shape and o.dtype == ref.dtype, label
        np.testing.assert_allclose(o.astype(f32), ref.astype(f32), atol=2e-2, rtol=2e-2)
    if buffers is not None:
        t, s = xq.shape[1], buffers[0].shape[1]
        lo, hi = int(bounds[1]), int(bounds[2])
        base = min(max(window.start, 0), s - t)
        untouched = ~np.isin(np.arange(s), [base + i for i in range(t) if lo <= i + base < hi])
        np.testing.assert_array_equal(ours[1][:, untouched], buffers[0][:, untouched])


def test_fp8_kernel_lowers_for_hopper():
    """At LLaDA-8B's block (32 kv heads of 128 features, 4096 wide, 32 rows into a
    384-position cache) and LLaDA-MoE's (q/k norms, the clip, 2048 wide, two sequences),
    the fp8 kernel lowers to Mosaic GPU's custom call for CUDA, the buffers aliased."""
    shape = jax.ShapeDtypeStruct
    fp8 = fp8_matmul_mosaic.FP8
    for b, model, kv, ops in ((1, 4096, 32, HeadOps()), (2, 2048, 16, HeadOps(True, 1e-6, 8.0))):
        args = [
            shape((b, 32, model), fp8),
            shape((b, 32), jnp.float32),
            shape((kv, 3, 128, model), fp8),
            shape((kv, 3, 128), jnp.float32),
            shape((b, 32, 64), jnp.float32),
            shape((b, 32, 64), jnp.float32),
            (shape((b, 384, kv, 128), BF16),) * 2,
            shape((3,), jnp.int32),
            (shape((128,), BF16),) * 2 if ops.qk_norm else None,
        ]

        def run(*args, ops=ops):
            return rope_write_mosaic.project_rope_and_write_fp8(*args, ops=ops, interpret=False)

        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "output_operand_alias" in text


def test_fp8_errors():
    """16-bit rows, a model width that is not a multiple of 128, or an 8-bit output dtype
    are refused by name."""
    case = FP8_CASES["fp8: GQA, two sequences in one row tile, window at the cache's start"]
    xq, x_scale, w_t, w_scale, _, buffers, scales, bounds, cos, sin = _fp8_problem(case)
    run = rope_write_mosaic.project_rope_and_write_fp8
    with pytest.raises(ValueError, match="project_rope_and_write_fp8: xq bfloat16"):
        run(xq.astype(BF16), x_scale, w_t, w_scale, cos, sin, buffers, bounds)
    with pytest.raises(ValueError, match="a multiple of 128"):
        run(xq[..., :64], x_scale, w_t[..., :64], w_scale, cos, sin, buffers, bounds)
    with pytest.raises(ValueError, match="dtype float32"):
        run(xq, x_scale, w_t, w_scale, cos, sin, buffers, bounds, dtype=jnp.float32)


def test_lowers_for_hopper():
    """At LLaDA-8B's block (32 kv heads of 128 features, 4096 wide, 32 rows into a
    384-position cache), LLaDA-MoE's (q/k norms and the clip, 2048 wide, two sequences),
    and a whole-sequence window with partial rotary, both kernels (with the product, and
    the epilogue alone on 2 split-K partials) lower to Mosaic GPU's custom call for CUDA,
    the buffers aliased (TMA slices, and that the epilogue's strided operands share one
    layout, are checked here, on any host; not which elements a layout puts where)."""
    shape = jax.ShapeDtypeStruct
    for b, model, kv, rotary, s, ops in (
        (1, 4096, 32, 128, 384, HeadOps()),
        (2, 2048, 16, 128, 384, HeadOps(True, 1e-6, 8.0)),
        (1, 2048, 16, 64, None, HeadOps(True, 1e-6)),
    ):
        args = [
            shape((b, 32, model), BF16),
            shape((model, kv, 3, 128), BF16),
            shape((b, 32, rotary // 2), jnp.float32),
            shape((b, 32, rotary // 2), jnp.float32),
            None if s is None else (shape((b, s, kv, 128), BF16),) * 2,
            shape((3,), jnp.int32),
            (shape((128,), BF16),) * 2 if ops.qk_norm else None,
        ]

        def run(*args, ops=ops):
            return rope_write_mosaic.project_rope_and_write(*args, ops=ops, interpret=False)

        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        assert ("output_operand_alias" in text) == (s is not None)

        def epilogue(parts, *args, ops=ops):  # the epilogue alone, on split-K partials
            qkv = Partials(parts, BF16)
            return rope_write_mosaic.rope_and_write(qkv, *args, ops=ops, interpret=False)

        parts = shape((2, b, 32, kv, 3, 128), jnp.float32)
        traced = jax.jit(epilogue).trace(parts, *args[2:])
        assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("qkv", ["rope", "xla"])
def test_attention_layer_takes_the_kernel(qkv):
    """An attention layer with `rope="mosaic"` (its q/k/v product inside the kernel, or the
    kernel on XLA's product) writes the window's K/V and attends as its XLA path does, in
    bf16."""
    config = ModelConfig(DENSE, 64, 64, 1, 2, 1, 64, 128, 1e4, 1e-5, 64, 1, 2, 3)
    attention = layers.Attention(config, BF16)
    x = _normal(6, (1, 16, 64))
    positions = 8 + jnp.arange(16)[None]
    kv = (_normal(7, (1, 32, 1, 64)), _normal(8, (1, 32, 1, 64)))
    key_valid = jnp.ones((1, 32), bool)
    window = layers.Window(8)
    params = attention.init(jax.random.key(9), x, positions, key_valid, kv, window)
    mosaic = Kernels(qkv=qkv, rope="mosaic")
    ours, ours_kv, _ = attention.apply(params, x, positions, key_valid, kv, window, None, mosaic)
    ref, ref_kv, _ = attention.apply(params, x, positions, key_valid, kv, window)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    np.testing.assert_allclose(f32(ours), f32(ref), atol=5e-2, rtol=5e-2)
    for o, r in zip(ours_kv, ref_kv, strict=True):
        np.testing.assert_allclose(f32(o), f32(r), atol=2e-2, rtol=2e-2)


@needs_gpu
def test_compiled_kernel_on_gpu():
    """On a Hopper GPU: the compiled kernels at LLaDA-8B's block, LLaDA-MoE's (q/k norms) and
    two 32-row sequences, against XLA's product and head ops; the epilogue alone on the
    Mosaic GPU split-K product's partials (and on 2 slices of it) against XLA's head ops on
    the same partials summed; and each feature turned exactly with its partner in the other
    rotary half (`_check_turns`)."""
    for d, rotary in ((128, 128), (128, 64), (64, 64)):
        _check_turns(d, rotary, interpret=False)
    cases = [
        (1, 32, 4096, 32, 1, 128, 128, 384, layers.Window(128), HeadOps()),
        (1, 32, 2048, 16, 1, 128, 128, 384, layers.Window(128), HeadOps(True, 1e-6)),
        (2, 32, 4096, 8, 1, 128, 128, 384, layers.Window(352, 360, 384), HeadOps()),
    ]
    for case in cases:
        x, w, positions, buffers, scales, bounds, cos, sin = _problem(case)
        ops = case[-1]
        ours = rope_write_mosaic.project_rope_and_write(
            x, w, cos, sin, buffers, bounds, scales, ops
        )
        want = _xla(case, x, w, positions, buffers, scales)
        for o, ref in zip(ours, want, strict=True):
            o, ref = (a.astype(jnp.float32) for a in (o, ref))
            np.testing.assert_allclose(o, ref, atol=0.1, rtol=0.02)
        ring = Tiles(block_n=case[5], block_k=128, splits=1, stages=3)  # the sweep's
        fused = rope_write_mosaic.project_rope_and_write(
            x, w, cos, sin, buffers, bounds, scales, ops, tiles=ring
        )
        for o, ref in zip(fused, want, strict=True):
            o, ref = (a.astype(jnp.float32) for a in (o, ref))
            np.testing.assert_allclose(o, ref, atol=0.1, rtol=0.02)
        model, (*_, rotary, _, window, _) = w.shape[0], case
        for tiles in (None, Tiles(block_n=64, block_k=64, splits=2, stages=4)):
            qkv = split_k_mosaic.matmul_partials(x, w.reshape(model, -1), tiles=tiles)
            qkv = Partials(qkv.parts.reshape(qkv.parts.shape[:-1] + w.shape[1:]), qkv.dtype)
            args = (cos, sin, buffers, bounds, scales, ops)
            ours = rope_write_mosaic.rope_and_write(qkv, *args)
            want = layers.rope_and_write_xla(
                qkv.total(), positions, buffers, window, scales, ops, 10000.0, rotary
            )
            for o, ref in zip(ours, want, strict=True):
                o, ref = o.astype(jnp.float32), ref.astype(jnp.float32)
                np.testing.assert_allclose(o, ref, atol=0.05, rtol=0.01)


@needs_gpu
def test_compiled_fp8_kernel_on_gpu():
    """On a Hopper GPU: the compiled fp8 kernel at LLaDA-8B's block and LLaDA-MoE's (q/k
    norms, the clip, two sequences) against XLA's fp8 product (fp32, scaled, rounded) and
    head ops."""
    cases = [
        (1, 32, 4096, 32, 1, 128, 128, 384, layers.Window(128), HeadOps()),
        (2, 32, 2048, 16, 1, 128, 128, 384, layers.Window(352, 360, 384), HeadOps(True, 1e-6)),
    ]
    for case in cases:
        xq, x_scale, w_t, w_scale, positions, buffers, scales, bounds, cos, sin = _fp8_problem(case)
        ours = rope_write_mosaic.project_rope_and_write_fp8(
            xq, x_scale, w_t, w_scale, cos, sin, buffers, bounds, scales, case[-1]
        )
        want = _fp8_xla(case, xq, x_scale, w_t, w_scale, positions, buffers, scales)
        for o, ref in zip(ours, want, strict=True):
            o, ref = (a.astype(jnp.float32) for a in (o, ref))
            np.testing.assert_allclose(o, ref, atol=0.1, rtol=0.02)
