"""Sparse attention (`djax.models.sparse_attention`): the choice of each head's keys against a
float64 restatement of the rule, the attention to the compact rows and the window's against
attention over the gathered chosen rows, a block forward over the chosen keys against the
numpy reference with each head's attention masked to the same keys, and the plan's dense
path."""

import math
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices

import djax
from djax import engine, programs
from djax.kernels import fp8_matmul_mosaic
from djax.models.kernel_choice import KernelChoice
from djax.models.layers import Window, write_window
from djax.models.sparse_attention import (
    KeptKV,
    SparseAttention,
    attend_kept,
    choose,
    compact,
    kept_keys,
    kept_slots,
    plan_sparse,
    window_slots,
)

from numpy_reference import RefLLaDA, softmax


def reference_row_keys(keep, recent, count, block_len):
    """A row's kept keys, `min(count, ceil(keep · count) + block + recent)`, with `keep` the
    fraction p/q (q ≤ 1000) nearest to it, in exact rational arithmetic."""
    by_score = math.ceil(Fraction(keep).limit_denominator(1000) * count)
    return min(count, by_score + block_len + recent)


def reference_choice(rule, q_block, keys, key_valid, positions, block_row):
    """The rule as it reads, in float64, one row and kv head at a time: a set of kept
    valid positions per (row, head), `reference_row_keys` of the row's valid keys."""
    b, block_len, kv_heads, group, d = q_block.shape
    chosen = {}
    for r in range(b):
        valid = np.flatnonzero(key_valid[r])
        n_row = reference_row_keys(rule.keep, rule.recent, len(valid), block_len)
        p0 = positions[r, block_row]
        forced = {int(i) for i in valid if p0 - rule.recent <= positions[r, i] < p0 + block_len}
        for h in range(kv_heads):
            scores = np.einsum("tgd,sd->gts", q_block[r, :, h], keys[r][valid][:, h]) / math.sqrt(d)
            mass = softmax(scores).sum(axis=(0, 1))
            others = sorted(
                (i for i in range(len(valid)) if valid[i] not in forced), key=lambda i: -mass[i]
            )
            best = [int(valid[i]) for i in others[: n_row - len(forced)]]
            chosen[r, h] = forced | set(best)
    return chosen


def test_choice_follows_the_rule():
    rng = np.random.default_rng(0)
    b, seq, kv_heads, group, d, block_len, block_row = 2, 24, 2, 2, 8, 4, 14
    key_valid = np.ones((b, seq), bool)
    key_valid[1, :5] = False  # a left-padded row
    positions = np.maximum(np.cumsum(key_valid, axis=1) - 1, 0)
    keys = rng.normal(size=(b, seq, kv_heads, d)).astype(np.float32) * 2
    q_block = rng.normal(size=(b, block_len, kv_heads, group, d)).astype(np.float32) * 2
    rule = SparseAttention(0.25, 3, kept_keys(0.25, 3, seq, block_len))
    assert rule.keys == 6 + 4 + 3
    ours = np.asarray(
        choose(rule, jnp.asarray(q_block), jnp.asarray(keys), key_valid, positions, block_row)
    )
    assert ours.shape == (b, kv_heads, rule.keys)
    expected = reference_choice(rule, q_block.astype(np.float64), keys, key_valid, positions, 14)
    for (r, h), kept in expected.items():
        got = [int(i) for i in ours[r, h] if i >= 0]
        assert all(key_valid[r, got]) and len(got) == len(set(got)), (r, h)
        assert set(got) == kept, (r, h)
        assert set(range(block_row - 3, block_row + block_len)) <= set(got)  # block, window
    assert len({frozenset(v) for v in expected.values()}) > 1  # heads choose differently
    # row 1's 19 valid keys keep ceil(19 / 4) + 4 + 3 = 12 of the program's 13 slots
    assert [len(expected[r, 0]) for r in range(b)] == [13, 12]


