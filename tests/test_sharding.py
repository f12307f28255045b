"""Tensor and expert parallelism on 8 fake CPU devices (set in conftest.py): sharded logits
and generated tokens match the single-device run."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices

import djax
from djax.sharding import make_mesh, param_specs

from torch_reference import make_llada_dense, rel_error

pytestmark = needs_devices

PROMPTS = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]
BASE = djax.GenerationConfig(
    gen_length=16,
    block_length=8,
    steps=8,
    threshold=0.5,
    factor=2.0,
    vicinity_before=2,
    vicinity_after=2,
    vicinity_warmup=2,
)
COMBOS = [
    ("low_confidence", "none"),
    ("threshold", "prefix"),
    ("credit", "dual"),
    ("hierarchy", "vicinity"),
    ("factor", "dual"),
    ("random", "dual"),
]


@pytest.fixture(scope="module")
def dense4(tmp_path_factory):
    """Dense with 8 heads and 4 kv heads, so TP up to 4 splits whole kv heads."""
    folder = tmp_path_factory.mktemp("dense4")
    make_llada_dense(folder, n_heads=8, n_kv_heads=4, head_scale=6.0, seed=3)
    return folder


@pytest.fixture(scope="module")
def moe2(tmp_path_factory):
    """LLaDA-MoE (8 heads, 8 experts top-2) of two layers: the dense layer 0 and an MoE
    layer, each split over the mesh (conftest's third layer, another MoE one, would only
    lengthen each compile). Returns the folder and the single-device model."""
    from torch_reference import make_llada_moe

    folder = tmp_path_factory.mktemp("moe2")
    make_llada_moe(folder, dense_layers=(0,), n_layers=2, head_scale=6.0, seed=2)
    return folder, djax.load(folder, dtype=jnp.float32)


def _ids():
    ids = np.random.default_rng(0).integers(4, 100, (2, 14))
    valid = np.ones_like(ids, bool)
    valid[1, :4] = False
    return ids, valid


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_dense(dense4, tp):
    """Every decoder and cache mode at TP 2; at TP 4 (one kv head a device) one combination
    per cache mode: the decoders' vocabulary-split paths do not depend on the split's size
    (TP 2 covers them; `test_temperature_sampling_is_exact_under_vocab_split` samples at 4)."""
    single = djax.load(dense4, dtype=jnp.float32)
    sharded = djax.load(dense4, dtype=jnp.float32, mesh=make_mesh(tensor_parallel=tp))
    assert sharded.params["attn_0"]["qkv"].addressable_shards[0].data.shape[1] == 4 // tp
    ids, valid = _ids()
    err = rel_error(
        np.asarray(djax.forward_logits(sharded, ids, valid))[valid],
        np.asarray(djax.forward_logits(single, ids, valid))[valid],
    )
    assert err <= 1e-6, err
    for decoder, cache in COMBOS if tp == 2 else COMBOS[:4]:
        config = dataclasses.replace(BASE, decoder=decoder, cache=cache)
        a = djax.generate(single, PROMPTS, config)
        b = djax.generate(sharded, PROMPTS, config)
        np.testing.assert_array_equal(a.answer_ids, b.answer_ids, err_msg=f"{decoder}/{cache}")
        assert a.stats.forwards == b.stats.forwards


def test_temperature_sampling_is_exact_under_vocab_split(dense4):
    config = dataclasses.replace(BASE, temperature=0.8, smoothing=True)
    single = djax.generate(djax.load(dense4, dtype=jnp.float32), PROMPTS, config)
    sharded = djax.generate(
        djax.load(dense4, dtype=jnp.float32, mesh=make_mesh(tensor_parallel=4)), PROMPTS, config
    )
    np.testing.assert_array_equal(single.answer_ids, sharded.answer_ids)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chunked_logits_under_tensor_parallel(dense4, temperature):
    """TP 2 (64 ids a device) in chunks of 24, the devices' running statistics combined:
    the single device's tokens of the whole vocabulary at once, greedy and sampled."""
    single = djax.load(dense4, dtype=jnp.float32)
    sharded = djax.load(dense4, dtype=jnp.float32, mesh=make_mesh(tensor_parallel=2))
    for decoder, cache in [("threshold", "dual"), ("low_confidence", "none")]:
        config = dataclasses.replace(
            BASE, decoder=decoder, cache=cache, temperature=temperature, early_stop=False
        )
        whole = djax.generate(single, PROMPTS, dataclasses.replace(config, logits_chunk=0))
        chunked = djax.generate(sharded, PROMPTS, dataclasses.replace(config, logits_chunk=24))
        np.testing.assert_array_equal(chunked.answer_ids, whole.answer_ids, err_msg=decoder)


