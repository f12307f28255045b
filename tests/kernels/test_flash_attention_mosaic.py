"""The split-K/V attention kernel (`flash_attention_mosaic`), run by Mosaic
GPU's interpreter on the CPU, against fp32 einsum attention: key padding, several key
slices merged (by warpgroups of one CTA in the kernel, across CTAs in XLA), GQA, windows
and buffers that are not multiples of the tiles, the layer taking it, per-head masks (sparse
attention's form); its errors and tiles; its lowering for a Hopper
GPU at LLaDA-8B's and LLaDA-MoE's shapes on any host; on a GPU the compiled kernel at those
shapes."""

import jax
import jax.numpy as jnp
import pytest

from djax.kernels import flash_attention_mosaic
from djax.kernels.flash_attention_mosaic import Tiles, split_kv_attention, tiles_for
from djax.models import layers

BF16 = jnp.bfloat16


def _problem(b, t, n, kv, d, s, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, t, n, d), dtype)
    k = jax.random.normal(keys[1], (b, s, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, s, kv, d), dtype)
    return q, k, v


def _einsum_attention(q, k, v, key_valid):
    b, t, n, d = q.shape
    kv = k.shape[2]
    return layers.attend(q.reshape(b, t, kv, n // kv, d), k, v, key_valid, "xla").reshape(q.shape)


def _rel_error(ours, ref):
    ours = ours.astype(jnp.float32)
    return float(jnp.linalg.norm(ours - ref) / jnp.linalg.norm(ref))


def _padded_rows(s, pad):
    """key_valid [2, s]: the first row whole, the second left-padded by `pad` keys."""
    return jnp.arange(s)[None, :] >= jnp.array([[0], [pad]])


@pytest.mark.parametrize(
    "b, t, n, kv, s, pad, tiles",
    [
        # one slice (bf16 out, no merge), 3 steps through a ring of 2 slots
        (1, 32, 2, 2, 160, 0, Tiles(splits=1, stages=2)),
        # GQA (group 2); 70 queries (2 query tiles, q padded to 72 rows, 6 rows stored from
        # the last); 180 keys (K/V padded to 184) in 2 slices of 128, the second slice's last
        # step wholly past the buffer's end, the second row's first slice all padding
        (2, 70, 2, 1, 180, 140, Tiles(splits=2, stages=2)),
        # 3 warpgroups merged in the CTA, GQA (group 2): 300 keys (K/V padded to 304) in 3
        # slices of 2 steps through a ring of 1 slot, the second row's first slice all
        # padding, the last slice's last step wholly past the buffer's end
        (2, 32, 2, 1, 300, 140, Tiles(stages=1, warpgroups=3)),
        # both merges: 2 CTAs of 2 warpgroups (4 slices of one 64-key step, the last wholly
        # past the keys); 70 queries (2 query tiles, 6 rows stored from the last)
        (1, 70, 1, 1, 180, 0, Tiles(splits=2, stages=2, warpgroups=2)),
    ],
)
def test_matches_einsum_attention(b, t, n, kv, s, pad, tiles):
    q, k, v = _problem(b, t, n, kv, 64, s, BF16, seed=3)
    key_valid = _padded_rows(s, pad)[:b]
    ours = split_kv_attention(q, k, v, key_valid, tiles=tiles, interpret=True)
    assert ours.shape == q.shape and ours.dtype == BF16
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), key_valid)
    assert _rel_error(ours, ref) < 5e-3
    if b == 2:  # the padded row alone: its keys are in the second slice only
        assert _rel_error(ours[1], ref[1]) < 5e-3