@pytest.mark.parametrize(
    "keep, counts, expected",
    [(0.1, [80, 70, 33, 5], [12, 11, 8, 5]), (0.15, [120, 100, 70, 5], [22, 19, 15, 5])],
)
def test_each_row_keeps_its_own_count(keep, counts, expected):
    """Rows of different valid counts in one program (as long as the first) keep
    `min(count, ceil(keep · count) + block)` keys each, the product exact: 0.1 · 70 is 7,
    0.15 · 100 is 15 (a float32 product gives 16); the other slots are dropped (-1), and
    a dropped slot gathers nothing (`compact` marks it invalid and outside the window)."""
    rng = np.random.default_rng(3)
    seq, b, kv_heads, group, d, block_len = counts[0], len(counts), 2, 1, 8, 4
    key_valid = np.arange(seq)[None, :] >= seq - np.array(counts)[:, None]  # left-padded
    positions = np.maximum(np.cumsum(key_valid, axis=1) - 1, 0).astype(np.int32)
    keys = rng.normal(size=(b, seq, kv_heads, d)).astype(np.float32)
    values = rng.normal(size=(b, seq, kv_heads, d)).astype(np.float32)
    q_block = rng.normal(size=(b, block_len, kv_heads, group, d)).astype(np.float32)
    rule = plan_sparse(keep, 0, seq, block_len)
    assert rule == SparseAttention(keep, 0, expected[0])
    assert math.ceil(np.float32(0.15) * np.float32(100)) == 16
    block_row = seq - 4
    ours = np.asarray(
        choose(rule, jnp.asarray(q_block), jnp.asarray(keys), key_valid, positions, block_row)
    )
    assert [reference_row_keys(keep, 0, c, block_len) for c in counts] == expected
    for r, n_row in enumerate(expected):
        for h in range(kv_heads):
            kept = ours[r, h][ours[r, h] >= 0]
            assert len(kept) == n_row and all(key_valid[r, kept]), (r, h)
            assert set(range(block_row, seq)) <= set(kept.tolist())  # the block
    kept = compact(
        jnp.asarray(ours), jnp.asarray(keys), jnp.asarray(values), key_valid, block_row, 4, 4
    )
    slots = kept_slots(rule.keys, 4, 4)
    assert kept.keys.shape == (b, slots, kv_heads, d) and slots - 8 < rule.keys <= slots
    valid = np.asarray(kept.valid)
    outside = valid[..., : slots - 4].sum(axis=-1)  # kept rows outside the block's window
    np.testing.assert_array_equal(outside, np.array(expected)[:, None] - 4 + np.zeros(kv_heads))
    np.testing.assert_array_equal(valid[..., slots - 4 :], np.ones((b, kv_heads, 4), bool))
    np.testing.assert_array_equal(np.asarray(kept.keys)[:, slots - 4 :], keys[:, block_row:])


@pytest.fixture(scope="module")
def forwards(dense_model):
    """The dense model's refresh (choosing keys) and block forward (given chosen keys),
    jitted, with the numpy reference of the same weights."""
    module = programs.local_module(dense_model.config, dense_model.dtype, KernelChoice(), None)
    params = dense_model.params

    def apply(*args, **kwargs):
        return module.apply({"params": params}, *args, **kwargs)

    @jax.jit
    def refresh(tokens, positions, valid, block_row):
        x = apply(tokens, method="embed")
        return apply(x, positions, valid, None, Window(), block_row, BLOCK, sparse=RULE)

    @jax.jit
    def block_forward(inputs, positions, valid, kv, chosen, block_row):
        """A cached step feeding `inputs` [b, width] from `block_row` (the block first),
        its kept rows gathered outside that window."""
        width = inputs.shape[1]
        kept = tuple(
            compact(chosen[i], k, v, valid, block_row, BLOCK, width) for i, (k, v) in enumerate(kv)
        )
        x = apply(inputs, method="embed")
        pos = jax.lax.dynamic_slice_in_dim(positions, block_row, width, axis=1)
        hidden, out_kv, kept = apply(
            x, pos, valid, kv, Window(block_row), 0, BLOCK, True, kept_kv=kept
        )
        return apply(hidden, method="logits"), out_kv, kept

    return refresh, block_forward


SEQ, BLOCK, BLOCK_ROW = 32, 8, 16
RULE = SparseAttention(0.25, 4, kept_keys(0.25, 4, SEQ, BLOCK))


