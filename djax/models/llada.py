"""LLaDA dense (LLaDA-8B): a Llama-style bidirectional transformer, and its HF name map.

HF layout (torch Linear weights are `[out, in]`):
`model.transformer.wte.weight` [vocab, model], per block `i`:
`model.transformer.blocks.{i}.{attn_norm,ff_norm}.weight`,
`...{q_proj,k_proj,v_proj}.weight`, `...attn_out.weight`, `...ff_proj.weight` (gate),
`...up_proj.weight`, `...ff_out.weight` (down); `model.transformer.ln_f.weight` and
`model.transformer.ff_out.weight` (output head).
"""

from __future__ import annotations

import flax.linen as nn

from djax.config import ModelConfig
from djax.models.layers import TransformerLM
from djax.models.sources import (
    ParamSource,
    attention_sources,
    copy,
    gate_up,
    transposed,
)


class LLaDA(TransformerLM):
    """LLaDA dense: every layer's feed-forward is a SwiGLU MLP of `config.mlp_hidden`."""

    def feed_forward(self, layer: int) -> nn.Module:
        return self.gated_mlp(layer)


def hf_sources(config: ModelConfig) -> list[ParamSource]:
    """Where each djax param comes from in an HF LLaDA folder."""
    t = "model.transformer"
    sources = [
        copy(("embed",), f"{t}.wte.weight"),
        copy(("final_norm", "scale"), f"{t}.ln_f.weight"),
        transposed(("lm_head",), f"{t}.ff_out.weight"),
    ]
    for i in range(config.n_layers):
        b = f"{t}.blocks.{i}"
        sources += [
            copy((f"attn_norm_{i}", "scale"), f"{b}.attn_norm.weight"),
            copy((f"ff_norm_{i}", "scale"), f"{b}.ff_norm.weight"),
            *attention_sources(
                config,
                f"attn_{i}",
                q=f"{b}.q_proj.weight",
                k=f"{b}.k_proj.weight",
                v=f"{b}.v_proj.weight",
                out=f"{b}.attn_out.weight",
            ),
            gate_up((f"ff_{i}", "gate_up"), f"{b}.ff_proj.weight", f"{b}.up_proj.weight"),
            transposed((f"ff_{i}", "down"), f"{b}.ff_out.weight"),
        ]
    return sources