def test_layer_attends_with_the_kernel():
    """`layers.attend(..., "split_kv")` takes the kernel (at `tiles_for`: one CTA
    stepping through the keys 128 at a time) and gives XLA's attention on the same bf16
    inputs."""
    q, k, v = _problem(1, 16, 2, 2, 64, 256, BF16, seed=4)
    key_valid = jnp.arange(256)[None, :] >= 20
    grouped = q.reshape(1, 16, 2, 1, 64)
    ours = layers.attend(grouped, k, v, key_valid, "split_kv")
    assert tiles_for(16, 256, 2, head_dim=64) == Tiles(block_k=128, splits=1, stages=2)
    ref = layers.attend(grouped, k, v, key_valid, "xla")
    assert ours.shape == grouped.shape and _rel_error(ours, ref.astype(jnp.float32)) < 1e-2


def test_tiles_for_blocks_and_refreshes():
    """Refreshes and large batches (96 CTAs or more): one slice, 2 stages. Blocks: one
    warpgroup per CTA, 128-key steps through 2 stages, the keys cut across CTAs past 640
    each; smaller steps, then one stage, for head dims whose rings do not fit; all within
    shared memory (where warpgroups merge, the rings' memory taken again by the merge's
    tiles)."""
    refresh = Tiles(block_k=64, splits=1, stages=2)
    assert tiles_for(384, 384, 32) == refresh
    assert tiles_for(32, 1280, 8 * 32) == refresh
    assert tiles_for(32, 384, 32) == Tiles(block_k=128, splits=1, stages=2)
    assert tiles_for(32, 384, 16) == tiles_for(32, 640, 32) == tiles_for(32, 384, 32)
    assert tiles_for(32, 641, 32) == Tiles(block_k=128, splits=2, stages=2)
    assert tiles_for(32, 4096, 16) == Tiles(block_k=128, splits=7, stages=2)
    assert tiles_for(32, 384, 32, head_dim=256) == Tiles(block_k=64, splits=1, stages=2)
    assert tiles_for(32, 384, 32, head_dim=384) == Tiles(block_k=64, splits=1, stages=1)
    for t, s, heads, d in ((32, 384, 32, 128), (32, 1280, 32, 128), (32, 384, 32, 384)):
        tiles = tiles_for(t, s, heads, head_dim=d)
        assert tiles.shared_bytes(d, 2, tiles.splits > 1) <= 224 * 1024
    assert Tiles(stages=2, warpgroups=3).shared_bytes(128, 2, True) <= 224 * 1024
    assert Tiles(stages=3, warpgroups=3).shared_bytes(128, 2, False) > 224 * 1024


def test_shape_dtype_and_tile_errors():
    q, k, v = _problem(1, 8, 4, 2, 64, 32, BF16)
    valid = jnp.ones((1, 32), bool)
    with pytest.raises(ValueError, match=r"q \(1, 8, 4, 96\).*head dim that is a multiple of 64"):
        split_kv_attention(jnp.zeros((1, 8, 4, 96), BF16), k, v, valid)
    with pytest.raises(ValueError, match="heads a multiple of kv heads"):
        split_kv_attention(q[:, :, :3], k, v, valid)
    with pytest.raises(ValueError, match=r"key_valid \(1, 31\)"):
        split_kv_attention(q, k, v, valid[:, :31])
    with pytest.raises(ValueError, match="q float32, keys bfloat16.*all bfloat16 or all float16"):
        split_kv_attention(q.astype(jnp.float32), k, v, valid)
    with pytest.raises(ValueError, match="block_k must be a multiple of 64"):
        split_kv_attention(q, k, v, valid, tiles=Tiles(block_k=32))
    with pytest.raises(ValueError, match="warpgroups=4.*warpgroups 1 to 3"):
        split_kv_attention(q, k, v, valid, tiles=Tiles(warpgroups=4))
    long_k, long_v = (jnp.zeros((1, 4096, 2, 64), BF16) for _ in range(2))
    with pytest.raises(ValueError, match="bytes of shared memory; at most 229376"):
        split_kv_attention(q, long_k, long_v, jnp.ones((1, 4096), bool), tiles=Tiles(stages=16))
    assert flash_attention_mosaic.fits(128) and not flash_attention_mosaic.fits(96)