@pytest.mark.parametrize("width", [BLOCK, SEQ - BLOCK_ROW])
def test_block_forward_attends_to_the_chosen_keys(forwards, dense_folder, dense_model, width):
    """width BLOCK: the dual cache's window; SEQ - BLOCK_ROW: the block and the positions
    after it, as the prefix cache feeds them, which each head keeps or not."""
    refresh, block_forward = forwards
    rng = np.random.default_rng(1)
    mask_id = dense_model.config.mask_token_id
    tokens = rng.integers(4, 100, size=(1, SEQ)).astype(np.int32)
    tokens[:, BLOCK_ROW:] = mask_id
    positions = np.arange(SEQ, dtype=np.int32)[None]
    valid = np.ones((1, SEQ), bool)
    _, kv, chosen = refresh(tokens, positions, valid, BLOCK_ROW)
    chosen = np.asarray(chosen)  # [layers, 1, kv_heads, keys]
    assert chosen.shape == (dense_model.config.n_layers, 1, 2, RULE.keys) == (2, 1, 2, 20)
    window = set(range(BLOCK_ROW - RULE.recent, BLOCK_ROW + BLOCK))
    assert all(window <= set(head.tolist()) for head in chosen.reshape(-1, RULE.keys))
    assert (chosen >= 0).all()  # every row holds all SEQ keys: no slot dropped

    after = set(range(BLOCK_ROW + BLOCK, BLOCK_ROW + width))
    assert any(
        0 < len(after & set(head.tolist())) < len(after) for head in chosen.reshape(-1, RULE.keys)
    ) == (width > BLOCK)

    inputs = tokens[:, BLOCK_ROW : BLOCK_ROW + width].copy()
    inputs[0, [1, 4, 6]] = [17, 42, 9]  # some positions committed since the refresh
    logits, out_kv, kept = block_forward(inputs, positions, valid, kv, chosen, BLOCK_ROW)
    ours = np.asarray(logits)[0]
    # the window's fresh K/V went to the kept rows' window slots, not to the K/V buffers
    for (k, v), (out_k, out_v), layer in zip(kv, out_kv, kept, strict=True):
        np.testing.assert_array_equal(np.asarray(out_k), np.asarray(k))
        np.testing.assert_array_equal(np.asarray(out_v), np.asarray(v))
        fresh = np.asarray(layer.keys)[:, -width:]
        assert np.abs(fresh - np.asarray(k)[:, BLOCK_ROW : BLOCK_ROW + width]).max() > 1e-3

    ref = RefLLaDA(dense_folder[0])
    _, cache = ref.forward(ref.emb[tokens[0]], 0, SEQ, None)
    allowed = np.zeros((chosen.shape[0], 2, SEQ), bool)
    for layer in range(chosen.shape[0]):
        for head in range(2):
            allowed[layer, head, chosen[layer, 0, head]] = True
    expected, _ = ref.forward(ref.emb[inputs[0]], BLOCK_ROW, SEQ, cache, allowed=allowed)
    dense, _ = ref.forward(ref.emb[inputs[0]], BLOCK_ROW, SEQ, cache)
    expected, dense = expected[:BLOCK], dense[:BLOCK]
    error = np.linalg.norm(ours - expected) / np.linalg.norm(expected)
    assert error < 1e-5
    assert np.linalg.norm(dense - expected) / np.linalg.norm(expected) > 100 * error


PROMPTS = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]


def test_keep_one_is_the_dense_plan(dense_model):
    dense = djax.GenerationConfig(gen_length=16, block_length=8)
    for keep, window in ((1.0, 64), (1.0, 0), (0.5, 64)):  # the last keeps every position
        config = djax.GenerationConfig(
            gen_length=16, block_length=8, attention_sparsity=keep, attention_window=window
        )
        assert engine.make_plan(dense_model, config, 2, 6) == engine.make_plan(
            dense_model, dense, 2, 6
        )
    assert plan_sparse(1.0, 0, 1024, 32) is None
    assert plan_sparse(0.1, 64, 1024, 32) == SparseAttention(0.1, 64, 103 + 32 + 64)


@pytest.mark.parametrize(
    "cache",
    [
        {"cache": "dual"},
        {"cache": "prefix", "refresh_every": 3},  # a refresh mid-block gathers again
        {"cache": "vicinity", "vicinity_before": 4, "vicinity_after": 4, "vicinity_warmup": 2},
    ],
)
def test_generation_gathers_and_matches_dense_where_every_real_key_is_kept(dense_model, cache):
    """Prompts padded to 16 and 16 answer positions: 32 positions, the rows 22 and 19 real
    keys; keep 0.5 with a window of 4 gives the program 16 + 8 + 4 = 28 slots per head, so
    the sparse path runs (under each cache policy), and each row keeps all its keys (11 + 12
    and 10 + 12): it must give the dense tokens."""
    dense = djax.GenerationConfig(gen_length=16, block_length=8, **cache)
    sparse = djax.GenerationConfig(
        gen_length=16, block_length=8, attention_sparsity=0.5, attention_window=4, **cache
    )
    plan, _ = engine.make_plan(dense_model, sparse, 2, 6)
    assert plan.sparse == SparseAttention(0.5, 4, 28)
    ours = djax.generate(dense_model, PROMPTS, sparse)
    ref = djax.generate(dense_model, PROMPTS, dense)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
    assert ours.stats.forwards == ref.stats.forwards > ours.stats.refreshes


@pytest.mark.parametrize(
    "options",
    [
        {"attention_sparsity": 0},
        {"attention_sparsity": -0.5},
        {"attention_sparsity": 1.5},
        {"attention_sparsity": float("nan")},
        {"attention_sparsity": True},
        {"attention_sparsity": "0.5"},
        {"attention_sparsity": 0.5, "cache": "none"},
        {"attention_window": -1},
        {"attention_window": 2.5},
    ],
)
def test_bad_values_are_refused(options):
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        djax.GenerationConfig(**options)


