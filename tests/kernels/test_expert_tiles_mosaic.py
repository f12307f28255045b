"""The expert-tile kernels (`expert_tiles_mosaic`, Pallas Mosaic GPU), run by Mosaic GPU's
interpreter on the CPU: the aligned row layout they take, both products with bf16 and fp8
weights against a numpy per-group reference, the MoE layer taking them (`moe_impl="mosaic"`),
their errors, and their lowering for a Hopper GPU at LLaDA-MoE's shapes; on a GPU also the
compiled kernels."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_llada_moe import _routed_experts

from djax.config import MOE, ModelConfig
from djax.kernels import expert_tiles_mosaic, fp8_matmul_mosaic
from djax.kernels.expert_tiles_mosaic import FP8, grouped_matmul
from djax.kernels.tma_ring import ROW_ALIGN as ALIGN
from djax.kernels.tma_ring import Tiles
from djax.models import fp8
from djax.models.kernel_choice import Kernels
from djax.models.llada_moe import (
    MoEBlock,
    experts_by_token,
    experts_dense,
    experts_grouped,
    fp8_mosaic_mlp,
    group_layout,
    mosaic_mlp,
    ragged_mlp,
)

BF16 = jnp.bfloat16
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("sizes, pairs", [([3, 0, 70, 1], 79), ([8, 5, 0, 16], 35), ([0, 0], 4)])
def test_aligned_layout_starts_groups_at_multiples_of_8(sizes, pairs):
    """Each group's rows keep their order from a multiple of 8, after the earlier groups'
    rows rounded up to 8; the rows past the groups follow in order; `source` inverts
    `position` and points padding rows at row 0."""
    position, source, aligned = map(
        np.asarray, expert_tiles_mosaic.aligned_layout(jnp.array(sizes, jnp.int32), pairs)
    )
    rounded = [-(-size // 8) * 8 for size in sizes]
    np.testing.assert_array_equal(aligned, rounded)
    expected, start, row = [], 0, 0
    for size, padded in zip(sizes, rounded, strict=True):
        expected += range(start, start + size)
        start, row = start + padded, row + size
    expected += range(start, start + pairs - row)
    np.testing.assert_array_equal(position, expected)
    assert len(source) == expert_tiles_mosaic.aligned_rows(pairs, len(sizes))
    assert len(source) % 8 == 0 and position.max() < len(source)
    np.testing.assert_array_equal(source[position], np.arange(pairs))
    padding = np.setdiff1d(np.arange(len(source)), position)
    assert (source[padding] == 0).all()


def _reference(x, w, sizes, scale=None):
    """Each group's rows times its weights (times the columns' scales) in float64; gated
    weights [g, k, 2, n] give silu(gate) * up. Returns (out, rows used)."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(w).astype(jnp.float32), np.float64)
    if scale is not None:
        w = w * np.asarray(scale, np.float64)[:, None]
    out, first = np.zeros((x.shape[0], w.shape[-1])), 0
    for group, size in enumerate(sizes):
        rows = x[first : first + size]
        if w.ndim == 4:
            gate, up = rows @ w[group, :, 0], rows @ w[group, :, 1]
            out[first : first + size] = gate / (1 + np.exp(-gate)) * up
        else:
            out[first : first + size] = rows @ w[group]
        first += size
    return out, first