def _per_head_reference(q, k, v, valid):
    """fp32 attention of q [b, t, n, d] to k, v [b, s, kv, d], each query head masked by its
    kv head's row of valid [b, kv, s] (a head with no valid key gets zeros)."""
    b, t, n, d = q.shape
    kv = k.shape[2]
    grouped = q.astype(jnp.float32).reshape(b, t, kv, n // kv, d)
    scores = jnp.einsum("btkgd,bskd->btkgs", grouped, k.astype(jnp.float32)) * d**-0.5
    scores = jnp.where(valid[:, None, :, None, :], scores, -jnp.inf)
    probs = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))
    return jnp.einsum("btkgs,bskd->btkgd", probs, v.astype(jnp.float32)).reshape(q.shape)


def test_per_head_mask():
    """Each kv head's own mask ([b, kv_heads, s], as sparse attention's kept rows take it;
    one (row, kv head) with no valid key), in one slice and in 2 slices merged: the masked
    attention of every query head whose kv head has a valid key."""
    b, t, n, kv, d, s = 2, 32, 4, 2, 64, 200
    q, k, v = _problem(b, t, n, kv, d, s, BF16, seed=5)
    valid = jax.random.bernoulli(jax.random.key(6), 0.5, (b, kv, s)).at[1, 0].set(False)
    ref = _per_head_reference(q, k, v, valid)
    for tiles in (Tiles(splits=1, stages=2), Tiles(splits=2, stages=2)):
        ours = split_kv_attention(q, k, v, valid, tiles=tiles, interpret=True)
        assert ours.shape == q.shape and ours.dtype == BF16
        # batch row 1's query heads 0 and 1 (kv head 0) have no valid key
        assert _rel_error(ours[0], ref[0]) < 1e-2, tiles
        assert _rel_error(ours[1, :, 2:], ref[1, :, 2:]) < 1e-2, tiles
    shared = split_kv_attention(q, k, v, valid[:, 1], tiles=Tiles(splits=2), interpret=True)
    assert _rel_error(shared, ref) > 0.1  # one mask per row is another attention


