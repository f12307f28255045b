"""djax's expert-tile kernels (run by Pallas's interpreter on the CPU): the tile table
against a loop over the groups, both products against a numpy per-group reference, their
errors, and MoE generations with the kernels forced."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_llada_moe import _routed_experts

import djax
from djax.kernels import expert_tiles
from djax.kernels.expert_tiles import Tiles, expert_mlp, grouped_matmul, max_tiles, row_tiles
from djax.models.llada_moe import (
    experts_dense,
    experts_grouped,
)


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
    n_tiles = max_tiles(pairs, len(sizes), block_m)
    expected = _table_by_loop(sizes, block_m)
    assert len(expected) <= n_tiles
    group, first, rows = map(np.asarray, row_tiles(jnp.array(sizes), block_m, n_tiles))
    used = np.stack([group, first, rows], axis=1)[: len(expected)]
    assert [tuple(map(int, tile)) for tile in used] == expected
    assert not rows[len(expected) :].any()  # the rest do nothing


def test_max_tiles_is_reached_and_never_passed():
    """The bound is tight: 4 groups of 17 rows in 16-row tiles make 8 tiles; and random
    sizes never need more."""
    assert max_tiles(68, 4, 16) == 8
    rng = np.random.default_rng(0)
    for _ in range(50):
        groups, block_m = int(rng.integers(1, 9)), int(rng.choice([16, 32, 64]))
        sizes = rng.integers(0, 3 * block_m, groups)
        pairs = int(sizes.sum()) + int(rng.integers(0, 5))
        assert len(_table_by_loop(sizes, block_m)) <= max_tiles(max(pairs, 1), groups, block_m)


def _reference(x, w, sizes):
    """Each group's rows times its weights in float64; gated weights [g, k, 2, n] give
    silu(gate) * up."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[-1]))
    first = 0
    for group, size in enumerate(sizes):
        rows = x[first : first + size]
        if w.ndim == 4:
            gate, up = rows @ w[group, :, 0], rows @ w[group, :, 1]
            out[first : first + size] = gate / (1 + np.exp(-gate)) * up
        else:
            out[first : first + size] = rows @ w[group]
        first += size
    return out, first


def _problem(sizes, k, n, gated, dtype=jnp.float32, extra_rows=5, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (sum(sizes) + extra_rows, k), dtype)
    shape = (len(sizes), k, 2, n) if gated else (len(sizes), k, n)
    w = (jax.random.normal(keys[1], shape) * k**-0.5).astype(dtype)
    return x, w, jnp.array(sizes, jnp.int32)


