"""Sparse attention (`attention_sparsity`): the block forward's speed at the LLaDA-8B or
LLaDA-MoE shape, and the demo model's accuracy, against dense attention.

    python -m bench.sparse [--parts speed accuracy] [--prompt-lens 1024 4096 8192] [--batches 1]
                           [--shape dense|moe] [--routing spread|model]
                           [--keep 0.25] [--recents 64] [--profile]
                           [--keeps 1.0 0.5 0.25 0.1] [--window 8]
                           [--tiny]

speed: random bf16 weights of `--shape` (LLaDA-8B's shape, `dense`, the default; or
LLaDA-MoE's, `moe`, its tokens routed as `--routing` says: `spread` by default, as a trained
router spreads a block's tokens over the experts, `bench.common.use_routing`) built on the
device; for each prompt length P, a
32-token dual-cache block forward (the block at position P, gen 256: P + 256 keys) with
dense attention and with each head attending to its `keys = ceil(keep·S) + 32 + R` chosen
positions (block, the R before it, the rest drawn at random: the speed does not depend on
which), their rows outside the block gathered once before the timed loop, as the engine
gathers them once a block (`sparse_attention.compact`); one sparse row per recent window R
in `--recents` (default 64, `attention_window`'s default), beside one dense timing. Medians
of forwards run back to back in one compiled loop (`time_in_program`); `speedup` = dense ms
/ sparse ms.
`--batches`: rows a block forward. `--profile`: each row also holds where a dense and a
sparse block forward spend their device time, per forward (`bench.profile.profile_in_program`:
busy µs per category and per costly kernel, from a trace of one timed loop).
`attention`: the block forwards' attention path, dense and sparse alike (`split_kv` on a
Hopper GPU: the sparse forward's kept rows and its window's in one kernel call,
`sparse_attention.attend_kept`). Also the
refresh of one row (a whole-sequence forward over S keeping the block) with and without
choosing the keys, for the choice's cost. Saved as `sparse_speed_<device>.json`
(`sparse_speed_moe_<device>.json` for `--shape moe`; the rows name the model and routing).

accuracy: the demo model on held-out demo problems (`djax.demo.task`, as `bench.decoders`),
`low_confidence` (one token per step: most of a block's steps reuse the cache) and
`threshold` 0.9, both under the dual cache, at each keep fraction; the demo's sequences are
at most 128 positions, so its recent window is `--window` (default 8, one block) rather than
the option's default 64, which would keep every position. `accuracy_delta` = exact match
minus dense exact match. Saved as `sparse_accuracy_<device>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from bench.common import ROUTINGS, model_config, save, time_in_program, use_routing
from bench.decoders import add_demo_arguments, demo_payload, demo_problems, evaluate
from bench.forward import random_kv
from bench.profile import profile_in_program
from djax import programs
from djax.kernel_options import KernelOptions
from djax.models import init_params
from djax.models.kernel_choice import Shapes
from djax.models.layers import Window
from djax.models.sparse_attention import RECENT, SparseAttention, compact, kept_keys

BLOCK = 32
GEN = 256


def random_choice(
    rule: SparseAttention, layers: int, batch: int, kv_heads: int, seq: int, block_row: int
):
    """Chosen keys [layers, batch, kv_heads, rule.keys] as the rule keeps them (the block and
    the `recent` positions before it) with the others drawn at random, ascending."""
    score = jax.random.uniform(jax.random.key(3), (layers, batch, kv_heads, seq))
    index = jnp.arange(seq)
    forced = (index >= block_row - rule.recent) & (index < block_row + BLOCK)
    score = jnp.where(forced, 2.0, score)
    return jnp.sort(jax.lax.top_k(score, rule.keys)[1], axis=-1).astype(jnp.int32)


def block_loop(module, config, batch: int, seq: int, block_row: int, chosen) -> tuple:
    """(step, state) of a dual-cache block forward of `batch` rows at `block_row` over `seq`
    keys, for `compile_loop` (`step(state, params) -> state`, the state donated); `chosen`
    None is dense, else each layer's kept rows are gathered once (outside the timed loop)
    for the block's window and carried by the loop, as the engine carries them (each
    forward writes its window's K/V into their window slots)."""
    x = jax.random.normal(jax.random.key(1), (batch, BLOCK, config.d_model), module.dtype)
    positions = jnp.broadcast_to(block_row + jnp.arange(BLOCK, dtype=jnp.int32), (batch, BLOCK))
    valid = jnp.ones((batch, seq), bool)
    kv = jax.tree.map(
        lambda a: jnp.broadcast_to(a, (batch, *a.shape[1:])), random_kv(config, seq, module.dtype)
    )
    kept = None
    if chosen is not None:
        gather = jax.jit(
            lambda chosen, kv: tuple(
                compact(chosen[i], k, v, valid, block_row, BLOCK, BLOCK)
                for i, (k, v) in enumerate(kv)
            )
        )
        kept = gather(chosen, kv)

    def step(carry, params):
        x, kv, kept = carry
        out = module.apply(
            {"params": params},
            x,
            positions,
            valid,
            kv,
            Window(block_row),
            0,
            BLOCK,
            True,
            kept_kv=kept,
        )
        hidden, kv = out[:2]
        if kept is not None:  # the window's K/V went to the kept rows' window slots
            kept = out[2]
        logits = module.apply({"params": params}, hidden, method="logits")
        return x + (1e-6 * jnp.mean(logits)).astype(x.dtype), kv, kept

    return step, (x, kv, kept)