@pytest.mark.parametrize(
    "gated, weights, tiles",
    [
        (True, "bf16", None),  # row tiles of 64 (`row_tile_for` of 79 rows): 70 rows make 2
        (True, "bf16", Tiles(rows=16)),  # 70 rows make 5 tiles, the last of 8 rows
        (False, "bf16", Tiles(block_n=64, block_k=64, stages=2)),  # 2 column tiles, 64 rows
        (True, "fp8", Tiles(block_n=64, block_k=64, stages=2)),  # down's fp8: the layer test
    ],
)
def test_grouped_matmul_matches_numpy(gated, weights, tiles):
    """Every row inside the groups is written with its own group's product: an empty group,
    one of more rows than a tile (70 rows from row 8 of the aligned layout: 2 tiles of 64,
    5 of 16), a last group of one row, and rows past the groups (84 in all); fp8 weights
    with their column scales."""
    sizes = [3, 0, 70, 1]
    k, n = 128, 128
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (sum(sizes) + 5, k), BF16)
    shape = (len(sizes), k, 2, n) if gated else (len(sizes), k, n)
    w = jax.random.normal(keys[1], shape) * k**-0.5
    scale = None
    if weights == "fp8":
        w, scale = fp8.quantize(w, (1,))
    else:
        w = w.astype(BF16)
    ours = grouped_matmul(x, w, jnp.array(sizes, jnp.int32), scale, tiles=tiles)
    assert ours.shape == (x.shape[0], n) and ours.dtype == BF16
    ref, used = _reference(x, w, sizes, scale)
    ours = np.asarray(ours[:used].astype(jnp.float32), np.float64)
    # the fp32 product rounded once to bf16
    np.testing.assert_allclose(ours, ref[:used], rtol=1e-2, atol=1e-2)
    assert np.linalg.norm(ours - ref[:used]) / np.linalg.norm(ref[:used]) < 5e-3


@pytest.mark.parametrize(
    "gated, tiles",
    [
        (True, None),  # row tiles of 64 (`row_tile_for` of 79 rows): 70 rows make 2
        (False, Tiles(block_n=64, block_k=128, stages=2, rows=64)),  # 70 rows: 2 tiles
        (True, Tiles(block_n=128, block_k=256, stages=2, rows=32)),  # a block's: 1 step, 3 tiles
    ],
)
def test_fp8_grouped_matmul_matches_numpy(gated, tiles):
    """The fp8 x fp8 products (`grouped_matmul_fp8`, K-major e4m3 weights, e4m3 rows) against
    float64 products of the same quantised operands times their row and column scales: an
    empty group, one of more rows than a tile, a last group of one row and rows past the
    groups; two contraction steps of 128."""
    sizes = [3, 0, 70, 1]
    k, n = 256, 128
    keys = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(keys[0], (sum(sizes) + 5, k), BF16)
    shape = (len(sizes), 2, n, k) if gated else (len(sizes), n, k)
    xq, x_scale = fp8.quantize(x, (1,))
    w_t, w_scale = fp8.quantize(jax.random.normal(keys[1], shape) * k**-0.5, (len(shape) - 1,))
    ours = expert_tiles_mosaic.grouped_matmul_fp8(
        xq, x_scale, w_t, w_scale, jnp.array(sizes, jnp.int32), tiles=tiles
    )
    assert ours.shape == (x.shape[0], n) and ours.dtype == BF16
    rows = np.asarray(xq.astype(jnp.float32), np.float64) * np.asarray(x_scale, np.float64)[:, None]
    w = np.asarray(w_t.astype(jnp.float32), np.float64) * np.asarray(w_scale, np.float64)[..., None]
    w = np.moveaxis(w, -1, 1)  # [groups, k, (2,) n]
    ref, used = _reference(rows, w, sizes)
    ours = np.asarray(ours[:used].astype(jnp.float32), np.float64)
    np.testing.assert_allclose(ours, ref[:used], rtol=1e-2, atol=1e-2)
    assert np.linalg.norm(ours - ref[:used]) / np.linalg.norm(ref[:used]) < 5e-3


