"""LLaDA2.0's `config.json` (`model_type: llada2_moe`, `LLaDA2MoeModelLM`) as a `ModelConfig`.

A missing key takes the default of the LLaDA2 config class, so a folder means what it means
to the original code (without `use_bias`, the attention output has a bias). Keys are
honoured, accepted only at the value djax implements (`_FIXED`: another value raises
`ConfigError` naming the key), or inert at inference (`INERT`: dropouts, initialisation,
cache and logging switches, version stamps). Other keys are ignored, as for the other
families.
"""

from __future__ import annotations

from typing import Any

from djax.config import LLADA2, ConfigError, ModelConfig, _check_heads, _Reader

# Keys that change nothing at inference.
INERT = (
    "attention_dropout",
    "embedding_dropout",
    "output_dropout",
    "initializer_range",
    "use_cache",
    "sliding_window",
    "max_window_layers",
    "output_router_logits",
    "mtp_loss_scaling_factor",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "auto_map",
    "model_type",
    "architectures",
)

# (key, value djax implements, value when the key is absent, why another is refused)
_FIXED = (
    ("hidden_act", "silu", "silu", "LLaDA2 experts are SwiGLU"),
    ("use_qkv_bias", False, False, "djax's attention has no q/k/v bias"),
    ("norm_head", False, False, "djax's output head is a plain matmul"),
    ("tie_word_embeddings", False, False, "LLaDA2 has an untied lm_head"),
    ("rope_scaling", None, None, "djax implements plain RoPE"),
    ("use_sliding_window", False, False, "LLaDA2 attends to every visible key"),
    ("score_function", "sigmoid", "sigmoid", "LLaDA2 routes with sigmoid scores"),
    ("router_dtype", "fp32", "fp32", "djax routes in fp32"),
    ("norm_topk_prob", True, True, "LLaDA2 always renormalises the chosen weights"),
    ("moe_router_enable_expert_bias", True, True, "LLaDA2's router always has expert_bias"),
    ("use_rmsnorm", True, True, "LLaDA2 uses RMSNorm"),
    ("norm_softmax", False, False, "djax implements LLaDA2's sigmoid router only"),
    ("num_nextn_predict_layers", 0, 0, "djax does not run multi-token-prediction layers"),
    ("using_split_qkv_in_self_attention", False, False, "LLaDA2 fuses query_key_value"),
)