@pytest.mark.parametrize("s", [200, 203])
def test_queries_attend_to_the_leading_rows_of_a_larger_buffer(s):
    """A pool's leading slots step (`djax.phase`): q's 2 rows against keys and values of 5
    rows attend to rows 0 and 1 as they lie, whatever the others hold (NaN here, never read),
    in one slice and in 2 slices merged, per row and per head masks, with keys a multiple
    of 8 or padded to one (q's rows alone then); the layer's `attend` takes the same
    buffers on XLA's path. Fewer buffer rows than q's is refused."""
    b, rows, t, n, kv, d = 2, 5, 32, 4, 2, 64
    q_all, k, v = _problem(rows, t, n, kv, d, s, BF16, seed=11)
    q = q_all[:b]
    k_nan, v_nan = (x.at[b:].set(jnp.nan) for x in (k, v))
    valid = _padded_rows(s, 70)
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k[:b], v[:b])), valid)
    per_head = jax.random.bernoulli(jax.random.key(12), 0.5, (b, kv, s)).at[:, :, 0].set(True)
    head_ref = _per_head_reference(q, k[:b], v[:b], per_head)
    for tiles in (Tiles(splits=1, stages=2), Tiles(splits=2, stages=2)):
        ours = split_kv_attention(q, k_nan, v_nan, valid, tiles=tiles, interpret=True)
        assert ours.shape == q.shape and _rel_error(ours, ref) < 1e-2, tiles
        ours = split_kv_attention(q, k_nan, v_nan, per_head, tiles=tiles, interpret=True)
        assert _rel_error(ours, head_ref) < 1e-2, tiles
    grouped = q.astype(jnp.float32).reshape(b, t, kv, n // kv, d)
    xla = layers.attend(grouped, k_nan.astype(jnp.float32), v_nan.astype(jnp.float32), valid)
    assert _rel_error(xla.reshape(q.shape), ref) < 1e-5
    with pytest.raises(ValueError, match=r"expected keys and values \[≥ 5, s, kv_heads, 64\]"):
        split_kv_attention(q_all, k[:b], v[:b], jnp.ones((rows, s), bool))


@pytest.mark.parametrize(
    "tiles, per_head",
    [
        (Tiles(splits=1, stages=2), False),  # one slice: its loop ends at the last valid step
        # 4 slices of 64 keys (2 CTAs x 2 warpgroups): those wholly past a row's keys run no
        # step, weighted 0 in both merges
        (Tiles(splits=2, stages=2, warpgroups=2), False),
        (Tiles(splits=1, stages=1), True),  # each kv head stops at its own last valid key
    ],
)
def test_steps_past_the_last_valid_key_are_not_read(tiles, per_head):
    """Right-padded rows (the server's layout), one whose valid keys end in its first step:
    every key and value of a 64-key step wholly past its row's (or kv head's) last valid key
    is NaN, which any read would carry into the output; the output is the attention over
    the valid keys. The steps the loop skips are padding, whose probabilities beside a valid
    key are exactly 0, so skipping them changes no result."""
    b, t, n, s = 2, 32, 4, 256
    kv = 2 if per_head else 1
    q, k, v = _problem(b, t, n, kv, 64, s, BF16, seed=7)
    counts = jnp.array([[70, 250], [10, 129]] if per_head else [[70], [10]])  # [b, kv or 1]
    ends = -(-counts // 64) * 64  # the end of each one's last step holding a valid key
    position = jnp.arange(s)[None, :, None]  # [1, s, 1] against [b, 1, kv or 1]
    unread = (position >= ends[:, None, :])[..., None]  # [b, s, kv or 1, 1]
    valid = position[:, :, 0][:, None, :] < counts[:, :, None]  # [b, kv or 1, s]
    valid = valid if per_head else valid[:, 0]
    k_nan, v_nan = (jnp.where(unread, jnp.nan, x).astype(BF16) for x in (k, v))
    ours = split_kv_attention(q, k_nan, v_nan, valid, tiles=tiles, interpret=True)
    ref = (_per_head_reference if per_head else _einsum_attention)(
        *(x.astype(jnp.float32) for x in (q, k, v)), valid
    )
    assert bool(jnp.isfinite(ours.astype(jnp.float32)).all())
    assert _rel_error(ours, ref) < 1e-2


@pytest.mark.parametrize(
    "b, t, heads, s, tiles",
    [
        (1, 32, 32, 384, None),  # LLaDA-8B block: one CTA of 128-key steps
        (1, 32, 32, 384, Tiles(stages=2, warpgroups=3)),  # 3 warpgroups merged in the CTA
        (1, 32, 32, 384, Tiles(stages=1, warpgroups=2, block_k=128)),  # 2 warpgroups
        (1, 32, 32, 384, Tiles(splits=3, stages=2)),  # 3 CTAs merged in XLA
        (1, 32, 32, 1280, None),  # 2 CTAs merged in XLA
        (1, 32, 32, 1280, Tiles(splits=2, stages=2, warpgroups=3)),  # both merges
        (8, 32, 32, 640, None),  # LLaDA-8B block at batch 8, one slice
        (1, 384, 32, 384, None),  # LLaDA-8B refresh
        (1, 32, 16, 384, None),  # LLaDA-MoE block
        (1, 200, 16, 1020, Tiles(splits=2)),  # LLaDA-MoE window: rows padded to 8s, 2 slices
    ],
)
def test_lowers_for_hopper(b, t, heads, s, tiles):
    """The kernel lowers to Mosaic GPU's custom call for CUDA under warpgroup semantics, as
    jax 0.11 lowers it (WGMMA shapes and operands, inferred layouts and shared-memory
    transforms, TMA slices are checked here, on any host; only the compile to PTX needs the
    GPU)."""
    args = [
        jax.ShapeDtypeStruct((b, t, heads, 128), BF16),
        *(jax.ShapeDtypeStruct((b, s, heads, 128), BF16) for _ in range(2)),
        jax.ShapeDtypeStruct((b, s), jnp.bool_),
    ]
    run = lambda q, k, v, m: split_kv_attention(q, k, v, m, tiles=tiles, interpret=False)  # noqa: E731
    assert "mosaic_gpu" in jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("b", [1, 4])
def test_per_head_masks_lower_for_hopper(b):
    """Sparse attention's cached step at LLaDA-8B's shapes (32 heads and kv heads, head dim
    128, a 32-query block, keep 0.25 of 8,192 + 256 keys and the block's 32 rows: 2,112 + 32 +
    64 + 32 = 2,240 slots) with per-head masks lowers for CUDA: one slice of 16-bit outputs
    (batch 4), 4 CTAs of fp32 partials (batch 1)."""
    args = [
        jax.ShapeDtypeStruct((b, 32, 32, 128), BF16),
        *(jax.ShapeDtypeStruct((b, 2240, 32, 128), BF16) for _ in range(2)),
        jax.ShapeDtypeStruct((b, 32, 2240), jnp.bool_),
    ]
    assert tiles_for(32, 2240, b * 32).splits == (1 if b == 4 else 4)
    run = lambda q, k, v, m: split_kv_attention(q, k, v, m, interpret=False)  # noqa: E731
    assert "mosaic_gpu" in jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowers_with_scalar_default_barriers(monkeypatch):
    """jax 0.11.2 declares a barrier without `num_barriers` as a scalar ref, which `.at[0]`
    may not index: with that default imposed on jax 0.10, the kernel (3 warpgroups merged
    in the CTA, 2 CTAs merged in XLA) still lowers, every barrier's count named."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    barrier, made = plgpu.Barrier, []

    def scalar_by_default(**kwargs):
        made.append(kwargs)
        return barrier(**{"num_barriers": (), **kwargs})

    monkeypatch.setattr(plgpu, "Barrier", scalar_by_default)
    args = [
        jax.ShapeDtypeStruct((1, 32, 8, 128), BF16),
        *(jax.ShapeDtypeStruct((1, 896, 8, 128), BF16) for _ in range(2)),
        jax.ShapeDtypeStruct((1, 896), jnp.bool_),
    ]
    tiles = Tiles(splits=2, stages=2, warpgroups=3)
    run = lambda q, k, v, m: split_kv_attention(q, k, v, m, tiles=tiles, interpret=False)  # noqa: E731
    assert "mosaic_gpu" in jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert made and all("num_barriers" in kwargs for kwargs in made)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("t, s", [(32, 384), (32, 1000), (384, 384), (70, 1020)])
def test_compiled_kernel_on_gpu(t, s):
    """On a Hopper GPU: the compiled kernel at the model's shapes (bf16, head dim 128, GQA
    group 2, a left-padded row) at `tiles_for` (at 1000 and 1020 keys 2 CTAs merged in
    XLA), one slice, 3 slices of 128-key steps (at 1000 keys the last step wholly past the
    buffer's end), 3 warpgroups merged in the CTA and 2 CTAs of 2 warpgroups, against fp32
    einsums."""
    q, k, v = _problem(2, t, 16, 8, 128, s, BF16, seed=2)
    key_valid = _padded_rows(s, 100)
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), key_valid)
    merged = (Tiles(stages=1, warpgroups=3), Tiles(splits=2, stages=2, warpgroups=2))
    for tiles in (None, Tiles(splits=1), Tiles(block_k=128, splits=3, stages=2), *merged):
        ours = split_kv_attention(q, k, v, key_valid, tiles=tiles)
        assert _rel_error(ours, ref) <= 1e-2, (tiles, _rel_error(ours, ref))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernel_reads_no_step_past_a_rows_keys_on_gpu():
    """On a Hopper GPU: a serving block call's rows (right-padded to 1,024 keys, of 1,000,
    300, 64 and 5 valid keys; bf16, head dim 128, GQA group 2), NaN in every 128 keys wholly
    past a row's last 128-key step holding a valid key, at `tiles_for` (2 CTAs of 128-key
    steps), 3 CTAs of 128-key steps (some wholly past a row's keys) and 2 CTAs of 2
    warpgroups of 64-key steps: the attention over the valid keys, no NaN."""
    s, counts = 1024, jnp.array([1000, 300, 64, 5])
    q, k, v = _problem(4, 32, 16, 8, 128, s, BF16, seed=9)
    valid = jnp.arange(s)[None, :] < counts[:, None]
    unread = (jnp.arange(s)[None, :] >= -(-counts[:, None] // 128) * 128)[:, :, None, None]
    k_nan, v_nan = (jnp.where(unread, jnp.nan, x).astype(BF16) for x in (k, v))
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), valid)
    tilings = (
        None,
        Tiles(block_k=128, splits=3, stages=2),
        Tiles(splits=2, stages=2, warpgroups=2),
    )
    for tiles in tilings:
        ours = split_kv_attention(q, k_nan, v_nan, valid, tiles=tiles)
        assert bool(jnp.isfinite(ours.astype(jnp.float32)).all()), tiles
        assert _rel_error(ours, ref) <= 1e-2, (tiles, _rel_error(ours, ref))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_kernel_reads_the_leading_rows_of_a_pool_on_gpu():
    """On a Hopper GPU: 8 of a 32-slot pool's rows step (the phase scheduler at low load;
    bf16, head dim 128, GQA group 2, 1,024 keys, rows of 1,000 to 5 valid keys), the pool's
    other rows NaN: the attention of the 8 over their own rows, no NaN, at `tiles_for`."""
    s, counts = 1024, jnp.array([1000, 300, 64, 5, 1024, 512, 77, 640])
    q, k, v = _problem(32, 32, 16, 8, 128, s, BF16, seed=13)
    q = q[:8]
    k_nan, v_nan = (x.at[8:].set(jnp.nan) for x in (k, v))
    valid = jnp.arange(s)[None, :] < counts[:, None]
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k[:8], v[:8])), valid)
    ours = split_kv_attention(q, k_nan, v_nan, valid)
    assert bool(jnp.isfinite(ours.astype(jnp.float32)).all())
    assert _rel_error(ours, ref) <= 1e-2, _rel_error(ours, ref)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("b", [1, 4])
def test_compiled_per_head_masks_on_gpu(b):
    """On a Hopper GPU: the compiled kernel at sparse attention's LLaDA-8B shape (32 heads and
    kv heads, head dim 128, 2,240 slots; 4 CTAs at batch 1, one slice at batch 4), each kv
    head masked by its own row (three quarters valid, one head none), against fp32 einsums
    on every head with a valid key."""
    t, n, s, d = 32, 32, 2240, 128
    q, k, v = _problem(b, t, n, n, d, s, BF16, seed=7)
    valid = jax.random.bernoulli(jax.random.key(8), 0.75, (b, n, s)).at[0, 5].set(False)
    ours = split_kv_attention(q, k, v, valid).astype(jnp.float32)
    ref = _per_head_reference(q, k, v, valid)
    live = jnp.ones((b, 1, n, 1), bool).at[0, 0, 5].set(False)
    error = jnp.linalg.norm(jnp.where(live, ours - ref, 0)) / jnp.linalg.norm(ref)
    assert float(error) <= 1e-2


def _dequantised(rows, shape):
    """`QuantizedRows` of an attention output (values [b, t, n · d], scales [n, b · t]) back
    to fp32 [b, t, n, d]."""
    b, t, n, d = shape
    values = rows.values.astype(jnp.float32).reshape(b * t, n, d)
    return (values * rows.scale.T[..., None]).reshape(shape)


def _check_e4m3_heads(rows, ref, dtype):
    """`rows` (an `out_fp8` output) hold each row of each head of `ref` [b, t, n, d] fp32
    quantised on its own: a scale of its largest |value| / 448 (to the kernel's own
    rounding) and values within e4m3's half step."""
    b, t, n, d = ref.shape
    assert rows.values.shape == (b, t, n * d) and rows.values.dtype == jnp.float8_e4m3fn
    assert rows.scale.shape == (n, b * t) and rows.dtype == dtype
    peak = jnp.max(jnp.abs(ref), axis=-1).reshape(b * t, n).T
    assert jnp.allclose(rows.scale, peak / 448, rtol=2e-2)
    back = _dequantised(rows, ref.shape)
    step = rows.scale.T.reshape(b, t, n, 1)
    assert jnp.all(jnp.abs(back - ref) <= 2**-4 * jnp.abs(ref) + step * 2**-8 + 0.02 * step * 448)
    assert _rel_error(back, ref) < 0.05