@pytest.mark.parametrize(
    "tiles",
    [
        None,  # a block's: 256-wide steps, each two slices of the activation's scales
        (Tiles(block_n=128, block_k=128, stages=2, rows=64),) * 2,  # a refresh's: one a step
    ],
)
def test_fp8_expert_mlp_quantises_the_activation_per_column_tile(tiles):
    """`expert_mlp_fp8` (ffn 256: two 128-column tiles) against float64 products of the
    same e4m3 operands, its activation quantised by `quantize_slices` (a scale per row of
    each 128 columns, written by the gate/up kernel beside its e4m3 values and applied per
    contraction slice by the down kernel): 0.2% of the norm here, a bound of 0.5% that the
    same reference with a scale per whole row (the rule before the kernel quantised) does
    not meet. The gate/up kernel's scales themselves match the reference's."""
    tokens, model, ffn, experts, top_k = 24, 128, 256, 3, 2
    keys = jax.random.split(jax.random.key(6), 4)
    x = jax.random.normal(keys[0], (tokens, model), BF16)
    gate_up_t, gate_up_scale = fp8.quantize(
        jax.random.normal(keys[1], (experts, 2, ffn, model)) * model**-0.5, (3,)
    )
    down_t, down_scale = fp8.quantize(
        jax.random.normal(keys[2], (experts, model, ffn)) * ffn**-0.5, (2,)
    )
    expert = jax.random.randint(keys[3], (tokens * top_k,), 0, experts)
    _, pair, sizes = group_layout(expert, experts, ALIGN)
    source = pair // top_k
    ours = expert_tiles_mosaic.expert_mlp_fp8(
        x, source, gate_up_t, gate_up_scale, down_t, down_scale, sizes, tiles=tiles
    )
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x)
    rows = _f64(xq)[source] * _f64(x_scale)[source, None]
    gate_up = _f64(gate_up_t) * _f64(gate_up_scale)[..., None]  # [e, 2, ffn, model]
    down = _f64(down_t) * _f64(down_scale)[..., None]  # [e, model, ffn]
    sizes, first = np.asarray(sizes), 0
    ref, act_scales, used = np.zeros((len(source), model)), [], []
    for e, size in enumerate(sizes):
        r = rows[first : first + size]
        gate, up = r @ gate_up[e, 0].T, r @ gate_up[e, 1].T
        act = jnp.asarray(gate / (1 + np.exp(-gate)) * up, jnp.float32)
        aq, a_scale = fp8_matmul_mosaic.quantize_slices(act)
        dequantised = _f64(aq).reshape(size, -1, 128) * _f64(a_scale).T[..., None]
        ref[first : first + size] = dequantised.reshape(size, ffn) @ down[e].T
        act_scales.append(_f64(a_scale))
        used += range(first, first + size)
        first += size
    ours = _f64(ours)[used]
    assert np.linalg.norm(ours - ref[used]) / np.linalg.norm(ref[used]) < 5e-3
    up_tiles = (tiles or (None,))[0] or expert_tiles_mosaic.fp8_tiles_for(tokens, model, ffn)
    table = expert_tiles_mosaic.pair_table(jnp.asarray(sizes), up_tiles.rows, len(source))
    _, scales = expert_tiles_mosaic._fp8_product(
        xq[source], x_scale[source], gate_up_t, gate_up_scale, table, len(source), up_tiles,
        FP8, None,
    )  # fmt: skip
    assert scales.shape == (ffn // 128, len(source))
    np.testing.assert_allclose(_f64(scales)[:, used], np.concatenate(act_scales, 1), rtol=1e-3)


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def test_row_tiles_hold_the_most_rows_an_expert_can_take():
    """An expert holds at most one row per token: a block's 32 tokens are read 32 rows at a
    time (no expert in two tiles), fewer tokens in tiles of 16, a refresh's 64; every row
    tile is a multiple of 8 up to 64 (`Tiles.check`)."""
    row_tile_for = expert_tiles_mosaic.row_tile_for
    assert [row_tile_for(t) for t in (1, 5, 16, 17, 32, 33, 384)] == [16, 16, 16, 32, 32, 64, 64]
    assert expert_tiles_mosaic.tiles_for(32, 2048, 1024).rows == 32
    assert expert_tiles_mosaic.fp8_tiles_for(32, 2048, 1024).rows == 32
    # e4m3 weights converted in the kernel: a block's tiles in 2 stages, a refresh's in 4
    converted = expert_tiles_mosaic.converted_tiles_for
    assert (converted(32, 2048, 1024).stages, converted(384, 2048, 1024).stages) == (2, 4)
    assert converted(384, 2048, 1024) == expert_tiles_mosaic.tiles_for(384, 2048, 1024)
    # fp8 x fp8: a block's steps 256 wide in 2 stages where 256 divides k, else 128 in 4
    fp8_tiles = expert_tiles_mosaic.fp8_tiles_for
    assert (fp8_tiles(32, 2048, 1024).block_k, fp8_tiles(32, 2048, 1024).stages) == (256, 2)
    assert (fp8_tiles(32, 384, 1024).block_k, fp8_tiles(384, 2048, 1024).block_k) == (128, 128)
    for rows in (0, 12, 128):
        with pytest.raises(ValueError, match="rows 64 .a multiple of 8 up to 64"):
            Tiles(rows=rows).check(128, 128, weights=1, out_bytes=2, row_tiled=True)
    Tiles(rows=16).check(128, 128, weights=1, out_bytes=2, row_tiled=True)
    with pytest.raises(ValueError, match="rows 64"):  # kernels of whole 64-row tiles
        Tiles(rows=16).check(128, 128, weights=1, out_bytes=2)


def _table_by_loop(sizes, block_m):
    """(group, first row, rows) of every used tile, group by group."""
    table, first = [], 0
    for group, size in enumerate(sizes):
        for start in range(0, size, block_m):
            table.append((group, first + start, min(block_m, size - start)))
        first += size
    return table


@pytest.mark.parametrize(
    "sizes, block_m",
    [
        ([3, 0, 20, 1, 9], 16),  # an empty group, one of two tiles, a last group
        ([17, 17, 17, 17], 16),  # every group one row past a whole tile: the most tiles
        ([0, 0, 64], 16),
        ([5], 64),
    ],
)
def test_row_tiles_follow_the_groups(sizes, block_m):
    pairs = sum(sizes) + 3  # rows past the groups, as pairs on other devices leave
    n_tiles = expert_tiles_mosaic.max_tiles(pairs, len(sizes), block_m)
    expected = _table_by_loop(sizes, block_m)
    assert len(expected) <= n_tiles
    table = expert_tiles_mosaic.row_tiles(jnp.array(sizes), block_m, n_tiles)
    group, first, rows = map(np.asarray, table)
    used = np.stack([group, first, rows], axis=1)[: len(expected)]
    assert [tuple(map(int, tile)) for tile in used] == expected
    assert not rows[len(expected) :].any()  # the rest do nothing


def test_max_tiles_is_reached_and_never_passed():
    """The bound is tight: 4 groups of 17 rows in 16-row tiles make 8 tiles; and random
    sizes never need more."""
    max_tiles = expert_tiles_mosaic.max_tiles
    assert max_tiles(68, 4, 16) == 8
    rng = np.random.default_rng(0)
    for _ in range(50):
        groups, block_m = int(rng.integers(1, 9)), int(rng.choice([16, 32, 64]))
        sizes = rng.integers(0, 3 * block_m, groups)
        pairs = int(sizes.sum()) + int(rng.integers(0, 5))
        assert len(_table_by_loop(sizes, block_m)) <= max_tiles(max(pairs, 1), groups, block_m)


@pytest.mark.parametrize("first_expert, n_local", [(0, 4), (2, 2)])
def test_experts_through_the_kernels_match_dense(first_expert, n_local):
    """The whole routed-expert computation with `mosaic_mlp` against every expert on every
    token, all experts local and half of them (pairs of the other half sort past every
    group, where the kernels write nothing)."""
    x, weights, experts, gate_up, down = _routed_experts(4, n=24, m=64, e=4, f=64, k=2)
    x, gate_up, down = (a.astype(BF16) for a in (x, gate_up, down))
    mine = slice(first_expert, first_expert + n_local)
    local = (gate_up[mine], down[mine])
    out = experts_grouped(x, weights, experts, *local, first_expert, mlp=mosaic_mlp, align=ALIGN)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    f32 = [a.astype(jnp.float32) for a in (x, *local)]
    expected = experts_dense(f32[0], weights, experts, *f32[1:], first_expert)
    err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(expected, np.float32))
    assert err / np.linalg.norm(np.asarray(expected, np.float32)) < 1e-2