def attend_gathered(q, keys, values, key_valid, chosen):
    """The per-step formulation the compact rows replace: each head gathers its chosen rows
    from the buffers and attends to the valid ones."""
    b, kv_heads, _ = chosen.shape
    rows, heads = np.arange(b)[:, None, None], np.arange(kv_heads)[None, :, None]
    k_rows, v_rows = keys[rows, chosen, heads], values[rows, chosen, heads]  # [b, kv, n, d]
    valid = key_valid[rows, chosen] & (chosen >= 0)
    scores = np.einsum("btkgd,bknd->bkgtn", q, k_rows) / math.sqrt(q.shape[-1])
    scores = np.where(valid[:, :, None, None, :], scores, -np.inf)
    return np.einsum("bkgtn,bknd->btkgd", softmax(scores), v_rows)


def written(kept, keys, values, window, width):
    """`kept` after a cached step whose window is `window` (`Window`, `width` rows) wrote
    the rows of keys, values [b, s, kv_heads, d] there, as `layers.Attention` writes them."""
    slots = window_slots(window, kept.keys.shape[1], width)
    fresh = (jax.lax.dynamic_slice_in_dim(a, window.start, width, axis=1) for a in (keys, values))
    new_keys, new_values = (
        write_window(buf, f, slots) for buf, f in zip(kept[:2], fresh, strict=True)
    )
    return kept._replace(keys=new_keys, values=new_values)


@pytest.mark.parametrize("window", ["prefix", "dual"])
def test_compact_rows_and_window_equal_the_gathered_rows(window):
    """`prefix`: a wide window holding rows some heads chose and others did not, written
    from the block on (the rows before it keep the refresh's K/V); `dual`: the window is the
    block, which every head keeps, written whole. A step's window rows are rewritten after
    the gather and written into the kept rows' window slots, as a cached step writes them."""
    rng = np.random.default_rng(2)
    b, seq, kv_heads, group, d, t = 2, 40, 2, 2, 16, 4
    if window == "prefix":
        start, width, step_window = 14, 26, Window(14, 20, 40)
    else:
        start, width, step_window = 20, 8, Window(20)
    n = 16
    key_valid = np.ones((b, seq), bool)
    key_valid[1, :3] = False  # a left-padded row
    key_valid[0, 17] = False  # a padding key in the window (a row's own padding)
    keys, values = (rng.normal(size=(b, seq, kv_heads, d)).astype(np.float32) for _ in "kv")
    block = np.arange(20, 28)
    chosen = np.empty((b, kv_heads, n), np.int32)
    for r in range(b):
        for h in range(kv_heads):
            padding = [17] if (r, h) == (0, 0) else []  # chosen (in a test): never attended to
            others = np.setdiff1d(np.arange(seq), [*block, 17])
            more = rng.choice(others, n - len(block) - len(padding), replace=False)
            chosen[r, h] = np.sort([*block, *padding, *more])
    window_rows = np.arange(start, start + width)
    inside = [set(np.intersect1d(c, window_rows).tolist()) for c in chosen.reshape(-1, n)]
    assert any(len(s - set(block.tolist())) for s in inside) == (window == "prefix")
    kept = compact(
        jnp.asarray(chosen), jnp.asarray(keys), jnp.asarray(values), key_valid, start, 8, width
    )
    assert kept.keys.shape == (b, kept_slots(n, 8, width), kv_heads, d)
    fresh_keys, fresh_values = keys.copy(), values.copy()  # the step's rows
    lo = start if step_window.write_lo is None else step_window.write_lo
    fresh_keys[:, lo : start + width] = rng.normal(size=(b, start + width - lo, kv_heads, d))
    fresh_values[:, lo : start + width] = rng.normal(size=(b, start + width - lo, kv_heads, d))
    step = written(kept, jnp.asarray(fresh_keys), jnp.asarray(fresh_values), step_window, width)
    q = rng.normal(size=(b, t, kv_heads, group, d)).astype(np.float32)
    ours = np.asarray(attend_kept(jnp.asarray(q), step))
    expected = attend_gathered(q, fresh_keys, fresh_values, key_valid, chosen)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    # the rows the window holds come from this step, not from the refresh's buffers
    stale = np.asarray(attend_kept(jnp.asarray(q), kept))
    assert np.abs(stale - attend_gathered(q, keys, values, key_valid, chosen)).max() < 1e-5
    assert np.abs(stale - expected).max() > 1e-2
    # and each head sees only the window rows it chose that are valid keys
    every_row = step._replace(valid=step.valid.at[..., -width:].set(True))
    unmasked = np.asarray(attend_kept(jnp.asarray(q), every_row))
    assert (np.abs(unmasked - expected).max() > 1e-2) == (window == "prefix")
    # and no compact slot holds a window row (it would count twice): a head's valid compact
    # slots are its chosen valid keys outside the window
    outside = (chosen < start) | (chosen >= start + width)
    counts = (outside & key_valid[np.arange(b)[:, None, None], chosen]).sum(axis=-1)
    np.testing.assert_array_equal(np.asarray(step.valid)[..., :-width].sum(axis=-1), counts)


