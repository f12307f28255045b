"""Independent torch references: transformers' own Llama (for LLaDA dense) and Qwen3-MoE (for
LLaDA-MoE) classes, configured to match, made bidirectional, with their random weights
written to disk in the LLaDA HF layouts (names, `[out, in]` tensors, config keys)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from djax.demo.tokenizer import save_char_tokenizer

VOCAB = 128  # the char tokenizer uses 103 ids; the rest are never produced by it
MASK_ID, EOS_ID, BOS_ID, EOT_ID = 2, 1, 0, 3


def _randomise_norms(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))


def _save_tensors(tensors: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def make_llada_dense(
    folder: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 4,
    mlp_hidden: int = 96,
    rope_theta: float = 500000.0,
    seed: int = 0,
    shards: int = 1,
    init_std: float = 0.1,
    head_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
):
    """A random Llama made bidirectional, saved as an HF LLaDA folder. Returns the torch model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=d_model,
        intermediate_size=mlp_hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=init_std,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).eval()
    _randomise_norms(model, seed)
    with torch.no_grad():  # a larger head spreads the confidences like a trained model's
        model.lm_head.weight.mul_(head_scale)
    model = model.to(dtype)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    sd = model.state_dict()
    t = "model.transformer"
    tensors = {
        f"{t}.wte.weight": sd["model.embed_tokens.weight"],
        f"{t}.ln_f.weight": sd["model.norm.weight"],
        f"{t}.ff_out.weight": sd["lm_head.weight"],
    }
    names = {
        "self_attn.q_proj": "q_proj",
        "self_attn.k_proj": "k_proj",
        "self_attn.v_proj": "v_proj",
        "self_attn.o_proj": "attn_out",
        "mlp.gate_proj": "ff_proj",
        "mlp.up_proj": "up_proj",
        "mlp.down_proj": "ff_out",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ff_norm",
    }
    for i in range(n_layers):
        for hf, llada in names.items():
            tensors[f"{t}.blocks.{i}.{llada}.weight"] = sd[f"model.layers.{i}.{hf}.weight"]
    _save_tensors(tensors, folder, shards)
    config = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "alibi": False,
        "block_type": "llama",
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "mlp_hidden_size": mlp_hidden,
        "mlp_ratio": 4,
        "embedding_size": VOCAB,
        "vocab_size": VOCAB,
        "rope": True,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 512,
        "layer_norm_type": "rms",
        "include_bias": False,
        "include_qkv_bias": False,
        "weight_tying": False,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "scale_logits": False,
        "input_emb_norm": False,
        "attention_layer_norm": False,
        "block_group_size": 1,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_char_tokenizer(folder)
    return model


def torch_logits(
    model: torch.nn.Module, ids: np.ndarray, valid: np.ndarray | None = None
) -> np.ndarray:
    """Bidirectional logits of the torch reference: a 4D additive mask hides padding keys."""
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    b, s = ids_t.shape
    valid_t = torch.ones(b, s, dtype=torch.bool) if valid is None else torch.as_tensor(valid)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(b, 1, s, s, dtype=dtype)
    mask = mask.masked_fill(~valid_t[:, None, None, :], torch.finfo(dtype).min)
    positions = (valid_t.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids_t, attention_mask=mask, position_ids=positions).logits
    return out.float().numpy()


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_llada_moe(
    folder: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 8,
    n_kv_heads: int = 8,
    n_experts: int = 8,
    top_k: int = 2,
    expert_hidden: int = 32,
    dense_layers: tuple[int, ...] = (),
    dense_hidden: int = 96,
    seed: int = 0,
    head_scale: float = 1.0,
    init_std: float = 0.1,
    dtype: torch.dtype = torch.float32,
):
    """A random Qwen3-MoE (per-head q/k norm, softmax top-k routing without renormalising)
    made bidirectional, saved as an HF LLaDA-MoE folder (per-expert tensor names, LLaDA-MoE
    config keys, no mask id in the config: it comes from the tokenizer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    head_dim = d_model // n_heads
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=d_model,
        intermediate_size=dense_hidden,
        moe_intermediate_size=expert_hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=list(dense_layers),
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=init_std,
        attention_bias=False,
        attn_implementation="eager",
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    _randomise_norms(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model = model.to(dtype)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(n_experts):
                gate, up = value[e].chunk(2, dim=0)
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate
                tensors[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(n_experts):
                tensors[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            tensors[name] = value
    _save_tensors(tensors, folder, 1)
    config = {
        "architectures": ["LLaDAMoEModelLM"],
        "model_type": "llada",
        "vocab_size": VOCAB,
        "hidden_size": d_model,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "expert_intermediate_size": expert_hidden,
        "dense_intermediate_size": dense_hidden,
        "shared_expert_intermediate_size": None,
        "num_experts": n_experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": False,
        "qk_layernorm": True,
        "moe_layer_freq": [0 if i in dense_layers else 1 for i in range(n_layers)],
        "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax",
        "routed_scaling_factor": 1,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "partial_rotary_factor": 1.0,
        "clip_qkv": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_char_tokenizer(folder)
    return model