def test_every_token_layout_rounds_the_tokens_and_refuses_more_than_a_tile():
    """The every-token layout stores the tokens' rows rounded up to 8 (a TMA copy's unit),
    reads x from row 0 for the tokens themselves, and refuses more tokens than a tile."""
    layout = expert_tiles_mosaic.EveryToken.of(20, 32, True)
    assert (layout.rows, layout.from_tokens) == (24, True)
    assert expert_tiles_mosaic.EveryToken.of(32, 32, False).rows == 32
    with pytest.raises(ValueError, match="33 tokens in row tiles of 32"):
        expert_tiles_mosaic.EveryToken.of(33, 32, True)
    up, down = expert_tiles_mosaic.EveryToken.pair(20, Tiles(rows=32), Tiles(rows=32))
    assert (up.from_tokens, down.from_tokens, down.rows) == (True, False, 24)
    with pytest.raises(ValueError, match="tiles of the same rows; got 32 and 64"):
        expert_tiles_mosaic.EveryToken.pair(20, Tiles(rows=32), Tiles(rows=64))


@pytest.mark.parametrize("weights, first_expert, n_local", [("bf16", 1, 2), ("fp8", 0, 4)])
def test_every_token_layout_gives_the_pairs_results(weights, first_expert, n_local):
    """`experts_by_token` (each routed expert's tile runs every token, no layout of the
    pairs) gives `experts_grouped`'s result bit for bit through the same kernels: a row's
    products do not depend on the other rows of its tile. bf16 weights with half the
    experts local (the other half's pairs get zero weight), K-major fp8 weights by fp8 x
    fp8 WGMMA with all of them; 20 tokens, fewer than the 32-row tiles hold."""
    x, weights_, experts, gate_up, down = _routed_experts(4, n=20, m=128, e=4, f=128, k=2)
    x = x.astype(BF16)
    mine = slice(first_expert, first_expert + n_local)
    if weights == "bf16":
        local, mlp = (gate_up[mine].astype(BF16), down[mine].astype(BF16)), mosaic_mlp
    else:
        orders = ((0, 2, 3, 1), (0, 2, 1))
        local = tuple(
            fp8.Fp8Weight(jnp.transpose(v, order), s, True, leading=1)
            for (v, s), order in zip(
                (fp8.quantize(gate_up[mine], (1,)), fp8.quantize(down[mine], (1,))),
                orders,
                strict=True,
            )
        )
        mlp = fp8_mosaic_mlp
    args = (x, weights_, experts, *local, first_expert)
    tilings = []

    def spy(product):
        def run(*a, **kw):
            tilings.append(next(t for t in a if isinstance(t, Tiles)))
            return product(*a, **kw)

        return run

    with pytest.MonkeyPatch.context() as patch:
        for name in ("_product", "_fp8_product"):
            patch.setattr(expert_tiles_mosaic, name, spy(getattr(expert_tiles_mosaic, name)))
        pairs = experts_grouped(*args, mlp=mlp, align=ALIGN)
        tokens = experts_by_token(*args, mlp=mlp)
    assert tilings[:2] == tilings[2:]  # the same programs: each layout's default tiles
    pairs, tokens = (np.asarray(a, np.float32) for a in (pairs, tokens))
    assert np.isfinite(tokens).all() and np.abs(tokens).max() > 0
    np.testing.assert_array_equal(tokens, pairs)