def llada2_config(r: _Reader) -> ModelConfig:
    """The `ModelConfig` of an LLaDA2 config dict (token ids not yet resolved: EOS and pad
    may be -1 here, filled from the tokenizer by `resolve_token_ids`)."""
    for key, supported, default, why in _FIXED:
        value = r.hf.get(key, default)
        if value != supported:
            given = f"{value!r}" if key in r.hf else f"absent (LLaDA2's default {default!r})"
            raise ConfigError(
                f"{r.source}: {key}={given} is not supported (expected {supported!r}): {why}"
            )
    d_model = r.get("hidden_size", int)
    n_heads = r.get("num_attention_heads", int)
    n_kv = r.get("num_key_value_heads", int)
    n_layers = r.get("num_hidden_layers", int)
    vocab = r.get("vocab_size", int)
    if "num_experts" in r.hf and r.hf["num_experts"] is None:  # `get` reads null as absent
        raise ConfigError(
            f"{r.source}: num_experts=None is not supported (LLaDA2 reads it as a dense MLP in "
            "every layer, which djax does not build); expected the expert count"
        )
    n_experts = r.get("num_experts", int, 16)
    top_k = r.get("num_experts_per_tok", int, 2)
    groups = r.get("n_group", int, 8)
    topk_groups = r.get("topk_group", int, 4)
    first_dense = r.get("first_k_dense_replace", int, 0)
    head_dim = r.get("head_dim", int, None) or (d_model // n_heads if n_heads > 0 else 0)
    r.positive(
        hidden_size=d_model,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        num_hidden_layers=n_layers,
        vocab_size=vocab,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=topk_groups,
    )
    _check_heads(r, n_heads, n_kv, head_dim)
    _check_routing(r, n_experts, top_k, groups, topk_groups)
    if not 0 <= first_dense <= n_layers:
        raise ConfigError(
            f"{r.source}: first_k_dense_replace={first_dense}; expected 0..{n_layers} "
            "(num_hidden_layers)"
        )
    moe_layers = tuple(i >= first_dense for i in range(n_layers))
    expert_hidden = r.get("moe_intermediate_size", int, 0) if any(moe_layers) else 0
    dense_hidden = r.get("intermediate_size", int, 0) if not all(moe_layers) else 0
    if any(moe_layers) and expert_hidden <= 0:
        raise ConfigError(f"{r.source}: 'moe_intermediate_size' is missing; MoE layers need it")
    if not all(moe_layers) and dense_hidden <= 0:
        raise ConfigError(
            f"{r.source}: first_k_dense_replace={first_dense} asks for dense layers but "
            "'intermediate_size' is missing"
        )
    shared = r.get("num_shared_experts", int, 0)
    if shared < 0:
        raise ConfigError(f"{r.source}: num_shared_experts={shared}; expected >= 0")
    shared_hidden = expert_hidden * shared
    stated = r.get("moe_shared_expert_intermediate_size", int, None)
    if stated is not None and stated != shared_hidden:
        raise ConfigError(
            f"{r.source}: moe_shared_expert_intermediate_size={stated} disagrees with "
            f"moe_intermediate_size x num_shared_experts = {shared_hidden}, the size LLaDA2 uses"
        )
    rotary_dim = _rotary_dim(r, head_dim)
    return ModelConfig(
        family=LLADA2,
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        mlp_hidden=dense_hidden,
        rope_theta=r.get("rope_theta", float, 10000.0),
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-5),
        max_seq_len=r.get("max_position_embeddings", int, 16384),
        mask_token_id=_id(r, "mask_token_id"),
        eos_token_id=_id(r, "eos_token_id"),
        extra_eos_ids=r.ids("eos_token_id")[1:],
        pad_token_id=_id(r, "pad_token_id"),
        bos_token_id=r.first_id("bos_token_id"),
        eot_token_id=r.first_id("eot_token_id"),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        qk_norm=r.get("use_qk_norm", bool, True),
        attn_out_bias=r.get("use_bias", bool, True),
        n_experts=n_experts,
        experts_per_token=top_k,
        expert_hidden=expert_hidden,
        shared_expert_hidden=shared_hidden,
        norm_topk_prob=True,
        router_expert_bias=True,
        moe_layers=moe_layers,
        expert_groups=groups,
        groups_per_token=topk_groups,
        routed_scaling=r.get("routed_scaling_factor", float, 2.5),
    )


def _id(r: _Reader, key: str) -> int:
    value = r.first_id(key)
    return -1 if value is None else value


def _check_routing(r: _Reader, n_experts: int, top_k: int, groups: int, topk_groups: int) -> None:
    """Group-limited top-k: whole groups of at least two experts (a group scores by its two
    best), no more groups kept than exist, and enough experts in the kept groups."""
    if n_experts % groups or n_experts // groups < 2:
        raise ConfigError(
            f"{r.source}: num_experts={n_experts} in n_group={groups} groups; expected "
            "equal groups of at least 2 experts"
        )
    if topk_groups > groups:
        raise ConfigError(f"{r.source}: topk_group={topk_groups} exceeds n_group={groups}")
    if top_k > topk_groups * (n_experts // groups):
        raise ConfigError(
            f"{r.source}: num_experts_per_tok={top_k} exceeds the {topk_groups} kept groups' "
            f"{topk_groups * (n_experts // groups)} experts"
        )


def _rotary_dim(r: _Reader, head_dim: int) -> int:
    partial = r.get("partial_rotary_factor", float, 0.5)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0 or partial > 1:
        raise ConfigError(
            f"{r.source}: partial_rotary_factor={partial} gives rotary_dim={rotary_dim}; "
            "expected an even size in (0, head_dim]"
        )
    stated: Any = r.get("rotary_dim", int, None)
    if stated is not None and stated != rotary_dim:
        raise ConfigError(
            f"{r.source}: rotary_dim={stated} disagrees with head_dim x partial_rotary_factor "
            f"= {rotary_dim}, the width LLaDA2 rotates"
        )
    return rotary_dim