@needs_devices
def test_tensor_parallel_heads_choose_as_on_one_device(dense_folder, dense_model):
    """Under TP=2 each device chooses for its own kv head: the tokens are one device's."""
    from djax.sharding import make_mesh

    split = djax.load(dense_folder[0], dtype=jnp.float32, mesh=make_mesh(tensor_parallel=2))
    config = djax.GenerationConfig(
        gen_length=32, block_length=8, attention_sparsity=0.1, attention_window=2
    )
    prompts = [[0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 15, 25, 35, 45], [0, 11, 12]]
    assert engine.make_plan(dense_model, config, 2, 14)[0].sparse.keys == 5 + 8 + 2  # of 48
    ours = djax.generate(split, prompts, config)
    one = djax.generate(dense_model, prompts, config)
    np.testing.assert_array_equal(ours.answer_ids, one.answer_ids)


def test_a_row_keeps_its_tokens_beside_a_longer_prompt(dense_model):
    """Prompts of 3 and 100 tokens pad to 16 alone and 128 together (programs of 32 and 144
    positions, 12 and 23 slots per head at keep 0.1 with no window): each row keeps its own
    count of keys either way (the short row 10 of its 19), so the batch gives each row its
    tokens alone."""
    config = djax.GenerationConfig(
        gen_length=16,
        block_length=8,
        decoder="low_confidence",
        attention_sparsity=0.1,
        attention_window=0,
    )
    short, long = [0, 11, 12], [0, *(20 + i % 50 for i in range(99))]
    plans = [engine.make_plan(dense_model, config, 1, n)[0] for n in (3, 100)]
    assert [(p.seq_len, p.sparse.keys) for p in plans] == [(32, 12), (144, 23)]
    together = djax.generate(dense_model, [short, long], config).answer_ids
    for i, prompt in enumerate((short, long)):
        alone = djax.generate(dense_model, [prompt], config).answer_ids
        np.testing.assert_array_equal(together[i], alone[0])


def test_kernel_path_equals_the_einsums():
    """`attend_kept` with `split_kv` (one split-K/V kernel call over the kept rows' slots,
    run by Mosaic GPU's interpreter) against its XLA path and the gathered rows, in bf16,
    after a step wrote its window's rows from the block on (rows 32 and 33 keep the
    refresh's): 13 kept keys per head, 8 of them the block's, and a 16-row window (24 slots:
    5 outside the window, 3 invalid, the window's 16), a left-padded row, a wide window
    whose rows some heads kept, a head (row 1, kv head 1) whose kept rows all lie in the
    window, so it has no valid compact row, and one (row 0, kv head 1) that keeps no window
    row (5 rows outside it, its other slots dropped)."""
    rng = np.random.default_rng(4)
    b, seq, kv_heads, group, d, t, n = 2, 48, 2, 2, 64, 8, 13
    start, width, block = 32, 16, np.arange(32, 40)
    key_valid = np.ones((b, seq), bool)
    key_valid[1, :3] = False
    chosen = np.empty((b, kv_heads, n), np.int32)
    for r in range(b):
        for h in range(kv_heads):
            if (r, h) == (0, 1):
                outside = rng.choice(np.arange(3, start), n - len(block), replace=False)
                chosen[r, h] = np.sort([*[-1] * len(block), *outside])
                continue
            pool = np.arange(40, 48) if (r, h) == (1, 1) else np.setdiff1d(np.arange(3, seq), block)
            chosen[r, h] = np.sort([*block, *rng.choice(pool, n - len(block), replace=False)])
    keys, values = (rng.normal(size=(b, seq, kv_heads, d)) for _ in "kv")
    keys, values = (jnp.asarray(a, jnp.bfloat16) for a in (keys, values))
    q = jnp.asarray(rng.normal(size=(b, t, kv_heads, group, d)), jnp.bfloat16)
    kept = compact(jnp.asarray(chosen), keys, values, key_valid, start, len(block), width)
    assert kept.keys.shape == (b, kept_slots(n, 8, width), kv_heads, d) == (b, 24, kv_heads, d)
    fresh_keys, fresh_values = (
        a.at[:, 34:].set(jnp.asarray(rng.normal(size=(b, 14, kv_heads, d)), jnp.bfloat16))
        for a in (keys, values)
    )
    kept = written(kept, fresh_keys, fresh_values, Window(start, 34, seq), width)
    valid = np.asarray(kept.valid)
    assert not valid[1, 1, :-width].any() and valid[0, :, :-width].sum(axis=-1).min() > 0
    assert not valid[0, 1, -width:].any() and valid[:, 0, -width:].sum(axis=-1).min() > 0
    ours = attend_kept(q, kept, "split_kv")
    xla = attend_kept(q, kept, "xla")
    assert ours.shape == q.shape and ours.dtype == jnp.bfloat16
    expected = attend_gathered(
        *(np.asarray(a, np.float32) for a in (q, fresh_keys, fresh_values)), key_valid, chosen
    )
    for path in (ours, xla):
        error = np.linalg.norm(np.asarray(path, np.float32) - expected) / np.linalg.norm(expected)
        assert error < 1e-2
    diff = np.abs(np.asarray(ours, np.float32) - np.asarray(xla, np.float32))
    assert diff.max() < 0.05
    with pytest.raises(ValueError, match="impl 'cudnn'; expected 'xla' or 'split_kv'"):
        attend_kept(q, kept, "cudnn")