def _moe_config():
    return ModelConfig(
        MOE, 16, 64, 1, 2, 2, 32, 64, 1e4, 1e-6, 64, 1, 2, 3,
        n_experts=4, experts_per_token=2, expert_hidden=64, moe_layers=(True,),
    )  # fmt: skip


@pytest.mark.parametrize("weights", ["dtype", "fp8"])
def test_moe_layer_takes_the_kernels(weights):
    """A bf16 MoE layer (4 experts, top-2) under `moe=mosaic` against XLA's grouped path
    (fp8 weights: `dequant`), the kernels spied on to be sure they ran."""
    cfg = _moe_config()
    x = jax.random.normal(jax.random.key(0), (1, 12, 64), BF16)
    params = MoEBlock(cfg, BF16).init(jax.random.key(1), x)["params"]
    if weights == "fp8":
        params = fp8.quantize_params(params)
    block = MoEBlock(cfg, BF16, weights=weights)
    fp8_impl = "dequant" if weights == "fp8" else "no"
    calls, kernels = [], expert_tiles_mosaic.expert_mlp

    def spy(*args, **kwargs):
        calls.append(args[2].dtype)
        return kernels(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_tiles_mosaic, "expert_mlp", spy)
        ours = block.apply({"params": params}, x, Kernels(moe="mosaic", fp8=fp8_impl))
    ref = block.apply({"params": params}, x, Kernels(moe="grouped", fp8=fp8_impl))
    assert calls == [FP8 if weights == "fp8" else BF16]
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 2e-2


