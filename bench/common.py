"""Shared benchmark plumbing: model shapes, random weights built on the device, the two
measured ceilings (HBM bandwidth, bf16 matmul rate), in-program timing, and result files.

Every result file records the device, the commit, the command and the date.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from djax import GenerationConfig, Model, block_diffusion, engine, generate, xla_options
from djax.config import LLADA2, ModelConfig, from_hf_dict
from djax.models import init_params
from djax.sharding import make_mesh, param_shardings
from djax.xla_options import compiler_options

RESULTS = Path(__file__).parent / "results"

LLADA_8B = {
    "architectures": ["LLaDAModelLM"],
    "d_model": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 32,
    "mlp_hidden_size": 12288,
    "vocab_size": 126464,
    "embedding_size": 126464,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_sequence_length": 4096,
    "mask_token_id": 126336,
    "eos_token_id": 126081,
    "pad_token_id": 126081,
}
LLADA_MOE = {
    "architectures": ["LLaDAMoEModelLM"],
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "expert_intermediate_size": 1024,
    "vocab_size": 157184,
    "rope_theta": 50000.0,
    "max_position_embeddings": 8192,
    "mask_token_id": 156895,
    "eos_token_id": 156892,
    "rms_norm_eps": 1e-6,
}
# LLaDA2.0-mini (16B total, ~1.4B active): the keys of its published `config.json` that set
# the shape, at their published values: 20 layers of width 2048, layer 0 a dense SwiGLU of
# 5120, the others 256 experts of 512, top-8 from the 4 best of 8 groups, plus one shared
# expert, routed scaling 2.5; 16 query / 4 kv heads of 128 with q/k norms, half of each head
# rotated, theta 600000; vocab 157,184; an untied head; no attention-output bias. The bench
# has no tokenizer: the mask and EOS ids are the family tokenizer's (LLaDA-MoE's above).
LLADA2_MINI = {
    "architectures": ["LLaDA2MoeModelLM"],
    "model_type": "llada2_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 20,
    "intermediate_size": 5120,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "rope_theta": 600000.0,
    "use_qk_norm": True,
    "use_bias": False,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "moe_intermediate_size": 512,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "vocab_size": 157184,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "mask_token_id": 156895,
    "eos_token_id": 156892,
    "pad_token_id": 156892,
}
# Same key sets, a few layers and small widths: for checking the scripts on a CPU.
TINY = {
    "dense": {
        **LLADA_8B,
        "d_model": 128,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "mlp_hidden_size": 256,
        "vocab_size": 512,
        "embedding_size": 512,
        "mask_token_id": 500,
        "eos_token_id": 501,
        "pad_token_id": 501,
    },
    "moe": {
        **LLADA_MOE,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "expert_intermediate_size": 64,
        "vocab_size": 512,
        "mask_token_id": 500,
        "eos_token_id": 501,
    },
    # 16 experts in 4 groups: a token's 4 experts come from 2 of them. Layer 0 dense, then
    # two MoE layers (a forward's last layer runs fewer rows than the others).
    "llada2_mini": {
        **LLADA2_MINI,
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 32,
        "vocab_size": 512,
        "mask_token_id": 500,
        "eos_token_id": 501,
        "pad_token_id": 501,
    },
}
MODELS = {"dense": LLADA_8B, "moe": LLADA_MOE, "llada2_mini": LLADA2_MINI}


def model_config(name: str, tiny: bool = False) -> ModelConfig:
    """`dense` (LLaDA-8B shape), `moe` (LLaDA-MoE-7B-A1B shape) or `llada2_mini`
    (LLaDA2.0-mini shape), read by the loader's own config reader."""
    if name not in MODELS:
        raise SystemExit(f"bench: model {name!r}; expected one of {sorted(MODELS)}")
    hf = TINY[name] if tiny else MODELS[name]
    return from_hf_dict(hf, f"bench:{name}")


# The setting every engine is compared on: batch 1, gen 256, block 32, 64 fixed steps (4
# tokens per forward), dual cache, no early stop (every answer position is generated).
SETTING = GenerationConfig(
    gen_length=256,
    block_length=32,
    steps=64,
    decoder="low_confidence",
    cache="dual",
    early_stop=False,
)