def test_kernel_path_hands_e4m3_heads():
    """`into_fp8` (an fp8 output product after sparse attention, heads of 128 features):
    the kernel path writes each row of each head in e4m3 with its own scale, as XLA's path
    quantises its output (`fp8_matmul_mosaic.quantize_heads`), each kv head masked by its
    own slots."""
    rng = np.random.default_rng(7)
    b, slots, kv_heads, group, d, t = 2, 40, 2, 2, 128, 8
    keys, values = (
        jnp.asarray(rng.normal(size=(b, slots, kv_heads, d)), jnp.bfloat16) for _ in "kv"
    )
    valid = jnp.asarray(rng.random((b, kv_heads, slots)) < 0.6).at[..., -8:].set(True)
    kept = KeptKV(keys, values, valid)
    q = jnp.asarray(rng.normal(size=(b, t, kv_heads, group, d)), jnp.bfloat16)
    ours = attend_kept(q, kept, "split_kv", into_fp8=True)
    xla = fp8_matmul_mosaic.quantize_heads(attend_kept(q, kept, "xla"))
    assert ours.values.shape == xla.values.shape == (b, t, kv_heads * group * d)
    assert ours.scale.shape == xla.scale.shape == (kv_heads * group, b * t)
    np.testing.assert_allclose(ours.scale, xla.scale, rtol=2e-2)

    def back(rows):
        values = np.asarray(rows.values.astype(jnp.float32)).reshape(b * t, -1, d)
        return values * np.asarray(rows.scale).T[..., None]

    error = np.linalg.norm(back(ours) - back(xla)) / np.linalg.norm(back(xla))
    assert error < 3e-2  # e4m3's steps where the two outputs round apart (1.3% here)


def test_sparse_layer_step_with_the_kernels():
    """An attention layer's sparse cached step with RoPE's kernel (the q/k/v product inside
    it) and the split-K/V kernel (Mosaic GPU's interpreter) against its XLA path, in bf16:
    a 16-row window at 8 of 32 keys written from 12 on (as `prefix` writes from the
    block), 12 kept keys per head. Both write the window's K/V into the kept rows' last 16
    slots (the 4 before the write range keep the refresh's) and leave the K/V buffers as
    they were."""
    from djax.config import DENSE, ModelConfig
    from djax.models.kernel_choice import Kernels
    from djax.models.layers import Attention

    rng = np.random.default_rng(5)
    config = ModelConfig(DENSE, 64, 64, 1, 2, 1, 64, 128, 1e4, 1e-5, 64, 1, 2, 3)
    bf16, width, n = jnp.bfloat16, 16, 12
    x = jnp.asarray(rng.normal(size=(1, width, 64)), bf16)
    positions = 8 + jnp.arange(width)[None]
    kv = tuple(jnp.asarray(rng.normal(size=(1, 32, 1, 64)), bf16) for _ in "kv")
    key_valid = jnp.ones((1, 32), bool)
    window = Window(8, 12, 24)
    chosen = np.sort(rng.choice(32, size=(1, 1, n), replace=False), axis=-1).astype(np.int32)
    kept = compact(jnp.asarray(chosen), *kv, key_valid, 8, 0, width)  # no block kept: 0
    attention = Attention(config, bf16)
    params = attention.init(jax.random.key(9), x, positions, key_valid, kv, window)
    kernels = Kernels(qkv="rope", rope="mosaic", attention="split_kv")
    # jitted: op by op, the interpreter's callbacks and the next ops can deadlock
    runs = [
        jax.jit(
            lambda p, x, kv, kept, k=k: attention.apply(
                p, x, positions, key_valid, kv, window, None, k, kept_kv=kept
            )
        )(params, x, kv, kept)
        for k in (kernels, Kernels())
    ]
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    (ours, ours_kv, ours_kept), (ref, ref_kv, ref_kept) = runs
    np.testing.assert_allclose(f32(ours), f32(ref), atol=5e-2, rtol=5e-2)
    slots = kept.keys.shape[1]
    for out_kv, out_kept in ((ours_kv, ours_kept), (ref_kv, ref_kept)):
        for a, b in zip(out_kv, kv, strict=True):  # returned as given
            np.testing.assert_array_equal(f32(a), f32(b))
        for before, after in zip(kept[:2], out_kept[:2], strict=True):
            np.testing.assert_array_equal(f32(after)[:, : slots - 12], f32(before)[:, : slots - 12])
            written = np.abs(f32(after) - f32(before))[0, slots - 12 :].max(axis=(1, 2))
            assert (written > 0.1).all()  # every row of the write range
    for o, r in zip(ours_kept[:2], ref_kept[:2], strict=True):
        np.testing.assert_allclose(f32(o), f32(r), atol=2e-2, rtol=2e-2)


