"""Model configuration: a frozen dataclass read from a Hugging Face `config.json`.

LLaDA and LLaDA-MoE both say `model_type: llada`; the `architectures` entry decides which
model family a folder holds. Token ids come from the config and, where it is silent, from
the tokenizer (see `resolve_token_ids`), never from constants in the code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

DENSE = "llada"
MOE = "llada_moe"
LLADA2 = "llada2"  # LLaDA2.0 (`model_type: llada2_moe`): block diffusion, djax.llada2_config
ARCHITECTURES = {"LLaDAModelLM": DENSE, "LLaDAMoEModelLM": MOE, "LLaDA2MoeModelLM": LLADA2}

# Token strings that end a chat turn in the LLaDA family's tokenizers, in order of preference.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|role_end|>", "<end_of_turn>")
MASK_TOKENS = ("<|mdm_mask|>", "<|mask|>", "[MASK]")
# The weight formats a model may hold (`djax.load(weights=...)`, `djax.models.fp8`): every
# weight in the model's dtype, or the projections and experts as e4m3 with fp32 scales.
WEIGHTS = ("dtype", "fp8")


def check_weights(weights: Any) -> str:
    """`weights` if it names a weight format, else a ValueError naming it and `WEIGHTS`."""
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}; expected one of {WEIGHTS}")
    return weights


class ConfigError(ValueError):
    """A model folder's config.json is missing, unsupported or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a LLaDA-family model (hashable: a static jit argument).

    Attributes use djax names; `from_hf_dict` maps the HF keys onto them. MoE fields are
    zero/empty for the dense model. `moe_layers[i]` says whether layer i is a MoE layer.
    """

    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    rope_theta: float
    rms_norm_eps: float
    max_seq_len: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    eot_token_id: int | None = None
    bos_token_id: int | None = None
    rotary_dim: int | None = None
    qk_norm: bool = False
    clip_qkv: float | None = None
    attn_out_bias: bool = False  # LLaDA2's `use_bias`: a bias on the attention output
    n_experts: int = 0
    experts_per_token: int = 0
    expert_hidden: int = 0
    shared_expert_hidden: int = 0
    norm_topk_prob: bool = False
    router_expert_bias: bool = False
    moe_layers: tuple[bool, ...] = ()
    expert_groups: int = 1  # LLaDA2's group-limited routing: experts in this many groups,
    groups_per_token: int = 1  # of which each token's experts come from this many
    routed_scaling: float = 1.0  # LLaDA2: the routed experts' weights times this
    extra_eos_ids: tuple[int, ...] = ()  # config.json's EOS ids after the first (a list)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def block_diffusion(self) -> bool:
        """Whether the family generates by block diffusion (`djax.block_diffusion`)."""
        return self.family == LLADA2

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS (every id of config.json's list, where it lists several) and end-of-turn: the
        ids that end an answer."""
        ids = [self.eos_token_id, *self.extra_eos_ids]
        if self.eot_token_id is not None:
            ids.append(self.eot_token_id)
        return tuple(dict.fromkeys(ids))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object, as a dict; `ConfigError` naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: holds a JSON {type(value).__name__}; expected an object")
    return value


def load_hf_config(folder: str | Path) -> dict[str, Any]:
    """Read `folder/config.json` as a dict, with a clear error if it is absent or broken."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; expected a Hugging Face model folder")
    return read_json_object(path)


def family_of(hf: dict[str, Any], source: str) -> str:
    """Route by `architectures`: both LLaDA families say `model_type: llada`. LLaDA2's own
    `model_type` (`llada2_moe`) names it even where `architectures` is missing."""
    archs = hf.get("architectures")
    if not archs and hf.get("model_type") == "llada2_moe":
        return LLADA2
    if not archs:
        raise ConfigError(
            f"{source}: key 'architectures' is missing; expected one of {sorted(ARCHITECTURES)}"
        )
    listed = archs if isinstance(archs, list) else []
    known = [a for a in listed if isinstance(a, str) and a in ARCHITECTURES]
    if not known:
        raise ConfigError(
            f"{source}: architectures={archs} is not supported; expected one of "
            f"{sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[known[0]]


def _mask_id(r: _Reader) -> int:
    """config.json's mask id, or -1 (then the tokenizer's, `resolve_token_ids`) where the key
    is absent, null or an empty list."""
    value = r.first_id("mask_token_id")
    return -1 if value is None else value


def from_hf_dict(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a `ModelConfig` from an HF config dict (token ids not yet resolved from the
    tokenizer: see `resolve_token_ids`)."""
    family = family_of(hf, source)
    reader = _Reader(hf, source)
    if family == LLADA2:
        from djax.llada2_config import llada2_config

        config = llada2_config(reader)
    else:
        config = _dense_config(reader) if family == DENSE else _moe_config(reader)
    for field in (*_SIZES, "rope_theta", "rms_norm_eps"):
        value = getattr(config, field)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{source}: {field}={value}; expected a finite number > 0")
    return config