def bench_model(
    config: ModelConfig,
    devices: int = 1,
    options: Mapping[str, str] | None = None,
    weights: str = "dtype",
) -> tuple[Model, dict]:
    """A `Model` with random bf16 weights built on the device(s): on one device, or split
    over a mesh of `devices` (TP for dense models, EP for MoE), with kernel `options`
    (`KernelOptions` names), its projections and experts in fp8 under `weights="fp8"`.
    Returns (model, the split)."""
    split = {"expert_parallel" if config.is_moe else "tensor_parallel": devices}
    mesh = make_mesh(**split) if devices > 1 else None
    shardings = param_shardings(config, jnp.bfloat16, mesh, weights) if mesh else None
    params = init_params(config, jnp.bfloat16, seed=0, shardings=shardings, weights=weights)
    model = Model(config, params, None, jnp.bfloat16, mesh=mesh, weights=weights)
    # through `with_options`, which moves the params to the layout the options hold
    return model.with_options(**dict(options or {})), split


def parse_options(text: str) -> dict[str, str]:
    """Module options from the command line: `default` (none), or `key=value[,key=value]`
    (e.g. `norm_impl=xla,rope_impl=xla`). Values stay strings, as the `*_impl` options are."""
    if text == "default":
        return {}
    pairs = [item.partition("=") for item in text.split(",")]
    if any(not key or not sep or not value for key, sep, value in pairs):
        raise SystemExit(f"bench: options {text!r}; expected 'default' or key=value[,key=value]")
    return {key: value for key, _, value in pairs}


def weight_bytes(params: dict, experts_read: float | None = None, head: bool = True) -> int:
    """Bytes of every weight a forward reads (the embedding is gathered, not read whole;
    `head=False`: a forward without logits, which reads no `lm_head`).

    `experts_read`: how many of each MoE layer's stacked experts (`gate_up` [experts, model,
    2, ffn], `down` [experts, ffn, model]) the forward's tokens are routed to, on average;
    None counts every expert."""
    skipped = ("embed",) if head else ("embed", "lm_head")
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if path[0].key in skipped:
            continue
        name = path[-1].key
        stacked = (name, x.ndim) in (("gate_up", 4), ("down", 3))
        share = experts_read / x.shape[0] if stacked and experts_read is not None else 1.0
        total += x.nbytes * share
    return int(total)


def spread_routing(route):
    """`route` with each token's experts moved by top_k x its row index (mod the experts):
    a token keeps its weights and its own experts' spacing, but consecutive tokens go to
    different experts, so a block reaches as many experts as a well-spread trained router
    would send it to (all 64 of LLaDA-MoE's for a 32-token block). The bench's random router
    sends the mask tokens that fill a block to the same few experts."""

    def spread(*args):
        weights, experts = route(*args)
        n_experts = args[1].shape[1]
        shift = jnp.arange(experts.shape[0], dtype=experts.dtype)[:, None] * experts.shape[1]
        return weights, (experts + shift) % n_experts

    return spread


def spread_grouped_routing(route_grouped):
    """`route_grouped` (LLaDA2's group-limited router) with each token's experts moved inside
    the group layout: token row r's groups rotate by r (mod the groups) and, inside each
    group, its experts by r // groups (mod the group's size). A token keeps its weights, its
    experts' count in each group and so its `groups_per_token` groups (rotated); consecutive
    tokens go to other groups and other places in them, so a block's tokens reach many
    experts, as a trained router's would, where the random router sends the mask tokens
    that fill a block to one token's few."""

    def spread(x, router, expert_bias, top_k, groups, groups_per_token, scaling):
        weights, experts = route_grouped(
            x, router, expert_bias, top_k, groups, groups_per_token, scaling
        )
        size = router.shape[1] // groups
        row = jnp.arange(experts.shape[0], dtype=experts.dtype)[:, None]
        group = (experts // size + row) % groups
        place = (experts % size + row // groups) % size
        return weights, group * size + place

    return spread


ROUTINGS = ("model", "spread")


def router_of(config: ModelConfig) -> tuple[Any, str]:
    """The module and name of the function that routes a MoE family's tokens (patched by
    `use_routing` and `experts_hit`)."""
    from djax.models import llada2, llada_moe

    return (llada2, "route_grouped") if config.family == LLADA2 else (llada_moe, "route")


def use_routing(routing: str) -> None:
    """Route the MoE families' tokens as `--routing` says, for the whole process: `model`
    (the random router's own choice) or `spread` (`spread_routing` for LLaDA-MoE,
    `spread_grouped_routing` for LLaDA2). With `spread` the compile cache moves to a fresh
    folder, so no program saved with the model's routing is read."""
    from djax.models import llada2, llada_moe

    if routing == "spread":
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="djax_spread_"))
        llada_moe.route = spread_routing(llada_moe.route)
        llada2.route_grouped = spread_grouped_routing(llada2.route_grouped)