def time_refresh(module, params, config, seq: int, block_row: int, rule, iters: int) -> float:
    """A refresh over `seq` positions keeping the block at `block_row`; with `rule`, it
    also chooses every head's keys."""
    x = jax.random.normal(jax.random.key(1), (1, seq, config.d_model), module.dtype)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    valid = jnp.ones((1, seq), bool)

    def step(x, params):
        out = module.apply(
            {"params": params}, x, positions, valid, None, Window(), block_row, BLOCK, sparse=rule
        )
        logits = module.apply({"params": params}, out[0], method="logits")
        extra = 0.0 if rule is None else 1e-9 * jnp.sum(out[2][..., 0])
        return x + (1e-6 * jnp.mean(logits) + extra).astype(x.dtype)

    return time_in_program(step, x, iters, params)


def speed_rows(args, config, params, dtype, batch: int, prompt_len: int) -> list[dict]:
    """The speed part's rows at `batch` rows and `prompt_len`: dense against sparse at each
    recent window of `args.recents`, the dense forward timed once."""
    seq = prompt_len + GEN
    shapes = Shapes(batch, BLOCK, seq, BLOCK)
    kernels = programs.kernel_choice(KernelOptions(), config, dtype, shapes)
    module = programs.local_module(config, dtype, kernels, None)
    rules = {
        recent: SparseAttention(args.keep, recent, kept_keys(args.keep, recent, seq, BLOCK))
        for recent in args.recents
    }
    forms = {"dense": None}
    for recent, rule in rules.items():
        forms[recent] = random_choice(
            rule, config.n_layers, batch, config.n_kv_heads, seq, prompt_len
        )
    ms, profiles = {}, {}
    for name, kept in forms.items():
        step, state = block_loop(module, config, batch, seq, prompt_len, kept)
        ms[name] = 1e3 * time_in_program(step, state, args.iters, params, donate=True)
        if args.profile:  # a fresh state: the timing consumed the last one
            step, state = block_loop(module, config, batch, seq, prompt_len, kept)
            profiles[name] = profile_in_program(step, state, args.iters, params, donate=True)
    timed_refresh = args.refresh_iters and batch == 1  # the refresh is timed for one row

    def refresh_ms(rule) -> float:
        seconds = time_refresh(module, params, config, seq, prompt_len, rule, args.refresh_iters)
        return 1e3 * seconds

    dense_refresh = refresh_ms(None) if timed_refresh else None  # once, beside every rule
    rows = []
    for recent, rule in rules.items():
        refresh = {}
        if timed_refresh:
            refresh = {"refresh_dense_ms": dense_refresh, "refresh_sparse_ms": refresh_ms(rule)}
        profile = {}
        if args.profile:
            profile = {"dense_profile": profiles["dense"], "sparse_profile": profiles[recent]}
        row = {
            "case": f"batch {batch}, block {BLOCK} at {prompt_len}, {seq} keys, recent {recent}",
            "model": args.shape,
            "batch": batch,
            "sparse": dataclasses.asdict(rule),
            "prompt_len": prompt_len,
            "keys": seq,
            "attention": kernels.block.layers.attention,
            "dense_ms": ms["dense"],
            "sparse_ms": ms[recent],
            "speedup": ms["dense"] / ms[recent],
            **refresh,
            **profile,
        }
        print(row, flush=True)
        rows.append(row)
    return rows


