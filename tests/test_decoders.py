"""The decoders' pass over the vocabulary: token and confidence from one reduction, on one
device and with the vocabulary split over 4 fake CPU devices (set in conftest.py), whole or
a chunk of the vocabulary at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from djax.decoders import (
    DecoderSpec,
    Filters,
    check_filters,
    credit_update,
    decide,
    filtered,
    gumbel_noise,
    predict,
    predict_chunked,
)

from numpy_reference import commit_rows

MASK = 5
VOCAB = 64


def _logits(seed: int) -> np.ndarray:
    """[2, 6, VOCAB] fp32 logits with the cases a pass can get wrong: a tie for the top (the
    first id wins), the mask id on top (never chosen), a tie across the split's parts
    (ids 15 and 16 lie on devices 0 and 1 of 4), and a row far from zero."""
    x = np.random.default_rng(seed).normal(size=(2, 6, VOCAB)).astype(np.float32) * 3
    x[0, 0, [9, 40]] = 20.0
    x[0, 1, MASK] = 30.0
    x[1, 2, [15, 16]] = 25.0
    x[1, 3] += 500.0
    return x


def _expected(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    choosable = np.where(np.arange(VOCAB) == MASK, -np.inf, logits)
    token = np.argmax(choosable, axis=-1)  # the first maximum
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return token, np.take_along_axis(p, token[..., None], axis=-1)[..., 0]


def _on_four_devices(fn, logits):
    """`fn` under shard_map over 4 devices, each holding a quarter of the vocabulary (the
    last axis of `logits`); its outputs whole on every device."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    sharded = jax.shard_map(
        fn, mesh=mesh, in_specs=P(None, None, "model"), out_specs=P(), check_vma=False
    )
    return jax.jit(sharded)(logits)


def test_token_and_confidence_in_one_pass():
    logits = _logits(0)
    token, confidence = jax.jit(lambda x: predict(x, None, None, MASK))(jnp.asarray(logits))
    expected_token, expected_confidence = _expected(logits)
    np.testing.assert_array_equal(token, expected_token)
    assert token[0, 0] == 9 and token[0, 1] != MASK and token[1, 2] == 15
    np.testing.assert_allclose(confidence, expected_confidence, rtol=1e-5)


@pytest.mark.parametrize("temperature", [None, (0.7, 0.7), (0.0, 1.3)])
def test_split_vocabulary_matches_one_device(temperature):
    """Each of 4 devices holds a quarter of the vocabulary: the combined token and
    confidence equal one device's (Gumbel noise drawn over the whole vocabulary); rows may
    differ in temperature, 0 taking the argmax."""
    logits = jnp.asarray(_logits(1))
    keys = jax.random.split(jax.random.key(3), 2)
    t = None if temperature is None else jnp.asarray(temperature, jnp.float32)
    whole = jax.jit(lambda x: predict(x, t, keys, MASK))(logits)
    split = _on_four_devices(lambda x: predict(x, t, keys, MASK, "model"), logits)
    np.testing.assert_array_equal(split[0], whole[0])
    np.testing.assert_allclose(split[1], whole[1], rtol=1e-6)
    if temperature is None:
        assert whole[0][1, 2] == 15
    else:  # a row at temperature 0 takes the argmax
        greedy = predict(logits, None, None, MASK)[0]
        same = np.asarray(whole[0]) == np.asarray(greedy)
        assert same[0].all() == (temperature[0] == 0.0) and not same[1].all()


def test_rows_sample_from_their_own_keys():
    """A row's sample depends on its own key alone, not on its batch-mates'."""
    logits = jnp.asarray(_logits(2))
    keys = jax.random.split(jax.random.key(0), 3)
    t = jnp.array([1.0, 1.0], jnp.float32)
    a = predict(logits, t, keys[:2], MASK)[0]
    b = predict(logits, t, jnp.stack([keys[0], keys[2]]), MASK)[0]
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[1], b[1])


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1, 2**31, 2**32 - 1])
def test_row_keys_fold_each_row_index_into_the_seed(seed):
    """Row i's key data is `fold_in(key(seed), i)`, drawn eagerly here, for seeds across
    [0, 2**32) (the upper half does not fit an int32)."""
    from djax.diffusion import row_keys

    for rows in (1, 3):
        expected = [
            jax.random.key_data(jax.random.fold_in(jax.random.key(seed), i)) for i in range(rows)
        ]
        ours = row_keys(seed, rows)
        assert ours.shape == (rows, 2) and ours.dtype == np.uint32
        np.testing.assert_array_equal(ours, np.stack(expected))
    assert not np.array_equal(row_keys(seed, 1), row_keys((seed + 1) % 2**32, 1))


