"""LLaDA-MoE: parity with transformers' Qwen3-MoE made bidirectional, the two expert paths,
routing options, loading, and generation with every cache policy."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import djax
from djax.checkpoint import CheckpointError
from djax.config import from_hf_dict
from djax.models.kernel_choice import Kernels, Shapes
from djax.models.llada_moe import (
    COUNT_CHUNK,
    PAIRWISE_MAX,
    MoEBlock,
    experts_dense,
    experts_grouped,
    group_layout,
    ragged_mlp,
    route,
)

from torch_reference import MASK_ID, rel_error, torch_logits


@pytest.mark.parametrize("seq, path", [(20, "grouped"), (40, "dense")])
def test_fp32_parity_with_torch(moe_folder, seq, path):
    """XLA's two expert paths: grouped up to 64 tokens per forward, dense above."""
    folder, torch_model = moe_folder
    model = djax.load(folder, dtype=jnp.float32, moe_impl="xla")
    assert model.config.mask_token_id == MASK_ID  # from the tokenizer: config has none
    assert model.kernel_choice(Shapes.whole_sequence(2, seq)).refresh.layers.moe == path
    ids = np.random.default_rng(0).integers(4, 100, (2, seq))
    err = rel_error(np.asarray(djax.forward_logits(model, ids)), torch_logits(torch_model, ids))
    assert err <= 1e-5, err


def test_bf16_parity_with_torch(moe_folder):
    folder, torch_model = moe_folder
    model = djax.load(folder, dtype=jnp.bfloat16)
    ids = np.random.default_rng(1).integers(4, 100, (2, 20))
    err = rel_error(np.asarray(djax.forward_logits(model, ids)), torch_logits(torch_model, ids))
    assert err <= 2e-2, err


def test_fused_expert_layout(moe_model, moe_folder):
    gate_up = np.asarray(moe_model.params["ff_1"]["gate_up"])
    down = np.asarray(moe_model.params["ff_1"]["down"])
    assert gate_up.shape == (8, 64, 2, 32) and down.shape == (8, 32, 64)
    stored = load_file(str(moe_folder[0] / "model.safetensors"))
    np.testing.assert_array_equal(
        gate_up[5, :, 1, :], stored["model.layers.1.mlp.experts.5.up_proj.weight"].T
    )
    np.testing.assert_array_equal(
        down[3], stored["model.layers.1.mlp.experts.3.down_proj.weight"].T
    )


def _numpy_moe(x, router, bias, gate_up, down, top_k, normalise):
    logits = x @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    scores = p + (bias if bias is not None else 0)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        chosen = np.argsort(-scores[n], kind="stable")[:top_k]
        weights = scores[n, chosen]
        if normalise:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            h = x[n] @ gate_up[e].reshape(x.shape[1], -1)
            f = h.shape[-1] // 2
            act = h[:f] / (1 + np.exp(-h[:f])) * h[f:]
            out[n] += w * (act @ down[e])
    return out


@pytest.mark.parametrize("bias, normalise", [(False, False), (True, False), (True, True)])
def test_routing_and_expert_paths_match_numpy(bias, normalise):
    rng = np.random.default_rng(0)
    n, m, e, f, k = 24, 16, 8, 12, 3
    x = rng.normal(size=(n, m)).astype(np.float32)
    router = rng.normal(size=(m, e)).astype(np.float32)
    expert_bias = rng.uniform(0, 0.3, e).astype(np.float32) if bias else None
    gate_up = rng.normal(size=(e, m, 2, f)).astype(np.float32) * 0.3
    down = rng.normal(size=(e, f, m)).astype(np.float32) * 0.3
    ref = _numpy_moe(x.astype(np.float64), router, expert_bias, gate_up, down, k, normalise)
    weights, experts = route(
        jnp.asarray(x),
        jnp.asarray(router),
        None if expert_bias is None else jnp.asarray(expert_bias),
        k,
        normalise,
    )
    for run in (experts_dense, experts_grouped):
        out = run(jnp.asarray(x), weights, experts, jnp.asarray(gate_up), jnp.asarray(down), 0)
        assert rel_error(np.asarray(out), ref) < 1e-5, run.__name__


