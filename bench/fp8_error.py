"""fp8 weights against bf16 at the bench shapes, random weights: the logits' relative L2
error and the share of equal argmaxes, and the share of equal tokens in a generation.

    python -m bench.fp8_error [--models dense moe] [--tiny]

The bench models (`bench.common.bench_model`: LLaDA-8B's and LLaDA-MoE's shapes, random
bf16 weights) and the same weights quantised (`djax.models.fp8.quantize_params`). The
logits are those of one whole-sequence forward (`djax.forward_logits`) of a random prompt
of `--prompt` tokens followed by `--gen` mask tokens, on every position and on the masked
ones; each `fp8_impl` is run. The generation is the bench setting (`bench.common.SETTING`)
(4 tokens per forward) on the same prompt, its answer tokens compared position by position.

Writes JSON through `bench.common.save` (`fp8_error_<device>.json`).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import djax
from bench.common import SETTING, bench_model, model_config, save
from djax.models import fp8
from djax.models.kernel_choice import Shapes

IMPLS = ("dequant", "scaled")


def compare(reference: np.ndarray, ours: np.ndarray, where: np.ndarray) -> dict:
    """Relative L2 error of `ours` against `reference` ([batch, seq, vocab] logits) and the
    share of equal argmaxes, over the positions `where` ([batch, seq] bool)."""
    a, b = reference[where].astype(np.float64), ours[where].astype(np.float64)
    return {
        "logits_rel_l2": float(np.linalg.norm(b - a) / np.linalg.norm(a)),
        "argmax_equal": float(np.mean(a.argmax(-1) == b.argmax(-1))),
    }


def measure(name: str, tiny: bool, prompt_len: int, gen_len: int) -> dict:
    config = model_config(name, tiny)
    model, _ = bench_model(config)
    quantised = dataclasses.replace(model, params=fp8.quantize_params(model.params), weights="fp8")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(1000, config.mask_token_id), prompt_len).tolist()
    ids = np.array([prompt + [config.mask_token_id] * gen_len])
    masked = ids == config.mask_token_id
    everywhere = np.ones_like(masked)
    reference = np.asarray(djax.forward_logits(model, ids))
    row: dict = {"model": name, "prompt_len": prompt_len, "gen_len": gen_len}
    for impl in IMPLS:
        ours = np.asarray(djax.forward_logits(quantised.with_options(fp8_impl=impl), ids))
        row[impl] = {
            "all": compare(reference, ours, everywhere),
            "masked": compare(reference, ours, masked),
        }
    del reference
    # the setting's 4 tokens per forward
    setting = dataclasses.replace(SETTING, gen_length=gen_len, steps=gen_len // 4)
    a = djax.generate(model, [prompt], setting).answer_ids
    b = djax.generate(quantised, [prompt], setting).answer_ids
    row["generation_tokens_equal"] = float(np.mean(a == b))
    block = setting.block_length
    shapes = Shapes(1, block, prompt_len + gen_len, block)
    row["fp8_kernels"] = quantised.kernel_choice(shapes).explain()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["dense", "moe"])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--gen", type=int, default=SETTING.gen_length, help="mask tokens after it")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        rows.append(measure(name, args.tiny, args.prompt, args.gen))
        print({k: v for k, v in rows[-1].items() if k != "fp8_kernels"}, flush=True)
    save("fp8_error", {"options": vars(args), "results": rows})


if __name__ == "__main__":
    main()
