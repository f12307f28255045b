import json

import pytest

from djax.config import ConfigError, from_hf_dict, load_hf_config, resolve_token_ids
from djax.demo.tokenizer import build_char_tokenizer

DENSE = {
    "architectures": ["LLaDAModelLM"],
    "model_type": "llada",
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "mlp_hidden_size": 96,
    "vocab_size": 128,
    "embedding_size": 128,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_sequence_length": 512,
    "mask_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 1,
}
MOE = {
    "architectures": ["LLaDAMoEModelLM"],
    "model_type": "llada",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "expert_intermediate_size": 32,
    "eos_token_id": 1,
    "rope_theta": 50000.0,
}


def test_dense_keys():
    cfg = from_hf_dict(DENSE)
    assert (cfg.family, cfg.head_dim, cfg.n_kv_heads, cfg.mlp_hidden) == ("llada", 16, 2, 96)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (2, 1, 1)


def test_moe_keys_and_layer_pattern():
    cfg = from_hf_dict({**MOE, "moe_layer_freq": [0, 1], "dense_intermediate_size": 48})
    assert cfg.family == "llada_moe" and cfg.moe_layers == (False, True)
    assert cfg.qk_norm and cfg.mask_token_id == -1  # resolved later from the tokenizer
    assert from_hf_dict({**MOE, "moe_layer_freq": 2, "dense_intermediate_size": 8}).moe_layers == (
        False,
        True,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "architectures=\\['GPT2LMHeadModel'\\] is not supported",
        ),
        ({"architectures": None}, "'architectures' is missing"),
        ({"d_model": None}, "required key 'd_model' is missing"),
        ({"n_heads": "four"}, "key 'n_heads'='four' should be of type int"),
        ({"n_kv_heads": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
        ({"d_model": 66}, "d_model=66 is not a multiple of n_heads=4"),
        ({"alibi": True}, "alibi=True is not supported"),
        ({"weight_tying": True}, "weight_tying=True is not supported"),
        ({"n_layers": 0}, "key 'n_layers'=0 must be positive"),
    ],
)
def test_dense_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_dict({**DENSE, **change}, "my/config.json")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
        ({"moe_layer_freq": [1]}, "moe_layer_freq=\\[1\\] should list 0/1 for each of the 2"),
        ({"moe_layer_freq": [0, 1]}, "'dense_intermediate_size' is missing"),
        ({"partial_rotary_factor": 0.05}, "partial_rotary_factor=0.05 gives rotary_dim=0"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid' is not"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5 is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        # a ConfigError naming the key, where these were a ZeroDivisionError, an
        # OverflowError or a ValueError naming neither file nor key
        ({"num_attention_heads": 0}, "key 'num_attention_heads'=0 must be positive"),
        ({"partial_rotary_factor": float("nan")}, "key 'partial_rotary_factor'=nan should be"),
        ({"partial_rotary_factor": float("inf")}, "key 'partial_rotary_factor'=inf should be"),
        ({"rope_theta": 10**400}, "key 'rope_theta'=1000000000"),
        ({"clip_qkv": float("nan")}, "key 'clip_qkv'=nan should be finite"),
    ],
)
def test_moe_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_dict({**MOE, **change}, "my/config.json")


def test_llada_moe_never_renormalises_its_top_k_weights():
    """The LLaDA-MoE reference's MoE block hard-codes norm_topk_prob=False whatever
    config.json says (OLMoE, which it was copied from, reads it)."""
    assert not from_hf_dict({**MOE, "norm_topk_prob": True}).norm_topk_prob


def test_error_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}/config.json: not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**DENSE, "n_layers": None}))
    with pytest.raises(ConfigError, match="required key 'n_layers' is missing"):
        from_hf_dict(load_hf_config(tmp_path), str(tmp_path / "config.json"))


def test_token_ids_from_tokenizer():
    tok = build_char_tokenizer()
    cfg = resolve_token_ids(from_hf_dict(MOE), tok, "x")
    assert cfg.mask_token_id == tok.mask_token_id == 2
    assert cfg.eot_token_id == tok.get_vocab()["<|eot_id|>"]
    assert cfg.stop_token_ids == (1, cfg.eot_token_id)
    with pytest.raises(ConfigError, match="no 'mask_token_id' in config.json"):
        resolve_token_ids(from_hf_dict(MOE), None, "x")
    with pytest.raises(ConfigError, match="mask_token_id=500 is outside the vocabulary"):
        resolve_token_ids(from_hf_dict({**DENSE, "mask_token_id": 500}), tok, "x")
    for config in (DENSE, MOE):  # a null or empty mask id is an absent one: the tokenizer's
        for unset in (None, []):
            cfg = resolve_token_ids(from_hf_dict({**config, "mask_token_id": unset}), tok, "x")
            assert cfg.mask_token_id == tok.mask_token_id


def test_every_eos_id_of_a_list_ends_an_answer():
    """HF allows `eos_token_id` to be a list: every id of it is a stop id (it kept the first
    only), and every one is checked as an id inside the vocabulary, not the mask id."""
    tok = build_char_tokenizer()
    for config in (DENSE, MOE):
        cfg = resolve_token_ids(from_hf_dict({**config, "eos_token_id": [1, 50, 1]}), tok, "x")
        assert cfg.eos_token_id == 1
        assert cfg.stop_token_ids == (1, 50, cfg.eot_token_id)
        for bad in ("x", True, 1.5):
            with pytest.raises(ConfigError, match="should be an integer id or a list of them"):
                from_hf_dict({**config, "eos_token_id": [1, bad]}, "my/config.json")
        with pytest.raises(ConfigError, match="eos_token_id=999 is outside the vocabulary"):
            resolve_token_ids(from_hf_dict({**config, "eos_token_id": [1, 999]}), tok, "x")
        among = r"mask_token_id=2 is also the EOS or padding id \(eos \[1, 2\]"
        with pytest.raises(ConfigError, match=among):
            resolve_token_ids(from_hf_dict({**config, "eos_token_id": [1, 2]}), tok, "x")
