"""LLaDA2.0: config keys honoured or refused, loading the HF layout (fused q/k/v, experts
fused while loading), logits against the independent torch reference (bidirectional and
block-causal), converting to orbax, and block-diffusion generation against the reference's
greedy generate under both cache modes."""

import dataclasses
import json
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices
from safetensors.numpy import load_file

import djax
from djax.config import ConfigError, from_hf_dict, resolve_token_ids
from djax.demo.tokenizer import save_char_tokenizer
from djax.model import load_tokenizer
from djax.models.llada2 import route_grouped
from djax.sharding import make_mesh

from llada2_reference import TINY, make_llada2
from torch_reference import EOS_ID, MASK_ID, rel_error


@pytest.fixture(scope="module")
def llada2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada2")
    return folder, make_llada2(folder, seed=4)


@pytest.fixture(scope="module")
def llada2_model(llada2_folder):
    return djax.load(llada2_folder[0], dtype=jnp.float32)


@pytest.fixture(scope="module")
def llada2_small(tmp_path_factory):
    """`TINY` with two layers, the dense one and an MoE one: the model of the tests of
    decoding, sampling and serving, which do not depend on the depth (the reference's tokens
    are checked on `llada2_model`'s three layers); each of the many programs they compile
    is a third cheaper. Seed 5: as `llada2_model` does, it runs one request of `SERVED` to
    a stop token (here after its first block) and the others to max_tokens (checked in
    `tokens_alone`)."""
    folder = tmp_path_factory.mktemp("llada2_small")
    make_llada2(folder, {**TINY, "num_hidden_layers": 2}, seed=5)
    return djax.load(folder, dtype=jnp.float32)


def test_config_keys():
    cfg = from_hf_dict(TINY)
    assert cfg.family == "llada2" and cfg.block_diffusion and cfg.is_moe
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dim) == (4, 2, 16, 8)
    assert cfg.moe_layers == (False, True, True) and cfg.mlp_hidden == 96
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_hidden) == (8, 2, 32)
    assert (cfg.expert_groups, cfg.groups_per_token, cfg.routed_scaling) == (4, 2, 2.5)
    assert cfg.shared_expert_hidden == 32 and cfg.router_expert_bias


def test_model_type_names_the_family_without_architectures():
    assert from_hf_dict({k: v for k, v in TINY.items() if k != "architectures"}).block_diffusion


