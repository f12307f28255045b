"""An independent torch reference for LLaDA2.0, written from the family's semantics: the
forward (fused q/k/v, GQA, per-head q/k RMSNorm before partial RoPE, SwiGLU then MoE
layers with group-limited sigmoid routing, expert bias, a shared expert and routed scaling),
bidirectional or block-causal, and greedy block-diffusion generation. `make_llada2` writes
its random weights as an HF LLaDA2 folder (names, `[out, in]` tensors, config keys)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from djax.demo.tokenizer import save_char_tokenizer

from torch_reference import EOS_ID, MASK_ID, VOCAB

# A tiny LLaDA2: GQA (4 heads, 2 kv heads), half of each head rotated, layer 0 dense, then
# 8 experts in 4 groups (2 kept per token), top-2, a shared expert, routed scaling 2.5.
TINY = {
    "architectures": ["LLaDA2MoeModelLM"],
    "model_type": "llada2_moe",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "rope_theta": 600000.0,
    "rms_norm_eps": 1e-6,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_bias": False,
    "norm_head": False,
    "hidden_act": "silu",
    "first_k_dense_replace": 1,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "routed_scaling_factor": 2.5,
    "score_function": "sigmoid",
    "norm_topk_prob": True,
    "moe_router_enable_expert_bias": True,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "rope_scaling": None,
    "pad_token_id": EOS_ID,
    "eos_token_id": EOS_ID,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": False,
    "torch_dtype": "float32",
}


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _swiglu(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = x @ w[f"{prefix}.gate_proj.weight"].T
    up = x @ w[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


class LLaDA2Reference:
    """The forward and greedy generate of an LLaDA2 config dict and its HF-named weights."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.cfg, self.w = config, weights

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on the first head_dim × partial_rotary_factor features."""
        cfg = self.cfg
        dim = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
        inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, dim, 2).double() / dim)
        angles = positions.double()[:, None] * inv_freq[None]
        cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None]
        rot, rest = x[..., :dim], x[..., dim:]
        half = torch.cat([-rot[..., dim // 2 :], rot[..., : dim // 2]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1)

    def _route(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = torch.sigmoid(x @ self.w[f"{prefix}.gate.weight"].T)
        biased = scores + self.w[f"{prefix}.gate.expert_bias"]
        n, e, g = scores.shape[0], cfg["num_experts"], cfg["n_group"]
        groups = biased.view(n, g, e // g)
        best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(cfg["topk_group"], -1).indices
        allowed = torch.zeros(n, g, dtype=torch.bool)
        allowed[torch.arange(n)[:, None], best_groups] = True
        choice = biased.masked_fill(~allowed.repeat_interleave(e // g, dim=1), -math.inf)
        experts = choice.topk(cfg["num_experts_per_tok"], dim=-1).indices
        weights = scores.gather(1, experts)
        if cfg["num_experts_per_tok"] > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg["routed_scaling_factor"], experts

    def _moe(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        weights, experts = self._route(x, prefix)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for weight, e in zip(weights[t], experts[t].tolist(), strict=True):
                out[t] += weight * _swiglu(x[t], self.w, f"{prefix}.experts.{e}")
        if self.cfg.get("num_shared_experts"):
            out = out + _swiglu(x, self.w, f"{prefix}.shared_experts")
        return out

    def _attention(self, x: torch.Tensor, i: int, visible: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        eps, att = cfg["rms_norm_eps"], f"model.layers.{i}.attention"
        qkv = (x @ w[f"{att}.query_key_value.weight"].T).view(-1, heads + 2 * kv, d)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv], qkv[:, heads + kv :]
        if cfg["use_qk_norm"]:
            q = _rms_norm(q, w[f"{att}.query_layernorm.weight"], eps)
            k = _rms_norm(k, w[f"{att}.key_layernorm.weight"], eps)
        positions = torch.arange(x.shape[0])
        q, k = self._rope(q, positions), self._rope(k, positions)
        k = k.repeat_interleave(heads // kv, dim=1)
        v = v.repeat_interleave(heads // kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(x.shape[0], heads * d)
        out = out @ w[f"{att}.dense.weight"].T
        return out + w[f"{att}.dense.bias"] if cfg.get("use_bias", True) else out

    def logits(self, ids, block_length: int | None = None) -> np.ndarray:
        """fp32 logits [seq, vocab] of one row `ids` [seq], positions 0..seq-1: bidirectional,
        or block-causal in blocks of `block_length` from position 0."""
        cfg, w, eps = self.cfg, self.w, self.cfg["rms_norm_eps"]
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        block = torch.arange(len(ids)) // (block_length or len(ids) + 1)
        visible = block[None, :] <= block[:, None]
        with torch.no_grad():
            h = w["model.word_embeddings.weight"][ids]
            for i in range(cfg["num_hidden_layers"]):
                layer = f"model.layers.{i}"
                x = _rms_norm(h, w[f"{layer}.input_layernorm.weight"], eps)
                h = h + self._attention(x, i, visible)
                x = _rms_norm(h, w[f"{layer}.post_attention_layernorm.weight"], eps)
                if i < cfg["first_k_dense_replace"]:
                    h = h + _swiglu(x, w, f"{layer}.mlp")
                else:
                    h = h + self._moe(x, f"{layer}.mlp")
            h = _rms_norm(h, w["model.norm.weight"], eps)
            return (h @ w["lm_head.weight"].T).numpy()

    def generate(
        self,
        prompt: list[int],
        gen_length: int,
        block_length: int,
        steps_per_block: int,
        threshold: float | None = None,
        stop_ids: tuple[int, ...] = (EOS_ID,),
        mask_id: int = MASK_ID,
    ) -> list[int]:
        """Greedy block diffusion of one prompt; the answer up to its first stop token.

        Blocks of `block_length` from position 0; each generated block (from the one holding
        the prompt's end) takes at most `steps_per_block` (at most gen_length) steps; step i
        commits k_i masked positions (the block length split over the steps, remainder
        first, at most the masks left): the most confident by softmax(logits)[argmax], or
        with `threshold` every masked one with p > threshold when there are at least k_i of
        them. Generation stops after the block holding the first stop token.
        """
        steps = min(steps_per_block, gen_length)
        n = len(prompt)
        n_blocks = math.ceil((n + gen_length) / block_length)
        x = np.full(n_blocks * block_length, mask_id, np.int64)
        x[:n] = prompt
        schedule = [block_length // steps + (i < block_length % steps) for i in range(steps)]
        for b in range(n // block_length, n_blocks):
            lo, hi = b * block_length, (b + 1) * block_length
            for k in schedule:
                masked = x[lo:hi] == mask_id
                if not masked.any():
                    break
                logits = torch.as_tensor(self.logits(x[:hi], block_length)[lo:hi])
                probs = logits.softmax(-1)
                token = logits.argmax(-1)
                confidence = torch.where(
                    torch.as_tensor(masked), probs.gather(1, token[:, None])[:, 0], -math.inf
                )
                high = (confidence > threshold) if threshold is not None else None
                if high is not None and int(high.sum()) >= k:
                    commit = high.numpy()
                else:
                    commit = np.zeros(block_length, bool)
                    commit[confidence.topk(min(k, int(masked.sum()))).indices.numpy()] = True
                x[lo:hi][commit] = token.numpy()[commit]
            if np.isin(x[n:hi], stop_ids).any():
                break
        answer = x[n : n + gen_length].tolist()
        stops = [i for i, t in enumerate(answer) if t in stop_ids]
        return answer[: stops[0]] if stops else answer


def make_llada2(
    folder: str | Path,
    config: dict | None = None,
    *,
    seed: int = 0,
    std: float = 0.3,
    head_scale: float = 4.0,
    mask_head_scale: float = 1.0,
    shards: int = 2,
) -> LLaDA2Reference:
    """Random weights for `config` (default `TINY`) written as an HF LLaDA2 folder (sharded
    safetensors with an index, config.json, the char tokenizer: mask id from it).
    `mask_head_scale` scales the mask token's output row (above 1: the mask token is
    predicted at some positions)."""
    cfg = dict(config or TINY)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, scale=std):
        return scale * torch.randn(*shape, generator=gen)

    def norm(width):
        return 1 + 0.2 * torch.randn(width, generator=gen)

    m, d = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = {
        "model.word_embeddings.weight": normal(cfg["vocab_size"], m, scale=1.0),
        "model.norm.weight": norm(m),
        "lm_head.weight": normal(cfg["vocab_size"], m, scale=std * head_scale),
    }
    w["lm_head.weight"][MASK_ID] *= mask_head_scale

    def mlp(prefix, hidden):
        w[f"{prefix}.gate_proj.weight"] = normal(hidden, m)
        w[f"{prefix}.up_proj.weight"] = normal(hidden, m)
        w[f"{prefix}.down_proj.weight"] = normal(m, hidden)

    for i in range(cfg["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        w[f"{layer}.input_layernorm.weight"] = norm(m)
        w[f"{layer}.post_attention_layernorm.weight"] = norm(m)
        w[f"{layer}.attention.query_key_value.weight"] = normal((heads + 2 * kv) * d, m)
        w[f"{layer}.attention.dense.weight"] = normal(m, heads * d)
        if cfg.get("use_bias", True):  # the LLaDA2 config class's default
            w[f"{layer}.attention.dense.bias"] = normal(m)
        if cfg["use_qk_norm"]:
            w[f"{layer}.attention.query_layernorm.weight"] = norm(d)
            w[f"{layer}.attention.key_layernorm.weight"] = norm(d)
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{layer}.mlp", cfg["intermediate_size"])
            continue
        w[f"{layer}.mlp.gate.weight"] = normal(cfg["num_experts"], m, scale=0.5)
        w[f"{layer}.mlp.gate.expert_bias"] = normal(cfg["num_experts"], scale=0.1)
        for e in range(cfg["num_experts"]):
            mlp(f"{layer}.mlp.experts.{e}", cfg["moe_intermediate_size"])
        if cfg.get("num_shared_experts"):
            mlp(
                f"{layer}.mlp.shared_experts",
                cfg["moe_intermediate_size"] * cfg["num_shared_experts"],
            )
    names = sorted(w)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: w[n].contiguous() for n in names[s::shards]}, str(folder / file))
        weight_map.update({n: file for n in names[s::shards]})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_char_tokenizer(folder)
    return LLaDA2Reference(cfg, w)