def test_credit_adds_at_the_top_token():
    """The credit decoder's p1 comes from the same pass: credit lands at the top-1 token
    (first of a tie) of masked positions only, as p1^γ."""
    logits = _logits(2)
    masked = jnp.ones((2, 6), bool).at[1, 0].set(False)
    spec = DecoderSpec(name="credit")
    credit, _ = credit_update(
        jnp.zeros((2, 6, VOCAB)), jnp.asarray(logits), masked, spec, jnp.array(True), None
    )
    top = np.argmax(logits, axis=-1)
    x = logits.astype(np.float64)
    p1 = 1 / np.exp(x - x.max(-1, keepdims=True)).sum(-1)
    expected = np.zeros_like(logits)
    np.put_along_axis(expected, top[..., None], (p1**spec.credit_gamma)[..., None], axis=-1)
    expected[1, 0] = 0.0
    np.testing.assert_allclose(credit, expected, rtol=1e-5, atol=1e-7)


def _chunks_of(logits: jax.Array, chunk: int):
    """`predict_chunked`'s logits_at over the last axis of `logits` [..., positions, vocab]."""
    return lambda start: jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=-1)


def test_noise_of_any_vocabulary_slice_is_the_whole_draw():
    """Each (position, id) draws the noise `jax.random.gumbel` draws for [positions,
    vocab] (so sampled tokens are what they were before chunking), whatever ids are asked."""
    key = jax.random.key(11)
    whole = np.asarray(jax.random.gumbel(key, (6, VOCAB)))
    np.testing.assert_array_equal(gumbel_noise(key, 6, jnp.arange(VOCAB), VOCAB), whole)
    ids = jnp.array([63, 0, 17, 18])
    np.testing.assert_array_equal(gumbel_noise(key, 6, ids, VOCAB), whole[:, [63, 0, 17, 18]])
    with pytest.raises(ValueError, match="2\\*\\*32 counters"):
        gumbel_noise(key, 2**16, ids, 2**16)


@pytest.mark.parametrize("chunk", [8, 20, 64])
@pytest.mark.parametrize("temperature", [None, (0.7, 0.7), (0.0, 1.3)])
def test_chunked_prediction_matches_the_whole(chunk, temperature):
    """Chunks of 8 (ties at 9/40 and 15/16 in different chunks, the mask in its own), 20
    (the last chunk overlapping the one before) and the whole vocabulary: the same tokens
    as one pass, sampled ones included, and the same confidences up to summation order."""
    logits = jnp.asarray(_logits(4))
    keys = jax.random.split(jax.random.key(5), 2)
    t = None if temperature is None else jnp.asarray(temperature, jnp.float32)
    whole = jax.jit(lambda x: predict(x, t, keys, MASK))(logits)
    chunked = jax.jit(lambda x: predict_chunked(_chunks_of(x, chunk), VOCAB, chunk, t, keys, MASK))(
        logits
    )
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_allclose(chunked[1], whole[1], rtol=1e-6)
    if temperature is None:
        assert chunked[0][0, 0] == 9 and chunked[0][1, 2] == 15 and chunked[0][0, 1] != MASK
    with pytest.raises(ValueError, match="chunk=65; expected 0 < chunk"):
        predict_chunked(_chunks_of(logits, 65), VOCAB, 65, t, keys, MASK)