# The ModelConfig sizes every model needs to be positive.
_SIZES = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "max_seq_len",
)


class _Reader:
    """Typed access to config keys with errors that name the file and the key."""

    def __init__(self, hf: dict[str, Any], source: str):
        self.hf = hf
        self.source = source

    def get(self, key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
        if key not in self.hf or self.hf[key] is None:
            if default is dataclasses.MISSING:
                raise ConfigError(f"{self.source}: required key '{key}' is missing")
            return default
        value = self.hf[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value) if abs(value) < 2**1023 else math.inf
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(
                f"{self.source}: key '{key}'={value!r} should be of type {kind.__name__}"
            )
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{self.source}: key '{key}'={self.hf[key]!r} should be finite")
        return value

    def ids(self, key: str) -> tuple[int, ...]:
        """An id key that may hold an int or a list of ints (HF allows both), every one
        checked; () where it is absent, null or an empty list."""
        value = self.hf.get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        for item in values:
            if not isinstance(item, int) or isinstance(item, bool):
                raise ConfigError(
                    f"{self.source}: key '{key}'={value!r} should be an integer id or a list "
                    "of them"
                )
        return tuple(values)

    def first_id(self, key: str) -> int | None:
        """The first id of an id key (`ids`), or None."""
        ids = self.ids(key)
        return ids[0] if ids else None

    def refuse(self, key: str, supported: Any, why: str) -> None:
        """Raise if `key` is present with a value other than `supported`."""
        if key in self.hf and self.hf[key] is not None and self.hf[key] != supported:
            raise ConfigError(
                f"{self.source}: {key}={self.hf[key]!r} is not supported "
                f"(expected {supported!r}): {why}"
            )

    def positive(self, **values: int) -> None:
        for key, value in values.items():
            if value <= 0:
                raise ConfigError(f"{self.source}: key '{key}'={value} must be positive")


def _check_heads(r: _Reader, n_heads: int, n_kv: int, head_dim: int) -> None:
    if n_heads % n_kv:
        raise ConfigError(f"{r.source}: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
    if head_dim % 2:
        raise ConfigError(f"{r.source}: head_dim={head_dim} must be even for RoPE")


def _dense_config(r: _Reader) -> ModelConfig:
    for key, ok, why in [
        ("alibi", False, "djax implements RoPE only"),
        ("rope", True, "djax implements RoPE only"),
        ("weight_tying", False, "LLaDA uses an untied output head"),
        ("include_bias", False, "LLaDA has no biases"),
        ("include_qkv_bias", False, "LLaDA has no biases"),
        ("attention_layer_norm", False, "LLaDA-8B has no q/k norm"),
        ("layer_norm_type", "rms", "LLaDA uses RMSNorm"),
        ("block_type", "llama", "LLaDA-8B uses Llama-style blocks"),
        ("activation_type", "silu", "LLaDA uses SwiGLU"),
        ("scale_logits", False, "LLaDA does not scale logits"),
        ("input_emb_norm", False, "LLaDA has no embedding norm"),
        ("multi_query_attention", False, "use n_kv_heads instead"),
        ("block_group_size", 1, "djax runs one block per group"),
    ]:
        r.refuse(key, ok, why)
    d_model = r.get("d_model", int)
    n_heads = r.get("n_heads", int)
    n_kv = r.get("n_kv_heads", int, n_heads)
    n_layers = r.get("n_layers", int)
    vocab = r.get("embedding_size", int, None) or r.get("vocab_size", int)
    mlp_hidden = r.get("mlp_hidden_size", int, None)
    if mlp_hidden is None:
        mlp_hidden = r.get("mlp_ratio", int) * d_model
    r.positive(
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        n_layers=n_layers,
        vocab_size=vocab,
        mlp_hidden_size=mlp_hidden,
    )
    if d_model % n_heads:
        raise ConfigError(f"{r.source}: d_model={d_model} is not a multiple of n_heads={n_heads}")
    head_dim = d_model // n_heads
    _check_heads(r, n_heads, n_kv, head_dim)
    eos = r.first_id("eos_token_id")
    if eos is None:
        raise ConfigError(f"{r.source}: required key 'eos_token_id' is missing")
    pad = r.first_id("pad_token_id")
    return ModelConfig(
        family=DENSE,
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        mlp_hidden=mlp_hidden,
        rope_theta=r.get("rope_theta", float, 10000.0),
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-5),
        max_seq_len=r.get("max_sequence_length", int, 4096),
        mask_token_id=_mask_id(r),
        eos_token_id=eos,
        extra_eos_ids=r.ids("eos_token_id")[1:],
        pad_token_id=eos if pad is None else pad,
        bos_token_id=r.first_id("bos_token_id"),
        eot_token_id=r.first_id("eot_token_id"),
    )


def _moe_config(r: _Reader) -> ModelConfig:
    r.refuse("attention_bias", False, "LLaDA-MoE has no attention biases")
    r.refuse("tie_word_embeddings", False, "LLaDA-MoE uses an untied output head")
    r.refuse("moe_router_score_function", "softmax", "djax routes with a softmax")
    r.refuse("rope_scaling", None, "djax implements plain RoPE")
    r.refuse("hidden_act", "silu", "LLaDA-MoE uses SwiGLU experts")
    r.refuse(
        "routed_scaling_factor",
        1.0,
        "the LLaDA-MoE reference never applies it, so another value has no agreed meaning",
    )
    d_model = r.get("hidden_size", int)
    n_heads = r.get("num_attention_heads", int)
    n_kv = r.get("num_key_value_heads", int, n_heads)
    n_layers = r.get("num_hidden_layers", int)
    vocab = r.get("vocab_size", int)
    n_experts = r.get("num_experts", int)
    top_k = r.get("num_experts_per_tok", int)
    expert_hidden = r.get("expert_intermediate_size", int, None) or r.get(
        "moe_intermediate_size", int
    )
    head_dim = r.get("head_dim", int, None)
    r.positive(
        hidden_size=d_model,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        num_hidden_layers=n_layers,
        vocab_size=vocab,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        expert_intermediate_size=expert_hidden,
    )
    head_dim = d_model // n_heads if head_dim is None else head_dim
    if top_k > n_experts:
        raise ConfigError(
            f"{r.source}: num_experts_per_tok={top_k} exceeds num_experts={n_experts}"
        )
    _check_heads(r, n_heads, n_kv, head_dim)
    freq = r.hf.get("moe_layer_freq", 1)
    moe_layers = _moe_layer_pattern(r, freq, n_layers)
    dense_hidden = r.get("dense_intermediate_size", int, 0)
    if not all(moe_layers) and dense_hidden <= 0:
        raise ConfigError(
            f"{r.source}: moe_layer_freq={freq} asks for dense layers but "
            "'dense_intermediate_size' is missing"
        )
    partial = r.get("partial_rotary_factor", float, 1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0 or partial > 1:
        raise ConfigError(
            f"{r.source}: partial_rotary_factor={partial} gives rotary_dim="
            f"{rotary_dim}; expected an even size in (0, head_dim]"
        )
    eos = r.first_id("eos_token_id")
    if eos is None:
        raise ConfigError(f"{r.source}: required key 'eos_token_id' is missing")
    pad = r.first_id("pad_token_id")
    clip = r.get("clip_qkv", float, None)
    return ModelConfig(
        family=MOE,
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        mlp_hidden=dense_hidden,
        rope_theta=r.get("rope_theta", float, 10000.0),
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6),
        max_seq_len=r.get("max_position_embeddings", int, 4096),
        mask_token_id=_mask_id(r),
        eos_token_id=eos,
        extra_eos_ids=r.ids("eos_token_id")[1:],
        pad_token_id=eos if pad is None else pad,
        bos_token_id=r.first_id("bos_token_id"),
        eot_token_id=r.first_id("eot_token_id"),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        qk_norm=r.get("qk_layernorm", bool, True),
        clip_qkv=clip,
        n_experts=n_experts,
        experts_per_token=top_k,
        expert_hidden=expert_hidden,
        shared_expert_hidden=r.get("shared_expert_intermediate_size", int, 0) or 0,
        # The LLaDA-MoE reference's MoE block never renormalises its top-k weights, whatever
        # config.json's `norm_topk_prob` says (it hard-codes False), so neither does djax.
        norm_topk_prob=False,
        router_expert_bias=r.get("moe_router_enable_expert_bias", bool, False),
        moe_layers=moe_layers,
    )


def _moe_layer_pattern(r: _Reader, freq: Any, n_layers: int) -> tuple[bool, ...]:
    """`moe_layer_freq`: an int k (every k-th layer is MoE, k=1: all) or a per-layer list of
    1 (MoE) / 0 (dense)."""
    if isinstance(freq, list):
        if len(freq) != n_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError(
                f"{r.source}: moe_layer_freq={freq} should list 0/1 for each of "
                f"the {n_layers} layers"
            )
        return tuple(bool(v) for v in freq)
    if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise ConfigError(
            f"{r.source}: moe_layer_freq={freq!r} should be a positive int or a "
            "list of 0/1 per layer"
        )
    return tuple((i + 1) % freq == 0 for i in range(n_layers))


def resolve_token_ids(config: ModelConfig, tokenizer: Any | None, source: str) -> ModelConfig:
    """Fill in the mask, end-of-turn and BOS ids from the tokenizer where the config is silent
    (and EOS, which only LLaDA2's config may leave out, `eos_token_id` -1: the tokenizer's,
    else the pad id).

    The mask id is required: a dLLM cannot generate without it.
    """
    changes: dict[str, Any] = {}
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if config.eos_token_id < 0:  # LLaDA2: its pad token is its EOS
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        eos = config.pad_token_id if eos is None and config.pad_token_id >= 0 else eos
        if eos is None:
            raise ConfigError(
                f"{source}: no 'eos_token_id' or 'pad_token_id' in config.json and no "
                "tokenizer with an EOS token"
            )
        changes["eos_token_id"] = eos
    if config.pad_token_id < 0:
        changes["pad_token_id"] = changes.get("eos_token_id", config.eos_token_id)
    if config.mask_token_id < 0:
        mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        if mask is None:
            mask = next((vocab[t] for t in MASK_TOKENS if t in vocab), None)
        if mask is None:
            raise ConfigError(
                f"{source}: no 'mask_token_id' in config.json and the tokenizer "
                f"has no mask token (looked for {MASK_TOKENS})"
            )
        changes["mask_token_id"] = mask
    if config.eot_token_id is None:
        eot = next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), None)
        if eot is not None:
            changes["eot_token_id"] = eot
    if config.bos_token_id is None and tokenizer is not None:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None:
            changes["bos_token_id"] = bos
    resolved = config.replace(**changes)
    named = [(n, getattr(resolved, n)) for n in ("mask_token_id", "eos_token_id", "pad_token_id")]
    for name, value in named + [("eos_token_id", i) for i in resolved.extra_eos_ids]:
        if not 0 <= value < resolved.vocab_size:
            raise ConfigError(
                f"{source}: {name}={value} is outside the vocabulary [0, {resolved.vocab_size})"
            )
    eos_ids = [resolved.eos_token_id, *resolved.extra_eos_ids]
    if resolved.mask_token_id in (*eos_ids, resolved.pad_token_id):
        raise ConfigError(
            f"{source}: mask_token_id={resolved.mask_token_id} is also the EOS or padding id "
            f"(eos {eos_ids if len(eos_ids) > 1 else eos_ids[0]}, pad {resolved.pad_token_id}); "
            "expected an id of its own (an answer's masks would read as finished or as padding)"
        )
    return resolved