def _rel_error(ours, ref):
    return float(np.linalg.norm(np.asarray(ours, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    "sizes, tiles",
    [
        ([3, 0, 20, 1, 9], Tiles(block_m=16, block_n=16, block_k=32)),
        ([40, 2, 0, 7], Tiles(block_m=32, block_n=32, block_k=16, num_stages=2)),
        ([6, 6, 6, 6, 6], None),  # the engine's choice, `tiles_for`
    ],
)
def test_grouped_matmul_matches_numpy(sizes, tiles, gated, gathered):
    """Every row inside the groups is written with its own group's product (rows past them
    are the caller's to mask), in tiles of one group and of several; `gathered`: the sorted
    rows are read through `source_rows` from a smaller array, some rows more than once (as
    a token's pairs read its row once per expert)."""
    x, w, group_sizes = _problem(sizes, 64, 32, gated)
    source_rows = None
    if gathered:
        source_rows = jax.random.randint(jax.random.key(7), (x.shape[0],), 0, 11)
        x = x[:11]
    ours = grouped_matmul(x, w, group_sizes, source_rows, tiles=tiles, interpret=True)
    assert ours.shape == (len(source_rows) if gathered else x.shape[0], 32)
    assert ours.dtype == x.dtype
    ref, used = _reference(x[source_rows] if gathered else x, w, sizes)
    assert _rel_error(ours[:used], ref[:used]) < 1e-5


def test_bf16_close_to_fp32():
    x, w, sizes = _problem([30, 12, 50], 128, 64, True, jnp.bfloat16, seed=1)
    ref, used = _reference(x, w, [30, 12, 50])
    assert _rel_error(grouped_matmul(x, w, sizes, interpret=True)[:used], ref[:used]) < 1e-2


def test_shape_and_tile_errors():
    x, w, sizes = _problem([4, 4], 64, 32, True)
    with pytest.raises(ValueError, match=r"expected w \[groups, 64, 2, n\] or \[groups, 64, n\]"):
        grouped_matmul(x, w[:, :32], sizes, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes \(3,\)"):
        grouped_matmul(x, w, jnp.array([4, 4, 0]), interpret=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(x, jnp.zeros((2, 64, 2, 40)), sizes, interpret=True)
    with pytest.raises(ValueError, match=r"source_rows \(8, 1\); expected \[pairs\]"):
        grouped_matmul(x, w, sizes, jnp.zeros((8, 1), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block_n dividing n = 32"):
        grouped_matmul(x, w, sizes, tiles=Tiles(block_n=64), interpret=True)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        grouped_matmul(x, w, sizes, tiles=Tiles(block_m=24), interpret=True)


@pytest.mark.parametrize("first_expert, n_local", [(0, 6), (3, 3)])
def test_experts_through_the_kernels_match_dense(first_expert, n_local):
    """The whole routed-expert computation with `expert_mlp` against every expert on every
    token, all experts local and half of them (pairs of the other half sort past every
    group, where the kernels write nothing)."""
    x, weights, experts, gate_up, down = _routed_experts(4, n=40, m=32, e=6, f=16, k=2)
    mine = slice(first_expert, first_expert + n_local)
    local = (gate_up[mine], down[mine])
    mlp = functools.partial(expert_mlp, interpret=True)
    out = experts_grouped(x, weights, experts, *local, first_expert, mlp=mlp)
    assert np.isfinite(np.asarray(out)).all()
    expected = experts_dense(x, weights, experts, *local, first_expert)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["dual", "none"])
def test_moe_generation_tokens_unchanged(moe_model, cache):
    """A ragged two-row batch on the tiny LLaDA-MoE (8 experts, top-2): the kernels forced
    for every forward give the tokens and forward counts of XLA's grouped path."""
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache=cache)
    prompts = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]
    calls, kernels = [], expert_tiles.expert_mlp

    def spy(x, source_rows, *args, **kwargs):
        calls.append(source_rows.shape)
        return kernels(x, source_rows, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_tiles, "expert_mlp", spy)
        ours = djax.generate(moe_model.with_options(moe_impl="pallas"), prompts, config)
    ref = djax.generate(moe_model.with_options(moe_impl="xla"), prompts, config)
    assert calls, "the expert-tile kernels did not run"
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
    assert (ours.stats.forwards, ours.stats.refreshes) == (ref.stats.forwards, ref.stats.refreshes)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("tokens", [32, 384])
def test_compiled_kernels_on_gpu(tokens):
    """On a GPU: the Triton-compiled kernels at LLaDA-MoE's expert shapes (64 experts, model
    2048, ffn 1024, top-8, bf16) against XLA's ragged_dot path, at a block's and a
    refresh's token count, under jit as in a generation."""
    x, weights, experts, gate_up, down = _routed_experts(5, tokens, 2048, 64, 1024, 8, jnp.bfloat16)
    expected = jax.jit(experts_grouped)(x, weights, experts, gate_up, down, 0)
    for tiles in (None, (Tiles(block_m=32, block_n=64, block_k=128), Tiles(block_n=256))):
        mlp = functools.partial(expert_mlp, tiles=tiles)
        run = jax.jit(functools.partial(experts_grouped, mlp=mlp))
        out = np.asarray(run(x, weights, experts, gate_up, down, 0), np.float32)
        assert np.isfinite(out).all()
        err = _rel_error(out, np.asarray(expected, np.float64))
        assert err < 1e-2, (tokens, tiles, err)