@pytest.mark.parametrize("p, n_groups", [(1, 1), (40, 5), (3072, 64), (4500, 7), (5120, 64)])
@pytest.mark.parametrize("align", [1, 8])
def test_group_layout_is_a_stable_sort_into_aligned_groups(p, n_groups, align):
    """`group_layout` against numpy's stable argsort, in one pass and in chunks (4,500 items:
    a padded last chunk; 5,120), with keys in every group and in the past-the-end
    group n_groups (pairs on other devices); some groups stay empty. At `align=1` it is the
    sort; at 8 each group starts at a multiple of 8 and its padding rows hold item 0."""
    assert PAIRWISE_MAX == 4096 and COUNT_CHUNK == 512
    key = np.random.default_rng(p).integers(0, n_groups + 1, p)
    key[key == n_groups // 2] = n_groups  # one group empty (all of them at n_groups=1)
    layout = jax.jit(group_layout, static_argnums=(1, 2))(jnp.asarray(key), n_groups, align)
    position, item, sizes = map(np.asarray, layout)
    counts = np.bincount(key, minlength=n_groups + 1)
    padded = -(-counts // align) * align
    np.testing.assert_array_equal(sizes, padded[:n_groups])
    starts = np.cumsum(padded) - padded
    order = np.argsort(key, kind="stable")
    expected = np.zeros(item.shape, int)
    for g in range(n_groups + 1):
        members = order[key[order] == g]
        expected[starts[g] : starts[g] + len(members)] = members
    np.testing.assert_array_equal(item, expected)
    np.testing.assert_array_equal(item[position], np.arange(p))
    assert item.shape[0] == p + n_groups * (align - 1) + (-(p + n_groups * (align - 1)) % align)
    if align == 1:
        np.testing.assert_array_equal(item, order)


def _routed_experts(seed, n=10, m=8, e=6, f=4, k=2, dtype=jnp.float32):
    """Random tokens [n, m], experts gate_up [e, m, 2, f] / down [e, f, m] scaled to unit
    output variance, and the top-k routing of the tokens (weights, expert ids)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, m)), dtype)
    gate_up = jnp.asarray(rng.normal(size=(e, m, 2, f)) / np.sqrt(m), dtype)
    down = jnp.asarray(rng.normal(size=(e, f, m)) / np.sqrt(f), dtype)
    weights, experts = route(x, jnp.asarray(rng.normal(size=(m, e)), dtype), None, k, False)
    return x, weights, experts, gate_up, down


def test_expert_paths_split_over_devices_sum_to_whole():
    x, weights, experts, gate_up, down = _routed_experts(1)
    whole = experts_grouped(x, weights, experts, gate_up, down, 0)
    for run in (experts_dense, experts_grouped):
        parts = sum(
            run(x, weights, experts, gate_up[s : s + 2], down[s : s + 2], s) for s in (0, 2, 4)
        )
        np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_every_expert_local_skips_the_locality_test(moe_model):
    """`first_expert=None` (every expert on this device, as a one-device MoEBlock passes it)
    gives the result of `first_expert=0` bit for bit without testing where each pair's
    expert lives: the one-device block's program (the grouped path, which tests locality
    where experts are split) has no `expert - first >= 0` (the test `0 <= expert - first <
    n_local`, dead work on one device)."""
    x, weights, experts, gate_up, down = _routed_experts(3)
    for run in (experts_dense, experts_grouped):
        at_zero = run(x, weights, experts, gate_up, down, 0)
        unsplit = run(x, weights, experts, gate_up, down, None)
        np.testing.assert_array_equal(np.asarray(unsplit), np.asarray(at_zero), run.__name__)
    cfg = moe_model.config
    block = MoEBlock(cfg, jnp.float32)
    rows = jnp.ones((1, 4, cfg.d_model), jnp.float32)
    params = block.init(jax.random.key(0), rows)
    grouped = functools.partial(block.apply, kernels=Kernels(moe="grouped"))
    jaxpr = str(jax.make_jaxpr(grouped)(params, rows))
    assert "= ge " not in jaxpr, jaxpr


def _mlp_unwritten_tail(x, source_rows, gate_up, down, group_sizes):
    """`ragged_mlp` that leaves rows past the groups as NaN, as a kernel may leave them
    unwritten."""
    out = ragged_mlp(x, source_rows, gate_up, down, group_sizes)
    inside = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(inside[:, None], out, jnp.nan)


def test_grouped_path_masks_rows_outside_the_groups():
    """With half the experts on this device, the other half's pairs sort past every group;
    whatever a kernel leaves there (NaN here) must not reach the output."""
    x, weights, experts, gate_up, down = _routed_experts(2)
    local = (gate_up[3:], down[3:])
    out = experts_grouped(x, weights, experts, *local, 3, mlp=_mlp_unwritten_tail)
    assert np.isfinite(np.asarray(out)).all()
    expected = experts_dense(x, weights, experts, *local, 3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_shared_expert_and_clip(moe_model):
    cfg = moe_model.config.replace(shared_expert_hidden=16, clip_qkv=0.05)
    block = MoEBlock(cfg, jnp.float32)
    x = jax.random.normal(jax.random.key(0), (1, 5, 64))
    params = block.init(jax.random.key(1), x)["params"]
    assert params["shared"]["gate_up"].shape == (64, 2, 16)
    routed = MoEBlock(cfg.replace(shared_expert_hidden=0), jnp.float32).apply(
        {"params": {k: v for k, v in params.items() if k != "shared"}}, x
    )
    shared = djax.models.layers.GatedMLP(16, jnp.float32).apply({"params": params["shared"]}, x)
    np.testing.assert_allclose(block.apply({"params": params}, x), routed + shared, rtol=1e-6)
    ids = np.arange(4, 20)[None]
    clipped = djax.forward_logits(
        dataclasses.replace(moe_model, config=cfg.replace(shared_expert_hidden=0)), ids
    )
    loose = djax.forward_logits(
        dataclasses.replace(moe_model, config=cfg.replace(shared_expert_hidden=0, clip_qkv=1e6)),
        ids,
    )
    np.testing.assert_allclose(loose, djax.forward_logits(moe_model, ids), rtol=1e-5, atol=1e-5)
    assert rel_error(np.asarray(clipped), np.asarray(loose)) > 1e-3


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "vicinity"])
def test_generates_with_every_cache_policy(moe_model, cache):
    config = djax.GenerationConfig(
        gen_length=16,
        block_length=8,
        threshold=0.5,
        cache=cache,
        vicinity_before=2,
        vicinity_after=2,
        refresh_every=0,
    )
    out = djax.generate(moe_model, [[0, 10, 11, 12], [0, 20]], config)
    assert out.answer_ids.shape == (2, 16) and not np.any(out.answer_ids == MASK_ID)
    if cache != "none":
        ref = djax.generate(
            moe_model, [[0, 10, 11, 12], [0, 20]], dataclasses.replace(config, refresh_every=1)
        )
        none = djax.generate(
            moe_model, [[0, 10, 11, 12], [0, 20]], dataclasses.replace(config, cache="none")
        )
        np.testing.assert_array_equal(ref.answer_ids, none.answer_ids)


def test_loading_errors(moe_folder, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(moe_folder[0], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.7.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="experts.7.down_proj"):
        djax.load(folder)
    config = json.loads((folder / "config.json").read_text())
    config["moe_router_enable_expert_bias"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mlp.expert_bias"):
        djax.load(folder)
    assert from_hf_dict(config).router_expert_bias