def test_moe_layer_takes_the_fp8_products():
    """A bf16 MoE layer (4 experts, top-2, model and ffn 128) with K-major fp8 experts under
    `moe=fp8_mosaic` against the same fp8 weights in their own layout under XLA's grouped
    `dequant` path. The rows' e4m3 quantisation (twice: the tokens, the activation) adds
    up to 2^-4 of each row's largest value per element (XLA's `scaled` path is 4.5% of the
    norm from `dequant` here): a bound of 6% of the norm, and 3% against `scaled` (the same
    quantisation; the kernel rounds the activation once, from fp32, `scaled` in bf16),
    which a lost scale or a wrong expert's weights exceed many times. K-major experts also
    run XLA's dense path (`experts_dense`) as they are."""
    cfg = ModelConfig(
        MOE, 16, 128, 1, 2, 1, 64, 128, 1e4, 1e-6, 64, 1, 2, 3,
        n_experts=4, experts_per_token=2, expert_hidden=128, moe_layers=(True,),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(3), (1, 12, 128), BF16)
    params = fp8.quantize_params(MoEBlock(cfg, BF16).init(jax.random.key(4), x)["params"])
    stored = MoEBlock(cfg, BF16, weights="fp8")
    ref = stored.apply({"params": params}, x, Kernels(moe="grouped", fp8="dequant"))
    scaled = stored.apply({"params": params}, x, Kernels(moe="grouped", fp8="scaled"))
    k_major = fp8.to_layout(params, True)
    assert k_major["gate_up"].shape == (4, 2, 128, 128) and k_major["down"].shape == (4, 128, 128)
    block = MoEBlock(cfg, BF16, weights="fp8", k_major=True)
    ours = block.apply({"params": k_major}, x, Kernels(moe="fp8_mosaic", fp8="scaled"))
    # a block's layout: every token through each routed expert, the same products
    by_token = Kernels(moe="fp8_mosaic", expert_rows="tokens", fp8="scaled")
    np.testing.assert_array_equal(block.apply({"params": k_major}, x, by_token), ours)
    ours, ref, scaled = (np.asarray(a, np.float32) for a in (ours, ref, scaled))
    assert np.isfinite(ours).all()
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 6e-2
    assert np.linalg.norm(ours - scaled) / np.linalg.norm(scaled) < 3e-2
    dense = block.apply({"params": k_major}, x, Kernels(moe="dense", fp8="dequant"))
    np.testing.assert_allclose(np.asarray(dense, np.float32), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="moe='fp8_mosaic' takes K-major .* in its own layout"):
        stored.apply({"params": params}, x, Kernels(moe="fp8_mosaic", fp8="scaled"))
    with pytest.raises(ValueError, match="moe='mosaic' takes fp8 expert weights in their own"):
        block.apply({"params": k_major}, x, Kernels(moe="mosaic", fp8="scaled"))