def test_sparse_layer_step_lowers_for_hopper(monkeypatch):
    """A LLaDA-8B layer's sparse cached step at batch 4, prompt 8,192 (a 32-row dual-cache
    window at 8,192 of 8,448 keys, keep 0.25: 2,208 kept keys, of which 2,176 outside the
    block, and the window's 32 rows, 2,208 slots) under `auto`'s Hopper choice lowers for
    CUDA, its kernels compiled rather than interpreted: RoPE writing the window's K/V into
    the kept rows' buffers (seen as their [4 x 2,208, 32 x 128] rows), one attention call
    over them, the two per-row norms; the K/V buffers come back as they went in."""
    from djax.config import DENSE, ModelConfig
    from djax.kernel_options import KernelOptions
    from djax.kernels import tma_ring
    from djax.models.kernel_choice import Device, Shapes, resolve

    monkeypatch.setattr(tma_ring, "interpret_params", lambda interpret: None)
    b, seq, heads, d, width = 4, 8448, 32, 128, 32
    n = kept_keys(0.25, 64, seq, width)
    slots = kept_slots(n, width, width)
    assert (n, slots) == (2208, 2208)
    bf16 = jnp.bfloat16
    config = ModelConfig(DENSE, 126464, 4096, 1, heads, heads, d, 12288, 5e5, 1e-5, 4096, 1, 2, 3)
    hopper = Device("gpu", (9, 0), 227 * 1024)
    choice = resolve(KernelOptions(), hopper, config, bf16, Shapes(b, width, seq, width))
    layers = choice.block.layers
    assert (layers.attention, layers.rope) == ("split_kv", "mosaic")
    module = programs.local_module(config, bf16, choice, None)
    spec = jax.ShapeDtypeStruct
    buffer = spec((b, seq, heads, d), bf16)
    args = (
        spec((b, width, 4096), bf16),  # the window's embeddings
        spec((b, width), jnp.int32),  # positions
        spec((b, seq), jnp.bool_),  # key_valid
        ((buffer, buffer),),
        Window(spec((), jnp.int32)),
    )
    kept = (KeptKV(spec((b, slots, heads, d), bf16), spec((b, slots, heads, d), bf16),
                   spec((b, heads, slots), jnp.bool_)),)  # fmt: skip
    params = jax.eval_shape(
        lambda *a: module.init(jax.random.key(0), *a, block_forward=True), *args
    )

    def step(params, *args):
        return module.apply(params, *args[:-1], block_forward=True, kept_kv=args[-1])

    traced = jax.jit(step).trace(params, *args, kept)
    _, out_kv, out_kept = traced.out_info
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out_kept) == jax.tree.map(
        lambda a: (a.shape, a.dtype), kept
    )
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    kernels = re.findall(r"custom_call @mosaic_gpu\w*", text)
    assert len(kernels) == 4, kernels  # RoPE and the K/V write, attention, two norms
    assert f"tensor<{b * slots}x{heads * d}xbf16>" in text
    assert f"tensor<{b}x{slots}x{heads}x{d}xbf16>" in text
    main = re.search(r"func.func public @main.*?\n\s+return ([^:]*):", text, re.S)
    returned = main.group(1).split(", ")  # hidden, keys, values, the kept rows' three
    assert [r.startswith("%arg") for r in returned] == [False, True, True, False, False, True]