@pytest.mark.parametrize("tp, ep", [(1, 2), (1, 8), (2, 1)])
def test_expert_and_tensor_parallel_moe(moe2, tp, ep):
    """Logits, then tokens: one decoder per cache mode at EP 2; at EP 8 and TP 2 the dual
    cache's (its whole-sequence refresh and block forwards reach the experts as every mode's
    forwards do; the other modes differ in attention, which EP 2 and the dense TP test
    cover)."""
    folder, moe_model = moe2
    mesh = make_mesh(tensor_parallel=tp, expert_parallel=ep)
    sharded = djax.load(folder, dtype=jnp.float32, mesh=mesh)
    gate_up = sharded.params["ff_1"]["gate_up"].addressable_shards[0].data.shape
    assert gate_up == ((8 // ep, 64, 2, 32) if ep > 1 else (8, 64, 2, 32 // tp))
    ids, valid = _ids()
    err = rel_error(
        np.asarray(djax.forward_logits(sharded, ids, valid))[valid],
        np.asarray(djax.forward_logits(moe_model, ids, valid))[valid],
    )
    assert err <= 1e-6, err
    for decoder, cache in COMBOS[:4] if ep == 2 else COMBOS[2:3]:
        config = dataclasses.replace(BASE, decoder=decoder, cache=cache)
        a = djax.generate(moe_model, PROMPTS, config)
        b = djax.generate(sharded, PROMPTS, config)
        np.testing.assert_array_equal(a.answer_ids, b.answer_ids, err_msg=f"{decoder}/{cache}")


def test_data_parallel_rows(dense4):
    single = djax.load(dense4, dtype=jnp.float32)
    sharded = djax.load(
        dense4, dtype=jnp.float32, mesh=make_mesh(tensor_parallel=2, data_parallel=2)
    )
    a = djax.generate(single, PROMPTS, BASE)
    with warnings.catch_warnings():  # the rows' split tokens are not donated (replicated out)
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        b = djax.generate(sharded, PROMPTS, BASE)
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    with pytest.raises(ValueError, match="batch=1 is not divisible by data_parallel=2"):
        djax.generate(sharded, PROMPTS[:1], BASE)


def test_the_memory_estimate_counts_the_expert_axis_s_shards(moe_model, tmp_path):
    """Each device holds 1/n of the kv heads and of the vocabulary under expert parallelism
    as under tensor parallelism: the fallback estimate divides by either axis; and its share
    of the rows under data parallelism."""
    from djax.serving.memory import estimate_call_bytes

    by = {
        kind: estimate_call_bytes(
            djax.load(moe_model.path, dtype=jnp.float32, mesh=make_mesh(**{kind: 2})),
            4,
            256,
            8,
            None,
        )
        for kind in ("tensor_parallel", "expert_parallel")
    }
    alone = estimate_call_bytes(moe_model, 4, 256, 8, None)
    assert by["tensor_parallel"] == by["expert_parallel"] < alone
    # Under data parallelism each device holds its share of the batch's rows, as the
    # per-device budget counts them: two rows on two devices cost one row on one.
    data = djax.load(moe_model.path, dtype=jnp.float32, mesh=make_mesh(data_parallel=2))
    one_row = djax.load(moe_model.path, dtype=jnp.float32)
    assert estimate_call_bytes(data, 2, 256, 8, None) == estimate_call_bytes(
        one_row, 1, 256, 8, None
    )
    assert estimate_call_bytes(data, 3, 256, 8, 64) == estimate_call_bytes(one_row, 2, 256, 8, 64)


def test_mesh_errors(moe_model):
    with pytest.raises(ValueError, match="share one model axis"):
        make_mesh(tensor_parallel=2, expert_parallel=4)
    with pytest.raises(ValueError, match="needs 16 devices; 8 are available"):
        make_mesh(tensor_parallel=8, data_parallel=2)
    with pytest.raises(ValueError, match="tensor_parallel=0; expected a positive int"):
        make_mesh(tensor_parallel=0)
    with pytest.raises(
        ValueError, match="n_kv_heads=8 is not divisible by the model-parallel size 3"
    ):
        param_specs(moe_model.config, jnp.float32, make_mesh(tensor_parallel=3))
    with pytest.raises(ValueError, match="num_experts=8 is not divisible"):
        config = moe_model.config.replace(n_kv_heads=6, n_heads=6, vocab_size=120)
        param_specs(config, jnp.float32, make_mesh(expert_parallel=6))
    assert len(jax.devices()) == 8


@pytest.mark.parametrize(
    "grid, axes",
    [((2, 2), ("model", "data")), ((4,), ("model",)), ((2, 2), ("dp", "tp"))],
)
def test_a_mesh_of_other_axes_is_refused_by_name(dense4, grid, axes):
    """A hand-built mesh whose axes are not djax's (data first, then model or expert) is a
    ValueError naming them: ("model", "data") was read with "data" as the model axis and
    gave wrong tokens, silently; the others an IndexError or a KeyError."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(grid), axes)
    with pytest.raises(ValueError, match="expected one of .*build the mesh with djax.make_mesh"):
        djax.load(dense4, jnp.float32, mesh=mesh)


def test_a_mesh_leaving_a_process_out_is_refused():
    """Multi-host: a mesh over process 0's devices alone leaves process 1 nothing to run
    (it failed deep inside the load); refused naming the sizes and the process."""
    import types

    devices = [types.SimpleNamespace(process_index=i // 2, id=i) for i in range(4)]
    with pytest.raises(ValueError, match=r"none of process\(es\) \[1\]"):
        make_mesh(tensor_parallel=2, devices=devices)


def test_forward_logits_under_a_mesh_are_whole_on_every_device(dense4):
    """The forward's logits are gathered onto every device (a multi-host process reads
    them from its own), not left split over the vocabulary."""
    model = djax.load(dense4, jnp.float32, mesh=make_mesh(tensor_parallel=2))
    logits = djax.forward_logits(model, np.array([[5, 6, 7, 8]]))
    assert logits.sharding.is_fully_replicated


def test_split_kv_attention_under_tensor_parallel(tmp_path, monkeypatch):
    """Under `shard_map` the split-K/V kernel gets each device's own heads (q [b, t, 2, d]
    and K/V [b, s, 1, d] of 4 heads and 2 kv heads over 2 devices). Mosaic GPU's interpreter
    does not run inside `shard_map` on CPU devices, so a stand-in with the kernel's contract
    (the einsum attention) records what it gets; the tokens are the einsum path's."""
    from djax.kernels import flash_attention_mosaic
    from djax.models import layers

    calls = []

    def stand_in(q, keys, values, key_valid, **kwargs):
        calls.append((q.shape[2], keys.shape[2]))
        b, t, n, d = q.shape
        grouped = q.reshape(b, t, keys.shape[2], n // keys.shape[2], d)
        return layers.attend(grouped, keys, values, key_valid, "xla").reshape(q.shape)

    monkeypatch.setattr(flash_attention_mosaic, "split_kv_attention", stand_in)
    make_llada_dense(tmp_path, d_model=256, n_heads=4, n_kv_heads=2, head_scale=6.0, seed=5)
    mesh = make_mesh(tensor_parallel=2)
    einsums = djax.load(tmp_path, dtype=jnp.bfloat16, mesh=mesh, attention_impl="xla")
    sharded = djax.load(tmp_path, dtype=jnp.bfloat16, mesh=mesh, attention_impl="split_kv")
    config = dataclasses.replace(BASE, cache="dual")
    a = djax.generate(einsums, PROMPTS, config)
    b = djax.generate(sharded, PROMPTS, config)
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    assert calls and set(calls) == {(2, 1)}  # the sharded program did trace the kernel


def test_mosaic_products_under_tensor_parallel(tmp_path, monkeypatch):
    """Under `shard_map` the Mosaic GPU split-K and SwiGLU products get each device's own
    slice of the weights (q/k/v and gate/up split by their outputs, the attention-output
    and down products by their contractions), and the split-K partials are summed before
    the all-reduce. Mosaic GPU's interpreter does not run inside `shard_map` on CPU devices,
    so stand-ins with the kernels' contracts (one fp32 partial; the SwiGLU product in fp32)
    record what they get; the tokens are XLA's."""
    from djax.kernels import split_k_mosaic, swiglu_mosaic
    from djax.kernels.handoff import Partials

    products = []

    def split_k(x, w, *args, **kwargs):
        products.append(tuple(w.shape))
        parts = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
        return Partials(parts[None], x.dtype)

    def swiglu(x, w, *args, **kwargs):
        products.append(tuple(w.shape))
        h = jnp.einsum("mk,kgn->mgn", x, w, preferred_element_type=jnp.float32)
        return (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x.dtype)

    monkeypatch.setattr(split_k_mosaic, "matmul_partials", split_k)
    monkeypatch.setattr(swiglu_mosaic, "swiglu_matmul", swiglu)
    make_llada_dense(
        tmp_path, d_model=256, n_heads=4, n_kv_heads=2, mlp_hidden=256, head_scale=6.0, seed=5
    )
    mesh = make_mesh(tensor_parallel=2)
    xla = djax.load(tmp_path, dtype=jnp.bfloat16, mesh=mesh)
    mosaic = xla.with_options(matmul_impl="mosaic", mlp_impl="mosaic")
    config = dataclasses.replace(BASE, cache="dual")
    a = djax.generate(xla, PROMPTS, config)
    b = djax.generate(mosaic, PROMPTS, config)
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    head_dim = 256 // 4
    assert set(products) == {
        (256, 4 * head_dim),  # q/k/v of 1 kv head a device: 2 query heads, a key, a value
        (2 * head_dim, 256),  # the attention output of 2 heads a device
        (256, 2, 128),  # gate/up, 128 of 256 hidden a device
        (128, 256),  # down
    }