def test_shape_dtype_and_tile_errors():
    x = jnp.zeros((8, 64), BF16)
    w = jnp.zeros((2, 64, 2, 64), BF16)
    sizes = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"expected w \[groups, 64, 2, n\] or \[groups, 64, n\]"):
        grouped_matmul(x, w[:, :32], sizes)
    with pytest.raises(ValueError, match="multiples of 64"):
        grouped_matmul(x, jnp.zeros((2, 64, 2, 48), BF16), sizes)
    with pytest.raises(ValueError, match="expected both bfloat16 or both float16"):
        grouped_matmul(x, w.astype(jnp.float32), sizes)
    with pytest.raises(ValueError, match="expected x bfloat16 or float16 and w float8_e4m3fn"):
        grouped_matmul(x, w, sizes, jnp.ones((2, 2, 64)))
    with pytest.raises(ValueError, match=r"scale \(2, 64\) float32; expected \(2, 2, 64\)"):
        grouped_matmul(x, w.astype(FP8), sizes, jnp.ones((2, 64)))
    with pytest.raises(ValueError, match="splits=1"):
        grouped_matmul(x, w, sizes, tiles=Tiles(block_n=64, splits=2))
    xq, x_scale = jnp.zeros((8, 128), FP8), jnp.ones((8,), jnp.float32)
    w_t, w_scale = jnp.zeros((2, 2, 128, 128), FP8), jnp.ones((2, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="dtype float8_e4m3fn; expected xq"):
        expert_tiles_mosaic.grouped_matmul_fp8(xq, x_scale, w_t, w_scale, sizes, dtype=FP8)
    fp8_tiles = expert_tiles_mosaic.fp8_tiles_for(8, 128, 128)
    table = expert_tiles_mosaic.pair_table(sizes, fp8_tiles.rows, 8)
    with pytest.raises(ValueError, match=r"x_scale \(3, 8\); expected \[8\] or \[1, 8\]"):
        expert_tiles_mosaic._fp8_product(
            xq, jnp.ones((3, 8)), w_t, w_scale, table, 8, fp8_tiles, BF16, None
        )
    with pytest.raises(ValueError, match="an e4m3 output takes a gated product"):
        expert_tiles_mosaic._fp8_product(
            xq, x_scale, w_t[:, 0], w_scale[:, 0], table, 8, fp8_tiles, FP8, None
        )
    with pytest.raises(ValueError, match=r"tile table \(5,\); expected \[3 n_tiles\]"):
        expert_tiles_mosaic._fp8_product(
            xq, x_scale, w_t, w_scale, table[:5], 8, fp8_tiles, FP8, None
        )
    with pytest.raises(ValueError, match="80 tokens in row tiles of 64; the every-token"):
        expert_tiles_mosaic.expert_mlp_fp8_every_token(
            jnp.zeros((80, 128), BF16),
            jnp.ones(2, jnp.int32),
            w_t,
            w_scale,
            w_t[:, 0],
            w_scale[:, 0],
        )
    down = jnp.zeros((2, 64, 64), BF16)
    for rows in [(8, 1), (12,)]:
        with pytest.raises(ValueError, match=re.escape(f"source_rows {rows}; expected [rows]")):
            expert_tiles_mosaic.expert_mlp(x, jnp.zeros(rows, jnp.int32), w, down, sizes)


@pytest.mark.parametrize("weights", ["bf16", "fp8", "fp8_k_major"])
def test_lowers_for_hopper(weights):
    """Both products at LLaDA-MoE's expert shapes (64 experts, model 2048, ffn 1024, top-8)
    lower to Mosaic GPU's custom call for CUDA, at a block's (32) and a refresh's (384)
    tokens, and a block's in the every-token layout: bf16 weights, fp8 weights converted in
    the kernel, and K-major fp8 weights by fp8 x fp8 WGMMA (`expert_mlp_fp8`)."""
    w_dtype = BF16 if weights == "bf16" else FP8
    experts, model, ffn = 64, 2048, 1024

    def mlp(x, source_rows, gate_up, down, sizes, *scales):
        if source_rows is None:
            return expert_tiles_mosaic.expert_mlp_every_token(
                x, sizes, gate_up, down, *scales, interpret=False
            )
        return expert_tiles_mosaic.expert_mlp(
            x, source_rows, gate_up, down, sizes, *scales, interpret=False
        )

    def mlp_fp8(x, source_rows, gate_up_t, down_t, sizes, gate_up_scale, down_scale):
        weights = (gate_up_t, gate_up_scale, down_t, down_scale)
        if source_rows is None:
            return expert_tiles_mosaic.expert_mlp_fp8_every_token(
                x, sizes, *weights, interpret=False
            )
        return expert_tiles_mosaic.expert_mlp_fp8(x, source_rows, *weights, sizes, interpret=False)

    k_major = weights == "fp8_k_major"
    for tokens, by_token in ((32, False), (384, False), (32, True)):
        rows = expert_tiles_mosaic.aligned_rows(tokens * 8, experts)
        shapes = [
            ((tokens, model), BF16),
            (None if by_token else (rows,), jnp.int32),
            ((experts, 2, ffn, model) if k_major else (experts, model, 2, ffn), w_dtype),
            ((experts, model, ffn) if k_major else (experts, ffn, model), w_dtype),
            ((experts,), jnp.int32),
        ]
        if weights != "bf16":
            shapes += [((experts, 2, ffn), jnp.float32), ((experts, model), jnp.float32)]
        args = [shape and jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
        traced = jax.jit(mlp_fp8 if k_major else mlp).trace(*args)
        lowered = traced.lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("mosaic_gpu") >= 2


@needs_gpu
@pytest.mark.parametrize("tokens", [32, 384])
def test_compiled_kernels_on_gpu(tokens):
    """On a GPU: the compiled kernels at LLaDA-MoE's expert shapes against XLA's ragged_dot
    path under jit, bf16 weights and fp8 weights (`dequant`); at a block's 32 tokens the
    every-token layout gives the pairs' results bit for bit."""
    x, weights, experts, gate_up, down = _routed_experts(5, tokens, 2048, 64, 1024, 8, BF16)
    args = (x, weights, experts)
    for fp8_weights in (False, True):
        w = (gate_up, down)
        ragged = ragged_mlp
        if fp8_weights:
            w = tuple(fp8.Fp8Weight(*fp8.quantize(a, (1,))) for a in w)
            ragged = functools.partial(ragged_mlp, fp8_impl="dequant")
        expected = jax.jit(functools.partial(experts_grouped, mlp=ragged))(*args, *w, 0)
        run = jax.jit(functools.partial(experts_grouped, mlp=mosaic_mlp, align=ALIGN))
        out = np.asarray(run(*args, *w, 0), np.float32)
        assert np.isfinite(out).all()
        ref = np.asarray(expected, np.float32)
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        assert err < 1e-2, (tokens, fp8_weights, err)
        if tokens <= 64:
            by_token = jax.jit(functools.partial(experts_by_token, mlp=mosaic_mlp))
            np.testing.assert_array_equal(np.asarray(by_token(*args, *w, 0), np.float32), out)


@needs_gpu
@pytest.mark.parametrize("tokens", [32, 384])
def test_compiled_fp8_products_on_gpu(tokens):
    """On a GPU: the compiled fp8 x fp8 expert products (`fp8_mosaic_mlp`, K-major weights)
    at LLaDA-MoE's expert shapes against XLA's ragged_dot path `scaled` (the same rows
    quantised per row) under jit: within 5% of the norm (the kernel rounds the activation
    once from fp32, `scaled` in bf16, before both quantise it to e4m3, which moves the
    interpreted kernels 2.3% from `scaled` at a tiny shape; Hopper's fp8 WGMMA accumulates
    in less than fp32); a lost scale or a wrong expert moves it by about its norm. At a
    block's 32 tokens the every-token layout gives the pairs' results bit for bit."""
    x, weights, experts, gate_up, down = _routed_experts(5, tokens, 2048, 64, 1024, 8, BF16)
    args = (x, weights, experts)
    stored = tuple(fp8.Fp8Weight(*fp8.quantize(a, (1,))) for a in (gate_up, down))
    orders = ((0, 2, 3, 1), (0, 2, 1))
    k_major = tuple(
        fp8.Fp8Weight(jnp.transpose(w.values, order), w.scale, True, leading=1)
        for w, order in zip(stored, orders, strict=True)
    )
    ragged = functools.partial(ragged_mlp, fp8_impl="scaled")
    expected = jax.jit(functools.partial(experts_grouped, mlp=ragged))(*args, *stored, 0)
    run = jax.jit(functools.partial(experts_grouped, mlp=fp8_mosaic_mlp, align=ALIGN))
    out = np.asarray(run(*args, *k_major, 0), np.float32)
    assert np.isfinite(out).all()
    ref = np.asarray(expected, np.float32)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err < 5e-2, (tokens, err)
    if tokens <= 64:
        by_token = jax.jit(functools.partial(experts_by_token, mlp=fp8_mosaic_mlp))
        np.testing.assert_array_equal(np.asarray(by_token(*args, *k_major, 0), np.float32), out)