@pytest.mark.parametrize(
    "tiles",
    [
        None,  # one CTA a head: the kernel writes the e4m3 rows and their scales
        Tiles(block_k=64, splits=2, stages=2),  # 2 CTAs merged in XLA, then quantised
        Tiles(stages=1, warpgroups=2),  # 2 warpgroups merged in the CTA, then quantised
    ],
)
def test_e4m3_output_for_the_fp8_product(tiles):
    """`out_fp8`: the output as the fp8 output product takes it, each row of each head (128
    features) quantised on its own (Mosaic GPU's interpreter off GPUs, compiled on them);
    70 queries (2 query tiles; their scales' rows padded to 72 inside);
    a head 64x larger than the others gets a 64x scale and leaves theirs alone."""
    q, k, v = _problem(2, 70, 4, 2, 128, 200, BF16, seed=4)  # 2 query tiles
    v = v.at[:, :, 1].multiply(64)  # kv head 1: query heads 2 and 3
    key_valid = _padded_rows(200, 50)
    # compiled on a GPU (Mosaic GPU's interpreter there has hung on warpgroups that wait)
    rows = split_kv_attention(q, k, v, key_valid, tiles=tiles, out_fp8=True)
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), key_valid)
    _check_e4m3_heads(rows, ref, BF16)
    assert jnp.all(rows.scale[2:] > 16 * jnp.max(rows.scale[:2]))
    with pytest.raises(ValueError, match="an e4m3 output takes heads of 128 features"):
        split_kv_attention(
            *_problem(1, 8, 2, 2, 64, 64, BF16), jnp.ones((1, 64), bool), out_fp8=True
        )