def test_generation_with_the_kernel_path(tmp_path, monkeypatch):
    """A bf16 model of head dim 64 at keep 0.25 (20 of 32 positions per head):
    `attention_impl="split_kv"` (Mosaic GPU's interpreter) runs the cached steps' attention
    in one kernel call over the kept rows and the window's (each kv head its own mask) and
    gives the tokens of XLA's path."""
    from djax.kernels import flash_attention_mosaic

    from torch_reference import make_llada_dense

    calls = []
    attention = flash_attention_mosaic.split_kv_attention

    def counted(*args, **kwargs):
        calls.append((args[1].shape, args[3].ndim))
        return attention(*args, **kwargs)

    monkeypatch.setattr(flash_attention_mosaic, "split_kv_attention", counted)
    make_llada_dense(
        tmp_path, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=128,
        head_scale=6.0, seed=7,
    )  # fmt: skip
    xla = djax.load(tmp_path, dtype=jnp.bfloat16, attention_impl="xla")
    kernel = xla.with_options(attention_impl="split_kv")
    config = djax.GenerationConfig(
        gen_length=16, block_length=8, decoder="low_confidence", attention_sparsity=0.25,
        attention_window=4,
    )  # fmt: skip
    prompts = [[0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 15, 25, 35, 45, 55], [0, *range(11, 22)]]
    assert engine.make_plan(xla, config, 2, 15)[0].sparse == SparseAttention(0.25, 4, 20)
    ours = djax.generate(kernel, prompts, config).answer_ids
    # the refresh's kernel over 32 keys, and the block forward's over 24 slots: the 12 kept
    # keys outside the block and the 8-row window's, up to a multiple of 8
    assert sorted(calls) == [((2, 24, 1, 64), 3), ((2, 32, 1, 64), 2)]
    reference = djax.generate(xla, prompts, config).answer_ids
    if jax.default_backend() == "cpu":  # the interpreter: XLA's sums, the same tokens
        np.testing.assert_array_equal(ours, reference)
    else:  # the compiled kernel rounds its bf16 partials in its own order: a near tie
        # between two positions' confidences may commit them in the other order (2 of
        # 32 tokens swapped on an H100)
        assert np.mean(ours == reference) >= 0.9


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("b", [1, 4])
def test_kernel_path_on_gpu(b):
    """On a Hopper GPU, LLaDA-8B's sparse block at prompt 8,192 (32 heads and kv heads, head
    dim 128, a 32-row dual-cache window at 8,192 of 8,448 keys, 2,208 kept per head, drawn at
    random besides the block and the 64 before it; row 0's kv head 3 keeps only its block,
    so it has no compact row, and its kv head 5 none of it), after a step wrote its window's
    rows: the compiled `split_kv` path (one kernel call) against the `xla` one."""
    seq, heads, d, width, start = 8448, 32, 128, 32, 8192
    n = kept_keys(0.25, 64, seq, width)
    rng = jax.random.split(jax.random.key(9), 6)
    keys, values = (jax.random.normal(k, (b, seq, heads, d), jnp.bfloat16) for k in rng[:2])
    q = jax.random.normal(rng[2], (b, width, heads, 1, d), jnp.bfloat16)
    position = jnp.arange(seq)
    forced = (position >= start - 64) & (position < start + width)
    score = jnp.where(forced, 2.0, jax.random.uniform(rng[3], (b, heads, seq)))
    chosen = jnp.sort(jax.lax.top_k(score, n)[1], axis=-1).astype(jnp.int32)
    block = (chosen[0, 3] >= start) & (chosen[0, 3] < start + width)
    chosen = chosen.at[0, 3].set(jnp.where(block, chosen[0, 3], -1))
    in_block = (chosen[0, 5] >= start) & (chosen[0, 5] < start + width)
    chosen = chosen.at[0, 5].set(jnp.where(in_block, -1, chosen[0, 5]))
    key_valid = jnp.ones((b, seq), bool)
    kept = compact(chosen, keys, values, key_valid, start, width, width)
    fresh = (jax.random.normal(k, (b, seq, heads, d), jnp.bfloat16) for k in rng[4:])
    kept = written(kept, *fresh, Window(start), width)
    assert not kept.valid[0, 3, :-width].any() and kept.valid[0, 3, -width:].all()
    assert not kept.valid[0, 5, -width:].any() and kept.valid[0, 5, :-width].any()
    run = jax.jit(attend_kept, static_argnums=2)
    ours = run(q, kept, "split_kv").astype(jnp.float32)
    ref = run(q, kept, "xla").astype(jnp.float32)
    assert float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref)) <= 1e-2
    for head in (3, 5):
        assert float(jnp.abs(ours[0, :, head] - ref[0, :, head]).max()) <= 0.05


def test_kept_counts_are_exact_past_two_million_keys():
    """At 2,149,633 keys and keep 0.999 (999/1000), `p · count` passes int32's range:
    `choose` still keeps exactly `row_keys`' count (the block included), where forming the
    product kept none."""
    seq, block_len = 2_149_633, 4
    rule = plan_sparse(0.999, 0, seq, block_len)
    assert rule.keys == reference_row_keys(0.999, 0, seq, block_len) == 2_147_488
    keys = jax.random.normal(jax.random.key(0), (1, seq, 1, 1))
    q_block = jnp.ones((1, block_len, 1, 1, 1))
    valid = jnp.ones((1, seq), bool)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    chosen = jax.jit(choose, static_argnums=0)(rule, q_block, keys, valid, positions, seq - 4)
    assert int((chosen >= 0).sum()) == rule.keys
    assert set(range(seq - 4, seq)) <= set(np.asarray(chosen[0, 0]).tolist())
