"""LLaDA dense forward: parity with transformers' Llama made bidirectional, padding, and the
converted (orbax) folder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax import checkpoint

from torch_reference import make_llada_dense, rel_error, torch_logits


def test_fp32_parity_with_torch(dense_folder, dense_model):
    _, torch_model = dense_folder
    ids = np.random.default_rng(0).integers(4, 100, (2, 20))
    err = rel_error(
        np.asarray(djax.forward_logits(dense_model, ids)), torch_logits(torch_model, ids)
    )
    assert err <= 1e-5, err


def test_bf16_parity_with_torch(dense_folder):
    folder, torch_model = dense_folder
    model = djax.load(folder, dtype=jnp.bfloat16)
    assert model.params["attn_0"]["qkv"].dtype == jnp.bfloat16
    ids = np.random.default_rng(1).integers(4, 100, (2, 20))
    err = rel_error(np.asarray(djax.forward_logits(model, ids)), torch_logits(torch_model, ids))
    assert err <= 2e-2, err


def test_padding_parity_with_torch(dense_folder, dense_model):
    _, torch_model = dense_folder
    ids = np.random.default_rng(2).integers(4, 100, (2, 12))
    valid = np.ones_like(ids, bool)
    valid[1, :5] = False  # left padding
    ours = np.asarray(djax.forward_logits(dense_model, ids, valid))
    ref = torch_logits(torch_model, ids, valid)
    assert rel_error(ours[valid], ref[valid]) <= 1e-5


def test_left_padded_batch_matches_rows_alone(dense_model):
    rng = np.random.default_rng(3)
    rows = [rng.integers(4, 100, n) for n in (9, 4, 13)]
    width = max(len(r) for r in rows)
    ids = np.full((3, width), 1)
    valid = np.zeros((3, width), bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        valid[i, width - len(r) :] = True
    batch = np.asarray(djax.forward_logits(dense_model, ids, valid))
    for i, r in enumerate(rows):
        alone = np.asarray(djax.forward_logits(dense_model, r[None]))[0]
        np.testing.assert_allclose(batch[i, width - len(r) :], alone, rtol=1e-5, atol=1e-5)


def test_mha_and_single_file(tmp_path):
    torch_model = make_llada_dense(
        tmp_path, n_heads=2, n_kv_heads=2, d_model=32, mlp_hidden=40, n_layers=3, seed=7
    )
    model = djax.load(tmp_path, dtype=jnp.float32)
    ids = np.random.default_rng(4).integers(4, 100, (1, 16))
    assert (
        rel_error(np.asarray(djax.forward_logits(model, ids)), torch_logits(torch_model, ids))
        <= 1e-5
    )


def test_converted_folder_gives_identical_logits(dense_folder, dense_model, tmp_path):
    folder, _ = dense_folder
    out = tmp_path / "converted"
    djax.convert(folder, out, dtype=jnp.float32, progress=False)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    converted = djax.load(out, dtype=jnp.float32)
    # stored uncompressed (zstd would shrink these random fp32 weights below their bytes)
    files = (out / checkpoint.PARAMS_DIR).rglob("*")
    stored = sum(path.stat().st_size for path in files if path.is_file())
    assert stored >= sum(a.nbytes for a in jax.tree.leaves(converted.params))
    ids = np.random.default_rng(5).integers(4, 100, (2, 10))
    np.testing.assert_array_equal(
        np.asarray(djax.forward_logits(converted, ids)),
        np.asarray(djax.forward_logits(dense_model, ids)),
    )
    with pytest.raises(FileExistsError, match="is not empty; pass overwrite=True"):
        djax.convert(folder, out, progress=False)
    djax.convert(folder, out, dtype=jnp.bfloat16, overwrite=True, progress=False)
    # without a dtype: the platform's default, fp32 on the CPU and bf16 on accelerators
    default = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert djax.load(out).params["embed"].dtype == default
    assert djax.load(out, dtype=jnp.bfloat16).params["embed"].dtype == jnp.bfloat16


def test_forward_logits_input_errors(dense_model):
    with pytest.raises(ValueError, match="token_ids hold values in \\[4, 500\\]"):
        djax.forward_logits(dense_model, [[4, 500]])
    with pytest.raises(ValueError, match="attention_mask has shape \\(1, 3\\); expected"):
        djax.forward_logits(dense_model, [[4, 5]], [[1, 1, 1]])
    with pytest.raises(ValueError, match="expected \\[batch, seq\\] integers"):
        djax.forward_logits(dense_model, [[0.5, 1.5]])


def test_attention_impl_names(dense_model):
    ids = np.arange(4, 12)[None]
    auto = djax.forward_logits(dense_model.with_options(attention_impl="auto"), ids)
    np.testing.assert_array_equal(
        auto, djax.forward_logits(dense_model.with_options(attention_impl="xla"), ids)
    )  # auto is XLA on the CPU
    with pytest.raises(ValueError, match="attention_impl='flash'; expected one of"):
        djax.forward_logits(dense_model.with_options(attention_impl="flash"), ids)


@pytest.mark.parametrize("with_buffers", [False, True])
def test_hidden_rows_match_the_full_forward(dense_model, with_buffers):
    """Asking for `hidden_len` rows (the last layer then runs its queries, attention output
    and MLP on those rows only) gives exactly those rows of the full forward, and the same
    K/V for every layer."""
    import jax

    from djax.kv_cache import init_buffers
    from djax.models import build_module
    from djax.models.layers import Window

    config, params = dense_model.config, dense_model.params
    module = build_module(config, jnp.float32)
    ids = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    t = ids.shape[1]
    x = module.apply({"params": params}, ids, method="embed")
    kv, window, seq = None, Window(), t
    if with_buffers:  # a window of the 10 rows at position 4 of a 20-position buffer
        seq, window = 20, Window(jnp.int32(4))
        kv = init_buffers(params, config.n_layers, 1, seq, jnp.float32)
    positions = window.start + jnp.arange(t)[None]
    key_valid = jnp.ones((1, seq), bool)

    def run(*rows):
        return module.apply({"params": params}, x, positions, key_valid, kv, window, *rows)

    full, full_kv = jax.jit(run)()
    part, part_kv = jax.jit(lambda start: run(start, 4))(jnp.int32(3))
    np.testing.assert_allclose(part, full[:, 3:7], rtol=1e-5, atol=1e-5)
    for ours, ref in zip(jax.tree.leaves(part_kv), jax.tree.leaves(full_kv), strict=True):
        np.testing.assert_array_equal(ours, ref)