def test_config_defaults_are_the_llada2_class_defaults():
    """Absent keys mean what they mean to the original config class."""
    minimal = {k: TINY[k] for k in TINY if k not in ("partial_rotary_factor", "n_group")}
    minimal |= {"topk_group": 1, "num_experts": 16}
    cfg = from_hf_dict(minimal)
    assert cfg.rope_dim == 8 and cfg.expert_groups == 8  # partial rotary 0.5, 8 groups
    assert from_hf_dict({**TINY, "num_shared_experts": None}).shared_expert_hidden == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_qkv_bias": True}, "use_qkv_bias=True is not supported"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported"),
        ({"score_function": "softmax"}, "score_function='softmax' is not supported"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported"),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling="),
        ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
        ({"n_group": 3}, "num_experts=8 in n_group=3 groups"),
        ({"n_group": 8}, "equal groups of at least 2 experts"),
        ({"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
        ({"num_experts_per_tok": 5}, "exceeds the 2 kept groups' 4 experts"),
        ({"rotary_dim": 16}, "rotary_dim=16 disagrees"),
        ({"moe_shared_expert_intermediate_size": 64}, "disagrees with moe_intermediate_size"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace=4"),
        ({"num_key_value_heads": None}, "'num_key_value_heads' is missing"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1"),
        ({"num_experts": None}, "num_experts=None is not supported"),
    ],
)
def test_config_refusals(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        from_hf_dict({**TINY, **change}, "my/config.json")


def test_other_config_branches_match_the_reference(tmp_path):
    """Top-1 routing (no renormalisation), no shared expert, no dense layer, no q/k norm,
    whole-head RoPE, MHA: logits as the reference's."""
    config = TINY | {
        "num_experts_per_tok": 1,
        "num_shared_experts": 0,
        "first_k_dense_replace": 0,
        "use_qk_norm": False,
        "partial_rotary_factor": 1.0,
        "num_key_value_heads": 4,
        "topk_group": 1,
    }
    reference = make_llada2(tmp_path, config, seed=9)
    model = djax.load(tmp_path, dtype=jnp.float32)
    assert model.config.shared_expert_hidden == 0 and all(model.config.moe_layers)
    ids = np.random.default_rng(8).integers(4, 100, (1, 19))
    for block_length in (None, 4):
        ours = np.asarray(djax.forward_logits(model, ids, block_length=block_length))
        assert rel_error(ours, reference.logits(ids[0], block_length)[None]) <= 1e-5


def test_attention_output_bias(tmp_path):
    """Without `use_bias` the original config class adds a bias to the attention output
    (`attention.dense.bias`): loaded and added."""
    config = {k: v for k, v in TINY.items() if k != "use_bias"}
    reference = make_llada2(tmp_path, config, seed=7, shards=1)
    model = djax.load(tmp_path, dtype=jnp.float32)
    assert model.config.attn_out_bias
    ids = np.random.default_rng(4).integers(4, 100, (1, 21))
    ours = np.asarray(djax.forward_logits(model, ids, block_length=8))
    assert rel_error(ours, reference.logits(ids[0], 8)[None]) <= 1e-5


def test_group_limited_routing_by_hand():
    """One token, 8 experts in 4 groups: groups score the sum of their two best biased
    scores, groups 0 and 2 stay; inside them the biased scores choose experts 5 and 0 (the
    bias lifts 0 over 1); the weights are the unbiased sigmoid scores renormalised, times
    the scaling."""
    logits = np.array([0.0, 1.0, -3.0, -3.0, 0.5, 2.0, -1.0, -1.0], np.float32)
    bias = np.array([0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    x = np.eye(8, dtype=np.float32)[:1]
    router = np.zeros((8, 8), np.float32)
    router[0] = logits  # x @ router = logits
    weights, experts = route_grouped(
        jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), 2, 4, 2, 2.5
    )
    scores = 1 / (1 + np.exp(-logits))
    assert list(np.asarray(experts[0])) == [5, 0]
    expected = scores[[5, 0]] / scores[[5, 0]].sum() * 2.5
    np.testing.assert_allclose(np.asarray(weights[0]), expected, rtol=1e-6)
    _, one = route_grouped(jnp.asarray(x), jnp.asarray(router), jnp.asarray(bias), 1, 4, 1, 1.0)
    # one group kept: group 0 (1.53) beats group 2 (1.50), so expert 0, though 5 scores best
    assert list(np.asarray(one[0])) == [0]


def test_loads_fused_qkv_and_experts(llada2_model, llada2_folder):
    folder = llada2_folder[0]
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored |= load_file(str(file))
    qkv = np.asarray(llada2_model.params["attn_1"]["qkv"])  # [model, kv, group + 2, d]
    fused = stored["model.layers.1.attention.query_key_value.weight"].reshape(8, 16, 64)
    # kv head 1: query heads 2 and 3, key head 1 (row block 5), value head 1 (block 7)
    for slot, head in enumerate([2, 3, 5, 7]):
        np.testing.assert_array_equal(qkv[:, 1, slot, :], fused[head].T)
    gate_up = np.asarray(llada2_model.params["ff_2"]["gate_up"])
    assert gate_up.shape == (8, 64, 2, 32)
    np.testing.assert_array_equal(
        gate_up[6, :, 0, :], stored["model.layers.2.mlp.experts.6.gate_proj.weight"].T
    )
    np.testing.assert_array_equal(
        np.asarray(llada2_model.params["ff_2"]["expert_bias"]),
        stored["model.layers.2.mlp.gate.expert_bias"],
    )
    assert llada2_model.config.mask_token_id == MASK_ID  # from the tokenizer


@pytest.mark.parametrize("block_length", [None, 16, 5])
def test_fp32_logits_match_the_reference(llada2_model, llada2_folder, block_length):
    reference = llada2_folder[1]
    ids = np.random.default_rng(0).integers(4, 100, (2, 37))
    ours = np.asarray(djax.forward_logits(llada2_model, ids, block_length=block_length))
    theirs = np.stack([reference.logits(row, block_length) for row in ids])
    assert rel_error(ours, theirs) <= 1e-5


def test_bf16_logits(tmp_path_factory):
    """bf16 against the fp32 reference, every expert routed (all groups kept, top-8 of 8):
    a bf16 rounding then only moves the weights, never flips a discrete expert choice."""
    folder = tmp_path_factory.mktemp("llada2_bf16")
    reference = make_llada2(folder, {**TINY, "num_experts_per_tok": 8, "topk_group": 4}, seed=8)
    model = djax.load(folder, dtype=jnp.bfloat16)
    ids = np.random.default_rng(6).integers(4, 100, (1, 24))
    ours = np.asarray(djax.forward_logits(model, ids, block_length=8))
    assert rel_error(ours, reference.logits(ids[0], 8)[None]) <= 3e-2


def test_block_causal_hides_later_blocks(llada2_model):
    ids = np.random.default_rng(1).integers(4, 100, (1, 24))
    changed = ids.copy()
    changed[0, 20] = 99
    a = np.asarray(djax.forward_logits(llada2_model, ids, block_length=8))
    b = np.asarray(djax.forward_logits(llada2_model, changed, block_length=8))
    np.testing.assert_array_equal(a[0, :16], b[0, :16])  # blocks 0 and 1 never see block 2
    assert not np.allclose(a[0, 16:], b[0, 16:])
    with pytest.raises(ValueError, match="block_length=0; expected a positive int"):
        djax.forward_logits(llada2_model, ids, block_length=0)


def test_left_padding_aligns_blocks_at_each_rows_first_token(llada2_model):
    ids = np.random.default_rng(2).integers(4, 100, (1, 13))
    padded = np.concatenate([np.full((1, 3), EOS_ID), ids], axis=1)
    valid = np.concatenate([np.zeros((1, 3), bool), np.ones((1, 13), bool)], axis=1)
    alone = np.asarray(djax.forward_logits(llada2_model, ids, block_length=4))
    beside = np.asarray(djax.forward_logits(llada2_model, padded, valid, block_length=4))
    assert rel_error(beside[0, 3:], alone[0]) <= 1e-5


def test_convert_to_orbax(llada2_model, llada2_folder, tmp_path):
    out = djax.convert(llada2_folder[0], tmp_path / "converted", dtype=jnp.float32, progress=False)
    converted = djax.load(out, dtype=jnp.float32)
    assert converted.config == llada2_model.config
    ids = np.random.default_rng(3).integers(4, 100, (1, 20))
    np.testing.assert_array_equal(
        np.asarray(djax.forward_logits(converted, ids, block_length=8)),
        np.asarray(djax.forward_logits(llada2_model, ids, block_length=8)),
    )
    assert json.loads((out / "djax.json").read_text())["family"] == "llada2"


PROMPTS = [list(range(10, 15)), list(range(20, 40)), list(range(5, 21))]  # 5, 20, 16 tokens


def _config(**changes):
    base = djax.GenerationConfig(gen_length=20, block_length=8, stop_ids=(EOS_ID,))
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("cache", ["dual", "none"])
@pytest.mark.parametrize(
    "decoder, threshold, steps_per_block", [("low_confidence", None, 4), ("threshold", 0.3, 8)]
)
def test_generation_matches_the_reference(
    llada2_model, llada2_folder, cache, decoder, threshold, steps_per_block
):
    """Greedy tokens equal the reference generate's for prompts shorter than a block, of
    whole blocks and ending inside one; `steps` is the total over the generated blocks."""
    reference = llada2_folder[1]
    for prompt in PROMPTS:
        blocks = -(-(len(prompt) % 8 + 20) // 8)
        config = _config(
            decoder=decoder,
            threshold=threshold or 0.9,
            steps=steps_per_block * blocks,
            cache=cache,
        )
        ours = djax.generate(llada2_model, [prompt], config)
        theirs = reference.generate(prompt, 20, 8, steps_per_block, threshold=threshold)
        assert ours.token_ids[0] == theirs, (prompt, ours.token_ids[0], theirs)


def test_batch_rows_are_generated_as_alone(llada2_model, llada2_folder):
    """Per-row prompts in one batch: each row's blocks align at its own position 0 and it
    takes its own steps per block, so it gets the tokens the reference generates for its
    prompt alone (the rows alone match the reference in
    `test_generation_matches_the_reference`, so this is also their tokens alone)."""
    reference = llada2_folder[1]
    config = _config(decoder="low_confidence", gen_length=12, block_length=4)
    together = djax.generate(llada2_model, PROMPTS, config)
    for row, prompt in enumerate(PROMPTS):
        assert together.token_ids[row] == reference.generate(prompt, 12, 4, 4), prompt


def test_block_cache_counts_and_stop(llada2_small):
    """The cache prefills the prompt's whole blocks once; each block's steps feed only the
    block, and the next block's first step writes its final K/V; a row stops after the
    block holding its first stop token."""
    prompt = PROMPTS[1]  # 20 tokens: blocks 0 and 1 prefilled, block 2 holds 4 prompt tokens
    config = _config(decoder="low_confidence", steps=12, stop_ids=(999,), gen_length=20)
    with pytest.raises(ValueError, match="stop_ids"):
        djax.generate(llada2_small, [prompt], config)
    config = dataclasses.replace(config, stop_ids=(127,))  # never produced here
    out = djax.generate(llada2_small, [prompt], config)
    # 3 generated blocks of 4 steps (8 / 4 = 2 commits a step; the first block has 4
    # masks, so 2 steps) and the prefill
    assert out.stats.forwards == 2 + 4 + 4 + 1 and out.stats.refreshes == 1
    assert out.stats.blocks == 3 and len(out.token_ids[0]) == 20
    answer = out.token_ids[0]
    # a token first met in the second generated block (answer positions 4..11)
    at = next(i for i in range(4, 12) if answer[i] not in answer[:i])
    stopped = djax.generate(
        llada2_small, [prompt], dataclasses.replace(config, stop_ids=(answer[at],))
    )
    assert stopped.stats.blocks == 2
    assert stopped.token_ids[0] == answer[:at]
    assert (stopped.answer_ids[0, 12:] == EOS_ID).all()  # the blocks after it: EOS


def test_a_predicted_mask_token_keeps_the_position_masked(tmp_path):
    """The prediction is the argmax over the whole vocabulary, as the original's: where it is
    the mask token, committing it leaves the position masked, and a block whose steps run
    out keeps it (said in the notes)."""
    reference = make_llada2(tmp_path, seed=4, mask_head_scale=4.0)
    model = djax.load(tmp_path, dtype=jnp.float32)
    prompt = PROMPTS[1]
    for cache in ("dual", "none"):
        config = _config(decoder="low_confidence", gen_length=12, steps=16, cache=cache)
        out = djax.generate(model, [prompt], config)
        assert out.token_ids[0] == reference.generate(prompt, 12, 8, 8)
        assert MASK_ID in out.token_ids[0] and "kept the mask id" in out.notes[0]
    # The note counts the masks of the answer returned, cut at its stop: not those after it.
    config = _config(decoder="low_confidence", gen_length=12, steps=16, stop_ids=(110,))
    stopped = djax.generate(model, [list(range(20, 40))], config)
    kept = stopped.token_ids[0].count(MASK_ID)
    assert (stopped.answer_ids[0] == MASK_ID).sum() > kept > 0  # masks past the stop too
    assert f"rows {{0: {kept}}} (row: positions) kept the mask id" in stopped.notes[0]


def test_sampling_follows_the_seed(llada2_small):
    config = _config(decoder="threshold", temperature=1.5, stop_ids=(127,))
    a = djax.generate(llada2_small, PROMPTS[:2], config)
    b = djax.generate(llada2_small, PROMPTS[:2], config)
    c = djax.generate(llada2_small, PROMPTS[:2], dataclasses.replace(config, seed=1))
    greedy = djax.generate(llada2_small, PROMPTS[:2], dataclasses.replace(config, temperature=0))
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    assert (a.answer_ids != c.answer_ids).any() and (a.answer_ids != greedy.answer_ids).any()
    # top_k 1 keeps only the argmax; top_k 3 draws otherwise than the unfiltered sample
    narrow = djax.generate(llada2_small, PROMPTS[:2], dataclasses.replace(config, top_k=1))
    np.testing.assert_array_equal(narrow.answer_ids, greedy.answer_ids)
    three = djax.generate(llada2_small, PROMPTS[:2], dataclasses.replace(config, top_k=3))
    assert (three.answer_ids != a.answer_ids).any()


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_chunked_logits_give_the_same_tokens(llada2_small, temperature):
    """Block diffusion's logits made 40 ids at a time: the whole vocabulary's tokens."""
    config = _config(decoder="threshold", temperature=temperature, stop_ids=(127,))
    whole, chunked = (
        djax.generate(llada2_small, PROMPTS[:2], dataclasses.replace(config, logits_chunk=c))
        for c in (0, 40)
    )
    np.testing.assert_array_equal(chunked.answer_ids, whole.answer_ids)


@pytest.mark.parametrize("decoder", ["random", "factor", "hierarchy"])
def test_other_decoders_fill_every_block(llada2_small, decoder):
    """Each decoder under the block cache; `random` also without it (a decoder reads only
    the logits, whichever forwards made them)."""
    config = _config(decoder=decoder, stop_ids=(127,), factor=2.0, threshold=0.5)
    for cache in ("dual", "none") if decoder == "random" else ("dual",):
        out = djax.generate(llada2_small, PROMPTS[:2], dataclasses.replace(config, cache=cache))
        assert out.answer_ids.shape == (2, 20) and not out.notes
        if cache == "none":  # whole-sequence forwards
            assert out.stats.refreshes == out.stats.forwards


@pytest.mark.parametrize(
    "change, message",
    [
        ({"steps": 5}, r"prompt 0 generates \d blocks, over which steps=5 \(the total over"),
        ({"decoder": "credit"}, "decoder='credit' is not available for block diffusion"),
        ({"cache": "prefix"}, "cache='prefix'"),
        ({"refresh_every": 2}, "refresh_every=2"),
        ({"smoothing": True}, "smoothing=True"),
        ({"gen_length": 510}, "exceeds the model's maximum sequence length 512"),
    ],
)
def test_generation_refusals(llada2_model, change, message):
    with pytest.raises(ValueError, match=message):
        djax.generate(llada2_model, PROMPTS[:1], _config(**change))


@pytest.fixture(scope="module")
def llada2_tp_folder(tmp_path_factory):
    """8 heads over 4 kv heads, with the attention output bias; two layers (the dense one
    and an MoE one: each kind split over the mesh, a third layer would only lengthen each
    compile)."""
    folder = tmp_path_factory.mktemp("llada2_tp")
    config = {**TINY, "num_attention_heads": 8, "num_key_value_heads": 4, "use_bias": True}
    make_llada2(folder, config | {"num_hidden_layers": 2}, seed=6)
    return folder


@needs_devices
@pytest.mark.parametrize("tp, ep", [(4, 1), (1, 4), (1, 8), (2, 2)])
def test_tensor_and_expert_parallel_tokens(llada2_tp_folder, tp, ep):
    """8 heads over 4 kv heads: tensor parallelism up to 4 splits whole kv heads, expert
    parallelism whole experts, with rows over 2 data shards for (2, 2); the attention output
    bias is added once; logits and tokens as on one device, under the block cache on every
    mesh and without it (whole-sequence forwards, as the logits') at TP 4. A `model` axis of
    size n splits the kv heads too, so expert parallelism 8 is refused."""
    folder = llada2_tp_folder
    single = djax.load(folder, dtype=jnp.float32)
    if ep == 8:
        with pytest.raises(ValueError, match="n_kv_heads=4 is not divisible"):
            djax.load(folder, dtype=jnp.float32, mesh=make_mesh(expert_parallel=8))
        return
    mesh = make_mesh(tensor_parallel=tp, expert_parallel=ep, data_parallel=2 if tp == ep else 1)
    sharded = djax.load(folder, dtype=jnp.float32, mesh=mesh)
    ids = np.random.default_rng(5).integers(4, 100, (2, 19))
    a = np.asarray(djax.forward_logits(single, ids, block_length=8))
    b = np.asarray(djax.forward_logits(sharded, ids, block_length=8))
    assert rel_error(b, a) <= 1e-6
    for cache in ("dual", "none") if tp == 4 else ("dual",):
        config = _config(decoder="threshold", threshold=0.5, steps=None, cache=cache)
        ours = djax.generate(sharded, PROMPTS[:2], config)
        theirs = djax.generate(single, PROMPTS[:2], config)
        np.testing.assert_array_equal(ours.answer_ids, theirs.answer_ids, err_msg=cache)
        if tp != ep:  # (data parallel shards loop on their own rows)
            assert ours.stats.forwards == theirs.stats.forwards


def test_token_ids_from_the_tokenizer_or_pad(tmp_path):
    """EOS and the mask id may be missing from config.json: EOS is the tokenizer's, else the
    pad id (LLaDA2's pad token is its EOS); the mask id is the tokenizer's."""
    config = {k: v for k, v in TINY.items() if k != "eos_token_id"} | {"pad_token_id": 5}
    hf = from_hf_dict(config)
    assert hf.eos_token_id == -1
    save_char_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert resolve_token_ids(hf, tokenizer, "x").eos_token_id == EOS_ID
    no_tokenizer = resolve_token_ids(hf.replace(mask_token_id=9), None, "x")
    assert (no_tokenizer.eos_token_id, no_tokenizer.pad_token_id) == (5, 5)
    with pytest.raises(ConfigError, match="no 'mask_token_id' in config.json"):
        resolve_token_ids(hf, None, "x")


SERVED = [  # (prompt, max_tokens, temperature, seed): tails of 5, 4 and 0 prompt tokens
    (PROMPTS[0], 20, 0.0, 0),
    (PROMPTS[1], 7, 0.0, 0),
    (PROMPTS[2], 12, 0.0, 0),
    (PROMPTS[0], 11, 1.5, 3),
    (PROMPTS[2], 3, 0.0, 0),  # fewer tokens than steps a block: as many steps as tokens
    (PROMPTS[1], 1, 0.0, 0),
]


def _served(model, config, scheduler):
    """Serve `SERVED` on 2 rows, arriving one after another; each request's events."""
    from djax.serving.engine import ServeConfig, make_engine
    from djax.serving.metrics import ServerMetrics
    from djax.serving.requests import EngineRequest

    serve = ServeConfig(generation=config, scheduler=scheduler, max_batch=2, max_seq_len=48)
    engine = make_engine(model, serve, ServerMetrics())
    engine.start()
    assert engine.wait_ready(300)
    events, ended = {}, threading.Semaphore(0)

    def sink(name):
        def on_event(event):
            events.setdefault(name, []).append(event)
            if type(event).__name__ in ("Finished", "Failed"):
                ended.release()

        return on_event

    for i, (prompt, max_tokens, temperature, seed) in enumerate(SERVED):
        request = EngineRequest(f"r{i}", tuple(prompt), max_tokens, temperature, seed)
        engine.submit(request, sink(f"r{i}"))
        time.sleep(0.02)
    for _ in SERVED:
        assert ended.acquire(timeout=120)
    engine.stop()
    return events


@pytest.fixture(scope="module")
def tokens_alone(llada2_small):
    """The tokens `djax.generate` gives each of `SERVED` alone (4 steps a block; the first
    block holds the prompt's tail), with the dual cache: without a cache block diffusion
    gives the same tokens (`test_generation_matches_the_reference`, on the three layers)."""
    config = _config(decoder="low_confidence", stop_ids=(EOS_ID,), cache="dual")
    tokens = []
    for prompt, max_tokens, temperature, seed in SERVED:
        blocks = -(-(len(prompt) % 8 + max_tokens) // 8)  # generate caps steps at gen_length
        alone = dataclasses.replace(
            config, gen_length=max_tokens, steps=4 * blocks, temperature=temperature, seed=seed
        )
        tokens.append(djax.generate(llada2_small, [prompt], alone).token_ids[0])
    ends = {len(t) < n for t, (_, n, _, _) in zip(tokens, SERVED, strict=True)}
    assert ends == {True, False}  # requests that stop early and that run to max_tokens
    return tokens


@pytest.mark.parametrize("scheduler, cache", [("continuous", "dual"), ("static", "none")])
def test_the_server_gives_each_request_its_tokens_alone(
    llada2_small, tokens_alone, scheduler, cache
):
    """`djax serve` decodes a block-diffusion family by block diffusion: requests whose
    prompts end inside a block, at a boundary or short of one, with mixed max_tokens and
    one sampled, arriving while others run, get the tokens `djax.generate` gives each alone
    (`tokens_alone`)."""
    config = _config(decoder="low_confidence", steps=12, stop_ids=(EOS_ID,), cache=cache)
    events = _served(llada2_small, config, scheduler)
    for i, (prompt, max_tokens, _, _) in enumerate(SERVED):
        alone = tokens_alone[i]
        got = [t for e in events[f"r{i}"][:-1] for t in e.token_ids]
        assert got == alone, (i, got, alone)
        assert events[f"r{i}"][-1].reason == ("length" if len(alone) == max_tokens else "stop")
        if scheduler == "continuous" and len(prompt) % 8:  # the first block: max_tokens cut
            assert len(events[f"r{i}"][0].token_ids) == min(8 - len(prompt) % 8, len(alone))


def test_the_server_refuses_what_block_diffusion_does_not_run(llada2_model):
    from djax.serving.engine import ServeConfig, make_engine
    from djax.serving.metrics import ServerMetrics

    for change, message in [
        ({"decoder": "credit"}, "decoder='credit' is not available for block diffusion"),
        ({"attention_sparsity": 0.5}, "attention_sparsity=0.5 is not available"),
        ({"refresh_every": 2}, "refresh_every=2 is not available for block diffusion"),
    ]:
        config = ServeConfig(generation=_config(**change), max_batch=2, max_seq_len=48)
        with pytest.raises(ValueError, match=message):
            make_engine(llada2_model, config, ServerMetrics())


def test_cached_steps_take_the_block_kernels_and_give_xlas_tokens(tmp_path):
    """A block's cached steps after its first feed the block alone: block forwards, so
    the kernels' block paths (the RoPE kernel writing the block's K/V, the expert tiles'
    every-token layout), resolved for a block's rows. With every Mosaic GPU kernel asked
    for (Mosaic GPU's interpreter here) the fp16 generation of two ragged rows gives XLA's
    tokens and forward counts. The model: `TINY`'s layout at widths the kernels take."""
    from djax import block_diffusion
    from djax.kernels import rope_write_mosaic
    from djax.models import layers

    config = {**TINY, "hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64}
    config |= {"head_dim": 64, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    make_llada2(tmp_path, config, seed=4)  # one MoE layer: the interpreter is slow
    xla = djax.load(tmp_path, jnp.float16)
    mosaic = xla.with_options(attention_impl="split_kv", rope_impl="mosaic", moe_impl="mosaic")
    # rows of 10 and 3 prompt tokens: 3 generated blocks each, 2 steps a block
    config = _config(gen_length=16, steps=6, cache="dual", decoder="low_confidence")
    prompts = [[0, 10, 20, 30, 40, 50, 60, 70, 80, 90], [0, 11, 12]]
    plan, _ = block_diffusion.make_plan(mosaic, config, prompts)
    kernels = djax.engine.kernel_choice(mosaic, plan)
    assert kernels.block.layers.rope == "mosaic" and kernels.block.layers.expert_rows == "tokens"
    block_windows = []
    rope = rope_write_mosaic.rope_and_write

    def spy(*args, **kwargs):
        block_windows.append(args[0].shape[1])
        return rope(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layers.rope_write_mosaic, "rope_and_write", spy)
        ours = djax.generate(mosaic, prompts, config)
    ref = djax.generate(xla, prompts, config)
    assert block_windows == [8]  # traced once: the block
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
    assert (ours.stats.forwards, ours.stats.refreshes) == (ref.stats.forwards, ref.stats.refreshes)


def test_explain_plans_the_program_block_diffusion_runs(llada2_small, capsys):
    """`djax generate --explain` on a block-diffusion model describes and checks the program
    `djax.generate` runs (block diffusion's own plan): a run it accepts is accepted with
    `--explain` too (steps split over each row's generated blocks), the answer is not
    rounded to whole blocks, and an option it refuses is refused before anything prints."""
    from djax.cli import main

    model = ["generate", "--model", llada2_small.path, "--block-length", "4"]
    run = [*model, "--prompt", "abcde", "--gen-length", "8", "--decoder", "low_confidence"]
    run += ["--steps", "3", "--json"]
    assert main(run) == 0
    capsys.readouterr()
    assert main([*run, "--explain"]) == 0, capsys.readouterr().err
    odd = [*model, "--prompt", "abcdefghij", "--gen-length", "30", "--explain"]
    assert main(odd) == 0
    out = capsys.readouterr().out
    assert "gen 30 in " in out and "(block diffusion), cache dual" in out
    assert "block forward:" in out
    assert main([*odd, "--cache", "prefix"]) == 2
    captured = capsys.readouterr()
    assert "cache='prefix'" in captured.err and "block diffusion" not in captured.out


def test_uneven_steps_name_the_prompt_by_its_id(llada2_small, tmp_path, capsys):
    """A prompt whose generated blocks `--steps` does not split over is named by its record
    id (a PromptError), not by its row in the batch."""
    from djax.cli import main

    (tmp_path / "p.txt").write_text("abcd\n\nabcde\n")  # ids 1 and 3 (line numbers)
    args = ["generate", "--model", llada2_small.path, "--prompts-file", str(tmp_path / "p.txt")]
    args += ["--gen-length", "8", "--block-length", "4", "--decoder", "low_confidence"]
    assert main([*args, "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "prompt id 3 generates 3 blocks, over which steps=4" in err, err