@pytest.mark.parametrize("temperature", [None, (0.0, 1.3)])
def test_chunks_of_a_split_vocabulary_match_one_device(temperature):
    """4 devices, each its 16 ids in chunks of 6: their combined statistics give one
    device's whole-vocabulary token and confidence."""
    logits = jnp.asarray(_logits(1))
    keys = jax.random.split(jax.random.key(3), 2)
    t = None if temperature is None else jnp.asarray(temperature, jnp.float32)
    whole = jax.jit(lambda x: predict(x, t, keys, MASK))(logits)
    split = _on_four_devices(
        lambda x: predict_chunked(_chunks_of(x, 6), VOCAB // 4, 6, t, keys, MASK, "model"), logits
    )
    np.testing.assert_array_equal(split[0], whole[0])
    np.testing.assert_allclose(split[1], whole[1], rtol=1e-6)


def test_which_decoders_take_chunks():
    """Chunks wherever the vocabulary spans more than one, except for credit and under
    smoothing (they need every probability) or with logits_chunk 0."""
    assert DecoderSpec("threshold", logits_chunk=16).chunk_for(64) == 16
    assert DecoderSpec("low_confidence", logits_chunk=16).chunk_for(64) == 16
    assert DecoderSpec("threshold", logits_chunk=64).chunk_for(64) is None
    assert DecoderSpec("threshold", logits_chunk=0).chunk_for(64) is None
    assert DecoderSpec("credit", logits_chunk=16).chunk_for(64) is None
    assert DecoderSpec("hierarchy", logits_chunk=16).chunk_for(64, smoothing=True) is None


# ---------------------------------------------------------------- top-k and top-p


def _kept(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The ids top-k then top-p keep of one position's scores (fp64, sorted by hand): the
    k highest and every score equal to the k-th; then those the scores above which hold
    less than p of what top-k kept."""
    s = scaled.astype(np.float64)
    keep = np.isfinite(s)
    if top_k > 0:
        keep &= s >= np.sort(s[keep])[::-1][min(top_k, keep.sum()) - 1]
    if top_p < 1:
        w = np.where(keep, np.exp(s - s[keep].max()), 0.0)
        w /= w.sum()
        above = np.array([w[s > x].sum() for x in s])
        keep &= above < top_p
    return keep


FILTER_CASES = [(0, 1.0), (1, 1.0), (5, 1.0), (64, 1.0), (0, 0.5), (0, 0.9), (3, 0.5), (8, 0.95)]


@pytest.mark.parametrize("top_k, top_p", FILTER_CASES)
def test_filters_keep_the_highest_scores(top_k, top_p):
    """`filtered` keeps exactly what sorting by hand keeps, per position: logits with ties
    at the k-th score (all kept), the mask id (never kept) and a row far from zero; the
    other rows of the batch take no filter."""
    logits = _logits(4)
    logits[0, 3, :8] = 20.0  # an 8-way tie for the top: top_k 3 or 5 keeps all eight
    scaled = np.where(np.arange(VOCAB) == MASK, -np.inf, logits / 0.8).astype(np.float32)
    filters = Filters(jnp.array([top_k, 0], jnp.int32), jnp.array([top_p, 1.0], jnp.float32))
    out = np.asarray(jax.jit(filtered)(jnp.asarray(scaled), filters))
    for b in range(2):
        for q in range(scaled.shape[1]):
            expected = _kept(scaled[b, q], top_k, top_p) if b == 0 else np.isfinite(scaled[b, q])
            np.testing.assert_array_equal(np.isfinite(out[b, q]), expected, err_msg=f"{b}, {q}")
            kept = np.isfinite(out[b, q])
            np.testing.assert_array_equal(out[b, q][kept], scaled[b, q][kept])
    if top_k in (3, 5) and top_p == 1.0:  # the tie, less the mask id
        assert np.isfinite(np.delete(out[0, 3, :8], MASK)).all()


def test_minus_zero_ties_plus_zero():
    """-0.0 and +0.0 are equal scores: top-k keeps both when they tie the k-th, and top-p
    counts neither as above the other."""
    scaled = np.array([2.0, 0.0, -0.0, -0.0, -1.0, -np.inf, 0.0, -3.0], np.float32)
    cases = [(3, 1.0), (2, 1.0), (0, 0.8), (5, 0.9)]
    for top_k, top_p in cases:
        filters = Filters(jnp.array([top_k], jnp.int32), jnp.array([top_p], jnp.float32))
        out = np.asarray(jax.jit(filtered)(jnp.asarray(scaled)[None, None], filters))[0, 0]
        expected = _kept(scaled, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(out), expected, err_msg=f"{top_k}, {top_p}")


@pytest.mark.parametrize("top_p", [1e-30, 1e-40, 1e-45, 1e-50])
def test_a_top_p_below_float32s_normals_keeps_the_highest_score(top_p):
    """A top_p that float32 holds as a subnormal or as 0 (the server and GenerationConfig
    take any p > 0) keeps the highest score, as any tiny p does: never an empty set, which
    would draw id 0 whatever the logits."""
    logits = _logits(5)
    keys = jax.random.split(jax.random.key(7), 2)
    t = jnp.array([1.3, 0.6], jnp.float32)
    filters = Filters(jnp.zeros(2, jnp.int32), jnp.full(2, top_p, jnp.float32))
    drawn = np.array(predict(jnp.asarray(logits), t, keys, MASK, None, filters)[0])
    greedy = np.asarray(predict(jnp.asarray(logits), None, None, MASK)[0])
    for (b, q), tied in {(0, 0): (9, 40), (1, 2): (15, 16)}.items():  # `_logits`' ties
        assert drawn[b, q] in tied
        drawn[b, q] = greedy[b, q]
    np.testing.assert_array_equal(drawn, greedy)


@pytest.mark.parametrize("vocab, temperature", [(4096, 0.05), (4096, 1.0), (1000, 0.3)])
def test_filters_match_a_float64_sort_on_wide_vocabularies(vocab, temperature):
    """Random scores over a large vocabulary (a wide range at temperature 0.05, rounded
    logits for ties, a row half at -inf): the kept ids are the float64 sort's, but for ids
    whose mass above lies within float32 rounding of p."""
    rng = np.random.default_rng(vocab + int(100 * temperature))
    logits = rng.normal(size=(4, 2, vocab)).astype(np.float32) * 4
    logits[1] = np.round(logits[1])
    scaled = (logits / np.float32(temperature)).astype(np.float32)
    scaled[..., MASK] = -np.inf
    scaled[2, 0, : vocab // 2] = -np.inf
    top_k = np.array([0, 7, 50, vocab + 3], np.int32)
    top_p = np.array([0.9, 0.5, 0.95, 0.3], np.float32)
    out = np.asarray(jax.jit(filtered)(jnp.asarray(scaled), Filters(top_k, top_p)))
    for b in range(4):
        for q in range(2):
            s = scaled[b, q]
            expected = _kept(s, int(top_k[b]), float(top_p[b]))
            wrong = np.nonzero(np.isfinite(out[b, q]) != expected)[0]
            if wrong.size:  # only at the boundary, within float32 rounding
                w = np.where(_kept(s, int(top_k[b]), 1.0), np.exp(s - s.max()), 0.0)
                above = np.array([w[s > s[i]].sum() / w.sum() for i in wrong])
                np.testing.assert_allclose(above, top_p[b], rtol=1e-5, err_msg=f"{b}, {q}")


def test_a_filtered_sample_is_the_gumbel_argmax_over_the_kept():
    """`predict` with filters draws the token with the highest score + Gumbel noise among
    the kept ids (the noise `gumbel_noise` draws for the whole vocabulary); the confidence
    stays softmax(logits)[token]; top_k 1 and a tiny top_p give the argmax whatever the
    temperature; neutral filters give the unfiltered draw bit for bit."""
    logits = _logits(5)
    keys = jax.random.split(jax.random.key(7), 2)
    t = jnp.array([1.3, 0.6], jnp.float32)
    filters = Filters(jnp.array([4, 0], jnp.int32), jnp.array([1.0, 0.7], jnp.float32))
    token, confidence = jax.jit(lambda x: predict(x, t, keys, MASK, None, filters))(
        jnp.asarray(logits)
    )
    for b in range(2):
        noise = np.asarray(gumbel_noise(keys[b], logits.shape[1], jnp.arange(VOCAB), VOCAB))
        for q in range(logits.shape[1]):
            scaled = np.where(np.arange(VOCAB) == MASK, -np.inf, logits[b, q] / float(t[b]))
            kept = _kept(scaled.astype(np.float32), int(filters.top_k[b]), float(filters.top_p[b]))
            assert token[b, q] == np.argmax(np.where(kept, scaled + noise[q], -np.inf))
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.take_along_axis(p, np.asarray(token)[..., None], axis=-1)[..., 0]
    # fp32 logits near 500 (a row of `_logits`) are 3e-5 apart: their differences are that
    # coarse where the token is not the argmax
    np.testing.assert_allclose(confidence, expected, rtol=1e-4)
    # top_k 1 and a tiny top_p keep the highest score (and whatever ties it): the argmax
    greedy = np.asarray(predict(jnp.asarray(logits), None, None, MASK)[0])
    for narrow in (
        Filters(jnp.ones(2, jnp.int32), jnp.ones(2)),
        Filters(jnp.zeros(2, jnp.int32), jnp.full(2, 1e-6)),
    ):
        drawn = np.array(predict(jnp.asarray(logits), t, keys, MASK, None, narrow)[0])
        ties = {(0, 0): (9, 40), (1, 2): (15, 16)}  # `_logits`' ties for the top
        for (b, q), tied in ties.items():
            assert drawn[b, q] in tied
            drawn[b, q] = greedy[b, q]
        np.testing.assert_array_equal(drawn, greedy)
    neutral = Filters(jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.float32))
    free = predict(jnp.asarray(logits), t, keys, MASK)
    np.testing.assert_array_equal(
        predict(jnp.asarray(logits), t, keys, MASK, None, neutral)[0], free[0]
    )
    assert not (np.asarray(free[0]) == np.asarray(token)).all()


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (3, 0.6)])
def test_filters_over_a_split_vocabulary_match_one_device(top_k, top_p):
    """Each of 4 devices holds a quarter of the vocabulary: counts and probability sums
    above each candidate threshold are summed over the mesh, so the sample is one
    device's."""
    logits = jnp.asarray(_logits(6))
    keys = jax.random.split(jax.random.key(9), 2)
    t = jnp.array([0.9, 1.4], jnp.float32)
    filters = Filters(jnp.full(2, top_k, jnp.int32), jnp.full(2, top_p, jnp.float32))
    whole = jax.jit(lambda x: predict(x, t, keys, MASK, None, filters))(logits)
    split = _on_four_devices(lambda x: predict(x, t, keys, MASK, "model", filters), logits)
    np.testing.assert_array_equal(split[0], whole[0])
    np.testing.assert_allclose(split[1], whole[1], rtol=1e-6)


def test_filters_need_whole_logits():
    filters = Filters(jnp.ones(2, jnp.int32), jnp.ones(2, jnp.float32))
    with pytest.raises(ValueError, match="top_k/top_p need a step's whole logits; .* 16 vocab"):
        check_filters(filters, 16)
    check_filters(filters, None)
    check_filters(None, 16)


TAU = 0.875  # exactly a float32 and a float64: the reference compares in either


def _confidence_cases() -> tuple[np.ndarray, np.ndarray]:
    """[10, 12] confidences and masks with the cases a commit rule can get wrong: confidences
    all below 1e-5 (a near-uniform distribution over a 126k vocabulary), near ties below τ
    (within 1e-6 of the best), exact ties (the lower position first), one at τ itself and
    one a float32 step below it, a row without masks, a row with one mask, a row whose
    masked confidences are all -inf (position 0 unmasked), and random rows."""
    rng = np.random.default_rng(3)
    conf = rng.uniform(0, 1, (10, 12)).astype(np.float32)
    masked = rng.uniform(size=(10, 12)) < 0.7
    conf[0] = 8e-6 + 1e-8 * np.arange(12)[::-1]
    masked[0] = True
    conf[1] = 0.5
    conf[1, 3], conf[1, 7] = 0.500001, 0.5000005
    masked[1] = True
    conf[2, :] = 0.3
    masked[2] = True
    conf[3, :] = 0.1
    conf[3, 2] = TAU
    conf[3, 9] = np.nextafter(np.float32(TAU), np.float32(0))
    masked[3, [2, 9]] = True
    masked[4] = False
    masked[5] = False
    masked[5, 6] = True
    conf[8] = -np.inf
    masked[8] = True
    masked[8, 0] = False
    return conf, masked


@pytest.mark.parametrize("name", ["low_confidence", "threshold", "credit", "factor", "hierarchy"])
def test_commit_rules_match_the_reference(name):
    """Every commit rule against the plainly written numpy one, row by row: threshold and
    credit commit every masked position at or above τ and the single most confident one
    (never its near ties, nor a confidence a float32 step below τ), so a row of
    near-uniform confidences commits one position; τ as a row array or one float."""
    conf, masked = _confidence_cases()
    k = np.array([1, 2, 3, 1, 2, 1, 4, 2, 1, 3], np.int32)
    spec = DecoderSpec(name, factor=1.0, low_threshold=0.4)
    for threshold in (jnp.full((10, 1), TAU, jnp.float32), TAU):
        commit = np.asarray(
            decide(spec, jnp.asarray(conf), jnp.asarray(masked), threshold=threshold, k=k)
        )
        for row in range(10):
            expected = commit_rows(name, conf[row], masked[row], k=int(k[row]), tau=TAU, low=0.4)
            np.testing.assert_array_equal(commit[row], expected, err_msg=f"row {row}")
    if name in ("threshold", "credit"):
        assert commit[0].sum() == 1 and commit[0, 0]  # all below 1e-5: the best alone
        assert commit[1].sum() == 1 and commit[1, 3]  # near ties of the best stay masked
        assert commit[2].sum() == 1 and commit[2, 0]  # exact ties: the lowest position
        assert commit[3].tolist() == [i == 2 for i in range(12)]  # τ in, a step below out
        assert commit[8].sum() == 1 and commit[8, 1]  # all -inf: the first masked


@pytest.mark.parametrize("name", ["threshold", "hierarchy"])
def test_a_nan_confidence_is_never_committed(name):
    """NaN logits give NaN confidences: the rules pass over them (the generation then stops
    with its stalled-rows error), and a row's other masked positions commit as usual."""
    conf = np.full((2, 6), np.nan, np.float32)
    conf[1, 4] = 0.2
    masked = np.ones((2, 6), bool)
    commit = np.asarray(
        decide(DecoderSpec(name), jnp.asarray(conf), jnp.asarray(masked), threshold=TAU, k=None)
    )
    assert commit.tolist() == [[False] * 6, [i == 4 for i in range(6)]]
