"""fp8 weights against bf16 at the bench shapes, random weights: the logits' relative L2
error and the share of equal argmaxes, and the share of equal tokens in a generation.

    python -m bench.fp8_error [--models dense moe] [--tiny]

The bench models (`bench.common.bench_model`: LLaDA-8B's and LLaDA-MoE's shapes, random
bf16 weights) and the same weights quantised (`djax.models.fp8.quantize_params`). The
logits are those of one whole-sequence forward (`djax.forward_logits`) of a random prompt
of `--prompt` tokens followed by `--gen` mask tokens, on every position and on the masked
ones; each `fp8_impl` is run. The control, `matched_noise`: the bf16 weights that fp8 would
quantise, each perturbed by Gaussian relative noise of its own fp8 rounding's relative RMS
(no fp8 anywhere), through the same forward: random weights amplify any perturbation
through the layers, and the control says how much of the fp8 error that explains. The
generation is the bench setting (`bench.common.SETTING`)
(4 tokens per forward) on the same prompt, its answer tokens compared position by position.

Writes JSON through `bench.common.save` (`fp8_error_<device>.json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import djax
from bench.common import SETTING, bench_model, model_config, save
from djax.models import fp8
from djax.models.kernel_choice import Shapes

IMPLS = ("dequant", "scaled")


@functools.partial(jax.jit, static_argnames="axes")
def _matched_noise(w: jax.Array, values: jax.Array, scale: jax.Array, axes: tuple, key) -> tuple:
    """(w times `1 + eps * z`, z standard normal per value, in w's dtype; eps) with eps
    the relative RMS error of w's fp8 rounding (`values`, `scale`: w quantised, made by a
    program of their own: inside one program XLA may skip the rounding to e4m3 and back,
    which its GPU compiler does), `||dequantize(values, scale) - w|| / ||w||`."""
    wf = w.astype(jnp.float32)
    eps = jnp.linalg.norm(fp8.dequantize(values, scale, axes, jnp.float32) - wf)
    eps = eps / jnp.linalg.norm(wf)
    noisy = wf * (1 + eps * jax.random.normal(key, w.shape, jnp.float32))
    return noisy.astype(w.dtype), eps


def matched_noise(params: dict, key: jax.Array) -> tuple[dict, list[float]]:
    """`params` with every weight that fp8 quantises (`fp8.contraction_axes`) perturbed by
    Gaussian relative noise of its own fp8 rounding's relative RMS (`_matched_noise`), the
    others as they are; and those RMS values. The control of the fp8 figures: how much a
    perturbation of the weights of the same size, with no fp8 in it, moves the logits."""
    out: dict = {}
    epsilons: list[float] = []
    for name, value in params.items():
        key, sub = jax.random.split(key)
        if isinstance(value, dict):
            out[name], more = matched_noise(value, sub)
            epsilons += more
            continue
        axes = fp8.contraction_axes(name, value.ndim)
        if axes is None:
            out[name] = value
            continue
        quantised = fp8.quantize_params({name: value})
        values, scale = quantised[name], quantised[fp8.scale_name(name)]
        out[name], eps = _matched_noise(value, values, scale, axes, sub)
        epsilons.append(float(eps))
    return out, epsilons


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
    noisy, epsilons = matched_noise(model.params, jax.random.key(1))
    ours = np.asarray(djax.forward_logits(dataclasses.replace(model, params=noisy), ids))
    del noisy
    row["matched_noise"] = {
        "weight_rel_rms": float(np.mean(epsilons)),
        "all": compare(reference, ours, everywhere),
        "masked": compare(reference, ours, masked),
    }
    del reference, ours
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
        # after every model: a run cut short keeps its rows
        save("fp8_error", {"options": vars(args), "results": rows})


if __name__ == "__main__":
    main()