def speed(args) -> None:
    dtype = jnp.bfloat16
    config = model_config(args.shape, args.tiny)
    routing = args.routing if config.is_moe else None
    if routing is not None:
        use_routing(routing)
    params = init_params(config, dtype, seed=0)
    payload = {"model": args.shape, "routing": routing, "tiny": args.tiny, "block": BLOCK}
    rows = []
    for batch in args.batches:
        for prompt_len in args.prompt_lens:
            rows.extend(speed_rows(args, config, params, dtype, batch, prompt_len))
            # saved after every row: a run cut short keeps the rows it measured
            save(
                "sparse",
                {**payload, "gen": GEN, "results": rows},
                setting="speed" if args.shape == "dense" else f"speed_{args.shape}",
            )


def accuracy(args) -> None:
    import djax
    from djax.demo import task
    from djax.demo.evaluate import demo_config

    folder, problems = demo_problems(args)
    model = djax.load(folder, args.dtype)
    decoders = {
        "low_confidence": {"decoder": "low_confidence", "steps": task.GEN_LENGTH},
        "threshold": {"decoder": "threshold", "threshold": 0.9},
    }
    rows = []
    for name, fields in decoders.items():
        dense_accuracy = None
        for keep in args.keeps:
            config = demo_config(
                **fields, cache="dual", attention_sparsity=keep, attention_window=args.window
            )
            totals, result = evaluate(model, problems, config, args.batch, f"{name} keep {keep}")
            if keep == 1.0:
                dense_accuracy = result.accuracy
            delta = None if dense_accuracy is None else result.accuracy - dense_accuracy
            rows.append(
                {
                    "decoder": name,
                    "cache": "dual",
                    "keep": keep,
                    "window": args.window,
                    "config": dataclasses.asdict(config),
                    **totals,
                    "accuracy_delta": delta,
                }
            )
    payload = demo_payload(folder, str(model.dtype), args)
    save("sparse", {**payload, "results": rows}, setting="accuracy")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--parts", nargs="+", default=["speed", "accuracy"], choices=["speed", "accuracy"]
    )
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[1024, 4096, 8192])
    p.add_argument("--shape", choices=("dense", "moe"), default="dense", help="speed: the model")
    p.add_argument(
        "--routing", choices=ROUTINGS, default="spread", help="speed, moe: see use_routing"
    )
    p.add_argument("--batches", nargs="+", type=int, default=[1], help="speed: rows a forward")
    p.add_argument("--keep", type=float, default=0.25, help="speed: the keep fraction")
    p.add_argument(
        "--recents",
        nargs="+",
        type=int,
        default=[RECENT],
        help="speed: the recent windows (positions before the block every head keeps)",
    )
    p.add_argument("--iters", type=int, default=20, help="speed: block forwards per timing")
    p.add_argument(
        "--profile", action="store_true", help="speed: where each forward's device time goes"
    )
    p.add_argument(
        "--refresh-iters", type=int, default=2, help="speed: refreshes per timing (0: skip)"
    )
    p.add_argument("--tiny", action="store_true", help="speed: tiny shapes (CPU check)")
    p.add_argument("--keeps", nargs="+", type=float, default=[1.0, 0.5, 0.25, 0.1])
    p.add_argument("--window", type=int, default=8, help="accuracy: the recent window")
    add_demo_arguments(p)  # accuracy: the demo task's options
    args = p.parse_args(argv)
    if args.keeps[0] != 1.0:
        raise SystemExit("bench.sparse: --keeps must start with 1.0 (the dense reference)")
    for part in args.parts:
        {"speed": speed, "accuracy": accuracy}[part](args)


if __name__ == "__main__":
    main()