def test_e4m3_output_lowers_for_hopper():
    """LLaDA-8B's block (32 queries, 32 heads of 128, 384 keys) with an e4m3 output lowers
    for CUDA: the fp32 -> e4m3 conversion and the scales' stores in the kernel."""
    args = [
        jax.ShapeDtypeStruct((1, 32, 32, 128), BF16),
        *(jax.ShapeDtypeStruct((1, 384, 32, 128), BF16) for _ in range(2)),
        jax.ShapeDtypeStruct((1, 384), jnp.bool_),
    ]

    def run(q, k, v, m):
        rows = split_kv_attention(q, k, v, m, interpret=False, out_fp8=True)
        return rows.values, rows.scale

    assert "mosaic_gpu" in jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("b, s", [(1, 384), (8, 640), (1, 1280)])
def test_compiled_e4m3_output_on_gpu(b, s):
    """On a Hopper GPU: LLaDA-8B's block (32 queries, 32 heads of 128) with an e4m3 output,
    one CTA a head (384 and 640 keys) and 2 CTAs merged in XLA (1,280), against fp32
    einsums quantised per row and head."""
    q, k, v = _problem(b, 32, 32, 32, 128, s, BF16, seed=5)
    key_valid = jnp.ones((b, s), bool)
    rows = split_kv_attention(q, k, v, key_valid, out_fp8=True)
    ref = _einsum_attention(*(a.astype(jnp.float32) for a in (q, k, v)), key_valid)
    _check_e4m3_heads(rows, ref, BF16)