def experts_hit(
    model: Model, prompts: list[list[int]], config: GenerationConfig
) -> dict[str, float]:
    """The mean number of experts a MoE layer's tokens are routed to, per kind of forward.

    LLaDA families: the whole-sequence forwards (`whole`: refreshes, the most token rows)
    and the others (`window`: blocks, and the refreshes' last layer, which runs the block's
    rows only). Block diffusion (LLaDA2) under its cache: the prompt blocks' `prefill`, the
    block forwards (`block`) and each block's first step, which feeds the block before it
    too (`block_and_previous`); without the cache, `whole`. Calls are told apart by their
    token rows: a forward's last layer runs only the rows it returns (the block's, counted
    with `block`; the prefill's one row, not counted), and a kind with as many rows as
    another is counted with it (under both names). A kind with no call of its own rows is
    left out (`weight_bytes` then counts every expert).

    Counted by running the generation once more with the family's router reporting every
    call's expert ids to the host, as a program of its own (neither the compiled programs in
    memory nor the saved ones are used or kept). A random router can send a block's tokens
    to a few experts only, and the floors must count what the forwards read."""
    counts: dict[int, list[int]] = {}  # token rows per call -> experts reached per call
    module, name = router_of(model.config)
    route = getattr(module, name)

    def record(experts):
        counts.setdefault(experts.shape[0], []).append(len(np.unique(experts)))

    def counting_route(*args):
        weights, experts = route(*args)
        jax.debug.callback(record, experts)
        return weights, experts

    with (
        mock.patch.object(module, name, counting_route),
        mock.patch.object(engine, "_EXECUTABLES", {}),
        mock.patch.object(engine, "programs_folder", lambda: None),
    ):
        jax.block_until_ready(generate(model, prompts, config).answer_ids)
    if model.config.block_diffusion:
        plan, _ = block_diffusion.make_plan(model, config, prompts)
        if plan.cached:  # token rows per sequence of each kind of forward
            rows = {"block": plan.block_len, "block_and_previous": 2 * plan.block_len}
            rows |= {"prefill": plan.prefix_len} if plan.prefill else {}
        else:
            rows = {"whole": plan.seq_len}
        batch = len(prompts)
        return {
            k: float(np.mean(counts[batch * n])) for k, n in rows.items() if batch * n in counts
        }
    whole = max(counts)  # the padded sequence: refreshes
    window = [c for rows, per_call in counts.items() if rows != whole for c in per_call]
    return {"whole": float(np.mean(counts[whole]))} | (
        {"window": float(np.mean(window))} if window else {}
    )


def device_info() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "device": devices[0].device_kind,
        "device_count": len(devices),
        "platform": devices[0].platform,
        "jax": jax.__version__,
    }


def commit() -> str:
    if os.environ.get("DJAX_COMMIT"):
        return os.environ["DJAX_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compile_loop(
    step, state, iters: int, *operands, options: dict | None = None, donate: bool = False
):
    """`step(state, *operands) -> state` run `iters` times inside one compiled `fori_loop`
    (as the engine runs forwards: no host round trip in between), as `call(state) -> the
    state for the next call`, returned once the call has ended. Weights go in `operands`,
    never in a closure (they would be baked into the program). `options`: XLA compiler
    options (default: the engine's, `djax.xla_options`). `donate`: the program takes
    `state`'s buffers and each call the last one's state, as the engine does with its K/V
    buffers (a state of tens of GB then needs no second copy); the caller's `state` is
    consumed by the first call. Without it every call starts from the caller's `state`."""

    def loop(state, *operands):
        return jax.lax.fori_loop(0, iters, lambda _, c: step(c, *operands), state)

    if options is None:
        options = compiler_options(jax.default_backend())
    program = jax.jit(loop, donate_argnums=0 if donate else ())
    compiled = program.lower(state, *operands).compile(options)

    def call(state):
        out = jax.block_until_ready(compiled(state, *operands))
        return out if donate else state

    return call


