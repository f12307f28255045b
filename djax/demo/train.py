"""Train the demo dLLM: a tiny LLaDA on `djax.demo.task`, with the masked-diffusion SFT loss.

    python -m djax.demo.train --out djax/demo/model [--steps N | --minutes M] [--seed S]

Recipe (LLaDA SFT): each example draws t in (eps, 1]; every answer token (the answer, the
end-of-turn token and the EOS padding to `task.GEN_LENGTH`) is replaced by the mask id with
probability t, prompt tokens never; the loss is the cross-entropy on masked positions
weighted by 1/t, divided by the answer length. The t of a batch are stratified (one per
1/batch slice of (eps, 1]), which keeps the estimator unbiased with less variance.

The forward is djax's own Flax module, so the trained params are exactly what `djax.load`
runs. The result is written as an HF LLaDA folder (bf16 safetensors, config.json, the char
tokenizer, and `demo.json` with the training record), then scored through `djax.load` +
`djax.generate`. Deterministic given the seed and step count (`--minutes` picks the step
count from measured speed and prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from djax.checkpoint import save_hf
from djax.config import ModelConfig, from_hf_dict, resolve_token_ids
from djax.demo import METADATA, evaluate, task
from djax.demo.tokenizer import build_char_tokenizer, save_char_tokenizer
from djax.generation import GENERATION_FILE
from djax.models import build_module, init_params

VOCAB = 128  # the char tokenizer uses 103 ids; the rest are never produced
MASK_EPS = 1e-3
TIMING_FROM, TIMING_TO = 20, 220  # steps timed (after compilation) to size a --minutes run
# Training mix over task.TASKS (add, sort, reverse): addition, the hardest, gets half.
TASK_WEIGHTS = (0.5, 0.3, 0.2)


def hf_config(d_model: int, n_layers: int, n_heads: int, mlp_hidden: int, tokenizer: Any) -> dict:
    """An HF LLaDA-8B-style config.json dict for the demo architecture."""
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "alibi": False,
        "block_type": "llama",
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_heads,
        "mlp_hidden_size": mlp_hidden,
        "mlp_ratio": 4,
        "embedding_size": VOCAB,
        "vocab_size": VOCAB,
        "rope": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 128,
        "layer_norm_type": "rms",
        "include_bias": False,
        "include_qkv_bias": False,
        "weight_tying": False,
        "mask_token_id": tokenizer.mask_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "scale_logits": False,
        "input_emb_norm": False,
        "attention_layer_norm": False,
        "block_group_size": 1,
    }


@dataclasses.dataclass(frozen=True)
class Layout:
    """How problems become fixed-shape training rows: the chat prompt left-padded with EOS to
    `prompt_len` tokens, then `gen_length` answer tokens (answer, end-of-turn, EOS...)."""

    char_ids: np.ndarray  # [256] token id of each ASCII code
    prefix: tuple[int, ...]  # chat template tokens before the problem text
    suffix: tuple[int, ...]  # ... and after it (the assistant turn's header)
    eos_id: int
    eot_id: int
    gen_length: int = task.GEN_LENGTH

    @property
    def prompt_len(self) -> int:
        return len(self.prefix) + task.MAX_PROMPT_CHARS + len(self.suffix)

    def encode(self, problems: task.Problems) -> dict[str, np.ndarray]:
        """tokens [n, prompt_len + gen_length] int32, key_valid [n, seq] bool, positions."""
        n = len(problems)
        fixed = lambda ids: (
            np.broadcast_to(np.array(ids, np.int32), (n, len(ids))),
            np.ones((n, len(ids)), bool),
        )
        width = problems.prompt.shape[1]
        content = (
            self.char_ids[problems.prompt].astype(np.int32),
            np.arange(width) < problems.prompt_len[:, None],
        )
        prompt, prompt_len = task.pack([fixed(self.prefix), content, fixed(self.suffix)], True)
        if prompt_len.max() > self.prompt_len or problems.answer_len.max() >= self.gen_length:
            raise ValueError("a problem is longer than the layout (task.MAX_*_CHARS) allows")
        prompt = np.pad(prompt, ((0, 0), (max(self.prompt_len - prompt.shape[1], 0), 0)))
        prompt = prompt[:, -self.prompt_len :]
        valid = np.arange(self.prompt_len) >= self.prompt_len - prompt_len[:, None]
        answer = np.full((n, self.gen_length), self.eos_id, np.int32)
        width = problems.answer.shape[1]
        answer[:, :width] = np.where(
            np.arange(width) < problems.answer_len[:, None],
            self.char_ids[problems.answer],
            self.eos_id,
        )
        answer[np.arange(n), problems.answer_len] = self.eot_id
        tokens = np.concatenate([np.where(valid, prompt, self.eos_id), answer], axis=1)
        key_valid = np.concatenate([valid, np.ones((n, self.gen_length), bool)], axis=1)
        positions = np.maximum(np.cumsum(key_valid, axis=1) - 1, 0).astype(np.int32)
        return {"tokens": tokens, "key_valid": key_valid, "positions": positions}


def make_layout(tokenizer: Any) -> Layout:
    """The training layout, with the chat template split around the problem text."""
    marker = "\x00"
    before, after = task.chat_prompt(tokenizer, marker).split(marker)
    encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    vocab = tokenizer.get_vocab()
    char_ids = np.full(256, vocab[tokenizer.unk_token], np.int32)
    for code in range(128):
        char_ids[code] = vocab.get(chr(code), char_ids[code])
    return Layout(
        char_ids,
        encode(before),
        encode(after),
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|eot_id|>"),
    )


def check_layout(layout: Layout, tokenizer: Any) -> None:
    """The training rows must hold exactly the ids `djax.generate(..., chat=True)` feeds."""
    problems = task.sample(np.random.default_rng(0), 8, "train")
    rows = layout.encode(problems)
    for i, (prompt, answer) in enumerate(problems.texts()):
        expected = tokenizer(task.chat_prompt(tokenizer, prompt), add_special_tokens=False)
        got = rows["tokens"][i, : layout.prompt_len][rows["key_valid"][i, : layout.prompt_len]]
        assert got.tolist() == expected["input_ids"], (prompt, got, expected)
        answer_ids = rows["tokens"][i, layout.prompt_len :].tolist()
        assert tokenizer.decode(answer_ids[: len(answer)]) == answer, (answer, answer_ids)


def demo_model_config(hf: dict, tokenizer: Any) -> ModelConfig:
    return resolve_token_ids(from_hf_dict(hf, "demo"), tokenizer, "demo")


def answer_logits(
    module: Any, params: dict, tokens: jax.Array, batch: dict[str, jax.Array], prompt_len: int
) -> jax.Array:
    """fp32 logits [rows, gen_length, vocab] of the answer region of `tokens` [rows, seq]."""
    x = module.apply({"params": params}, tokens, method="embed")
    hidden, _ = module.apply(
        {"params": params},
        x,
        batch["positions"],
        batch["key_valid"],
        hidden_start=prompt_len,
        hidden_len=tokens.shape[1] - prompt_len,
    )
    return module.apply({"params": params}, hidden, method="logits")


def diffusion_loss(
    module: Any,
    params: dict,
    batch: dict[str, jax.Array],
    key: jax.Array,
    prompt_len: int,
    mask_id: int,
) -> jax.Array:
    """LLaDA SFT loss of a batch: masked-token cross-entropy / t, per answer token."""
    tokens = batch["tokens"]
    answer = tokens[:, prompt_len:]
    rows, gen = answer.shape
    t_key, mask_key = jax.random.split(key)
    strata = (jnp.arange(rows) + jax.random.uniform(t_key, (rows,))) / rows
    t = (MASK_EPS + (1 - MASK_EPS) * strata)[:, None]
    masked = jax.random.uniform(mask_key, answer.shape) < t
    noisy = tokens.at[:, prompt_len:].set(jnp.where(masked, mask_id, answer))
    log_probs = jax.nn.log_softmax(answer_logits(module, params, noisy, batch, prompt_len), -1)
    nll = -jnp.take_along_axis(log_probs, answer[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(masked, nll / t, 0.0)) / (rows * gen)


def one_shot_accuracy(
    module: Any, params: dict, batch: dict[str, jax.Array], prompt_len: int, mask_id: int
) -> tuple[jax.Array, jax.Array]:
    """Exact-match and token accuracy of predicting every answer token in a single forward
    from a fully masked answer: a cheap lower bound on iterative decoding, for progress."""
    tokens = batch["tokens"]
    noisy = tokens.at[:, prompt_len:].set(mask_id)
    logits = answer_logits(module, params, noisy, batch, prompt_len)
    right = jnp.argmax(logits, axis=-1) == tokens[:, prompt_len:]
    return jnp.mean(jnp.all(right, axis=1)), jnp.mean(right)


def make_optimizer(weight_decay: float):
    """Clipped Adam with decoupled weight decay on matrices; the learning rate is applied by
    the step (it is an argument, so the schedule can be sized after timing)."""
    import optax

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.99),
        optax.add_decayed_weights(
            weight_decay, mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)
        ),
    )


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 5% of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * progress)))


def make_steps(module: Any, optimizer: Any, prompt_len: int, mask_id: int, compute_dtype: Any):
    """The jitted train step (params and optimizer state donated) and the progress probe.
    Master params stay fp32; the forward runs in `compute_dtype`."""
    import optax

    cast = lambda params: jax.tree.map(lambda a: a.astype(compute_dtype), params)

    def train_step(params, opt_state, batch, key, lr):
        loss_of = lambda p: diffusion_loss(module, cast(p), batch, key, prompt_len, mask_id)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        return params, opt_state, loss

    def probe(params, batch):
        return one_shot_accuracy(module, cast(params), batch, prompt_len, mask_id)

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(probe)


def fit_steps(args: argparse.Namespace, per_step: float, elapsed: float, step: int) -> int:
    """The run's step count: `--steps`, or fewer when they would not fit in `--minutes`.
    Sized at step `TIMING_TO`; with `--warmup` ≥ that, `--steps <count>` replays the run."""
    total = args.steps
    if args.minutes:
        total = min(total, step + int((args.minutes * 60 - elapsed) / per_step))
    print(
        f"{per_step * 1e3:.1f} ms/step: training {total} steps"
        + (f" (--steps {total} reproduces this run)" if total < args.steps else ""),
        flush=True,
    )
    return total


def to_device(rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in rows.items()}


def train(args: argparse.Namespace) -> dict:
    """Run the training loop; returns the fp32 params, config and the training record."""
    tokenizer = build_char_tokenizer()
    layout = make_layout(tokenizer)
    check_layout(layout, tokenizer)
    hf = hf_config(args.d_model, args.layers, args.heads, args.mlp_hidden, tokenizer)
    config = demo_model_config(hf, tokenizer)
    compute_dtype = jnp.dtype(args.compute_dtype)
    module = build_module(config, compute_dtype)
    params = init_params(config, jnp.float32, args.seed)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(
        f"model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, mlp "
        f"{args.mlp_hidden}: {n_params / 1e6:.2f}M params; rows of {layout.prompt_len} prompt + "
        f"{layout.gen_length} answer tokens; batch {args.batch}; device "
        f"{jax.devices()[0].device_kind}",
        flush=True,
    )
    optimizer = make_optimizer(args.weight_decay)
    opt_state = optimizer.init(params)
    train_step, probe = make_steps(
        module, optimizer, layout.prompt_len, config.mask_token_id, compute_dtype
    )
    rng = np.random.default_rng(args.seed)
    probe_rows = to_device(
        layout.encode(task.sample(np.random.default_rng(args.seed + 1), 1024, "test"))
    )
    key = jax.random.key(args.seed)
    total, start, losses, history, marks = args.steps, time.perf_counter(), [], [], []
    step = 0
    while step < total:
        batch = to_device(
            layout.encode(task.sample(rng, args.batch, "train", weights=TASK_WEIGHTS))
        )
        lr = learning_rate(step, total, args.lr, args.warmup)
        params, opt_state, loss = train_step(
            params, opt_state, batch, jax.random.fold_in(key, step), jnp.float32(lr)
        )
        losses.append(loss)
        step += 1
        if step in (TIMING_FROM, TIMING_TO):
            jax.block_until_ready(loss)
            marks.append(time.perf_counter())
            if step == TIMING_TO:
                per_step = (marks[1] - marks[0]) / (TIMING_TO - TIMING_FROM)
                total = fit_steps(args, per_step, marks[1] - start, step)
        if step % args.log_every == 0 or step == total:
            exact, token_acc = probe(params, probe_rows)
            history.append(
                {
                    "step": step,
                    "loss": float(np.mean(jax.device_get(losses))),
                    "one_shot": float(exact),
                    "seconds": time.perf_counter() - start,
                }
            )
            losses = []
            print(
                f"step {step:6d}/{total}  loss {history[-1]['loss']:.4f}  lr {lr:.2e}  one-shot "
                f"exact {float(exact):.3f} (tokens {float(token_acc):.4f})  "
                f"{history[-1]['seconds']:6.0f}s",
                flush=True,
            )
    return {
        "params": params,
        "config": config,
        "hf": hf,
        "n_params": n_params,
        "steps": total,
        "seconds": time.perf_counter() - start,
        "history": history,
    }


def score_folder(folder: Path, n: int, seed: int, batch: int) -> dict:
    """Exact match on `n` held-out problems through `djax.load` + `djax.generate`."""
    import djax

    model = djax.load(folder)
    problems = task.make_problems(n, "test", seed)
    configs = {
        "low_confidence_1_per_step": evaluate.demo_config(
            decoder="low_confidence", steps=task.GEN_LENGTH, cache="none"
        ),
        "threshold_0.9_dual": evaluate.demo_config(decoder="threshold", cache="dual"),
    }
    results = {}
    for name, config in configs.items():
        result, texts = evaluate.score(model, problems, config, batch)
        results[name] = result.summary() | {"by_task": evaluate.accuracy_by_task(problems, texts)}
        print(
            f"{name}: exact match {result.accuracy:.4f} on {n} held-out problems; "
            f"{result.forwards_per_answer:.1f} forwards/answer, "
            f"{result.tokens_per_forward:.2f} tokens/forward (batch {batch}); by task "
            + ", ".join(f"{k} {v:.3f}" for k, v in results[name]["by_task"].items()),
            flush=True,
        )
    return results


REPRODUCED_BY = (
    "seed",
    "batch",
    "lr",
    "warmup",
    "weight_decay",
    "d_model",
    "layers",
    "heads",
    "mlp_hidden",
    "compute_dtype",
)


def reproduce_command(args: argparse.Namespace, steps: int) -> str:
    """The command that trains the same model again (fixed step count, no wall budget)."""
    options = " ".join(
        f"--{name.replace('_', '-')} {getattr(args, name)}" for name in REPRODUCED_BY
    )
    return f"python -m djax.demo.train --out {args.out} --steps {steps} {options}"


def save(folder: Path, run: dict, args: argparse.Namespace) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_hf(folder, run["config"], run["params"], run["hf"], dtype=ml_dtypes.bfloat16)
    save_char_tokenizer(folder)
    record = {
        "description": "djax demo dLLM: a tiny LLaDA trained with the masked-diffusion SFT "
        "loss on addition, sorting and reversal (djax.demo.task)",
        "trained_on": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "n_params": run["n_params"],
        "steps": run["steps"],
        "train_seconds": round(run["seconds"], 1),
        "seed": args.seed,
        "batch": args.batch,
        "command": args.command,
        "reproduce": reproduce_command(args, run["steps"]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "task_weights": dict(zip(task.TASKS, TASK_WEIGHTS, strict=True)),
        "final_loss": run["history"][-1]["loss"] if run["history"] else None,
        "history": run["history"],
    }
    (folder / METADATA).write_text(json.dumps(record, indent=2))
    generation = {"gen_length": task.GEN_LENGTH, "block_length": task.BLOCK_LENGTH}
    (folder / GENERATION_FILE).write_text(json.dumps(generation, indent=2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m djax.demo.train", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, type=Path, help="output model folder")
    p.add_argument("--steps", type=int, default=12000, help="optimizer steps (schedule length)")
    p.add_argument(
        "--minutes", type=float, default=None, help="wall budget: fewer steps if they won't fit"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--d-model", type=int, default=160)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=5)
    p.add_argument("--mlp-hidden", type=int, default=480)
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--eval", type=int, default=512, help="held-out problems scored at the end")
    p.add_argument("--eval-batch", type=int, default=128)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        p.error(f"--steps {args.steps} and --batch {args.batch} must be ≥ 1")
    if args.minutes is not None and args.minutes <= 0:
        p.error(f"--minutes {args.minutes}; expected > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = " ".join(["python -m djax.demo.train", *argv])
    # Reproducible on GPU: deterministic scatter (the embedding gradient is a scatter-add).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_gpu_exclude_nondeterministic_ops=true"
    ).strip()
    run = train(args)
    save(args.out, run, args)
    print(f"saved {args.out}", flush=True)
    if args.eval:
        record = json.loads((args.out / METADATA).read_text())
        record["eval"] = {
            "problems": args.eval,
            "seed": 1234,
            **score_folder(args.out, args.eval, 1234, args.eval_batch),
        }
        (args.out / METADATA).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