def time_in_program(
    step,
    state,
    iters: int,
    *operands,
    repeats: int = 5,
    options: dict | None = None,
    donate: bool = False,
) -> float:
    """Median seconds per step of `compile_loop`'s program (`iters` steps a call), over
    `repeats` calls after a first one."""
    call = compile_loop(step, state, iters, *operands, options=options, donate=donate)
    state = call(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = call(state)
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def measure_ceilings(tiny: bool = False) -> dict[str, float]:
    """Device-to-device bandwidth (bytes read + written), HBM read bandwidth, and the bf16
    and fp8 (e4m3) matmul rates, measured."""
    n = 1 << (20 if tiny else 30)  # 2 GiB of bf16 per buffer on a GPU
    x = jnp.full((n,), 1.5, jnp.bfloat16)
    # x * 0.5 + 0.75 keeps x at 1.5: one read and one write per element, nothing to fold.
    seconds = time_in_program(lambda a: a * 0.5 + 0.75, x, 4 if tiny else 20)
    bandwidth = 2 * x.nbytes / seconds
    # Read-only, as weights are read by a forward: a sum whose result feeds the next pass.
    seconds = time_in_program(
        lambda c, x: c + jnp.sum(x * c, dtype=jnp.float32) * 1e-9,
        jnp.float32(1),
        4 if tiny else 20,
        x,
    )
    read_bandwidth = x.nbytes / seconds
    size = 256 if tiny else 8192
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    # Scaled so repeated products keep unit variance (random data, never zeros or inf).
    b = (jax.random.normal(jax.random.key(1), (size, size)) / np.sqrt(size)).astype(jnp.bfloat16)
    seconds = time_in_program(lambda c, b: c @ b, a, 2 if tiny else 20, b)
    matmul_rate = 2 * size**3 / seconds
    # e4m3 x e4m3 -> bf16 (Hopper's fp8 tensor cores), the product cast back to e4m3 for the
    # next: twice the size, so the cast's pass over the product is a small share.
    size *= 2
    a8 = jax.random.normal(jax.random.key(0), (size, size)).astype(jnp.float8_e4m3fn)
    b8 = (jax.random.normal(jax.random.key(1), (size, size)) / np.sqrt(size)).astype(a8.dtype)
    seconds = time_in_program(
        lambda c, b: jnp.dot(c, b, preferred_element_type=jnp.bfloat16).astype(c.dtype),
        a8,
        2 if tiny else 10,
        b8,
    )
    return {
        "hbm_bytes_per_s": bandwidth,
        "hbm_read_bytes_per_s": read_bandwidth,
        "matmul_flops_per_s": matmul_rate,
        "fp8_matmul_flops_per_s": 2 * size**3 / seconds,
    }


def device_name(info: dict[str, Any]) -> str:
    """The device part of a result file's name: the device kind with underscores for spaces,
    and `_x<count>` when the machine has more than one device (`NVIDIA_H200_x2`)."""
    kind = info["device"].replace(" ", "_")
    return kind if info["device_count"] == 1 else f"{kind}_x{info['device_count']}"


def save(name: str, payload: dict[str, Any], setting: str | None = None) -> Path:
    """Write a result JSON as `<name>[_<setting>]_<device>.json` (`device_name`) under $OUT
    (the device machine's return folder) when set, else under bench/results/: one file per
    suite (and setting, where `name` or `setting` carries one) and device, replaced by the
    next run. The record (benchmark `name`) holds the device, the commit, the command, the
    date and, where the user set any, the XLA options of `$DJAX_XLA_OPTIONS` (which change
    every program the run compiles); git keeps the earlier runs."""
    info = device_info()
    now = datetime.datetime.now(datetime.timezone.utc)
    user_options = os.environ.get(xla_options.ENV, "").strip()
    record = {
        "benchmark": name,
        **info,
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": now.isoformat(timespec="seconds"),
        **({"xla_options_env": user_options} if user_options else {}),
        **payload,
    }
    folder = Path(os.environ.get("OUT") or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    stem = name if setting is None else f"{name}_{setting}"
    path = folder / f"{stem}_{device_name(info)}.json"
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(record, indent=2))
    staging.replace(path)
    print(f"wrote {path}")
    return path
