"""fp8 weights against bf16 at the bench shapes, random weights: the logits' relative L2
error and the share of equal argmaxes, and the share of equal tokens in a generation.

    python -m bench.fp8_error [--models dense moe] [--layers N] [--tiny]

The bench models (`bench.common.bench_model`: LLaDA-8B's and LLaDA-MoE's shapes, random
bf16 weights) and the same weights quantised (`djax.models.fp8.quantize_params`). The
logits are those of one whole-sequence forward (`djax.forward_logits`) of a random prompt
of `--prompt` tokens followed by `--gen` mask tokens, on every position and on the masked
ones; each `fp8_impl` is run. The control, `matched_noise`: the bf16 weights that fp8 would
quantise, each perturbed by Gaussian relative noise of its own fp8 rounding's relative RMS
(no fp8 anywhere), through the same forward: random weights amplify any perturbation
through the layers, and the control says how much of the fp8 error that explains.
`rounded_in_bf16`: fp8's weight values (dequantised to bf16) through the bf16 program, the
rounding alone; `program_gap`: that against the fp8 `dequant` program on the same values.
`--layers N` keeps each model's first N layers (how the errors grow with depth). The
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


def dequantized(params: dict, dtype) -> dict:
    """The fp8 `params` (`fp8.quantize_params`' layout) as a params dict of `dtype`: each fp8
    weight's values times its scale (`fp8.dequantize`), the scales dropped, the rest as
    they are: the weights fp8 holds, for the bf16 program."""
    out: dict = {}
    for name, value in params.items():
        if isinstance(value, dict):
            out[name] = dequantized(value, dtype)
        elif fp8.values_name(name) is None:
            scale = params.get(fp8.scale_name(name))
            if scale is None:
                out[name] = value
            else:
                axes = fp8.contraction_axes(name, value.ndim)
                out[name] = _dequantize(value, scale, axes, jnp.dtype(dtype))
    return out


@functools.partial(jax.jit, static_argnames=("axes", "dtype"))
def _dequantize(values, scale, axes, dtype):
    return fp8.dequantize(values, scale, axes, dtype)


def with_layers(config, layers: int | None):
    """`config` cut to its first `layers` layers (None: as it is)."""
    if layers is None:
        return config
    if not 0 < layers <= config.n_layers:
        raise SystemExit(f"bench: --layers {layers}; expected 1 to {config.n_layers}")
    moe_layers = config.moe_layers[:layers] if config.moe_layers else ()
    return dataclasses.replace(config, n_layers=layers, moe_layers=moe_layers)


def compare(reference: np.ndarray, ours: np.ndarray, where: np.ndarray) -> dict:
    """Relative L2 error of `ours` against `reference` ([batch, seq, vocab] logits) and the
    share of equal argmaxes, over the positions `where` ([batch, seq] bool)."""
    a, b = reference[where].astype(np.float64), ours[where].astype(np.float64)
    return {
        "logits_rel_l2": float(np.linalg.norm(b - a) / np.linalg.norm(a)),
        "argmax_equal": float(np.mean(a.argmax(-1) == b.argmax(-1))),
    }


def measure(name: str, tiny: bool, prompt_len: int, gen_len: int, layers=None) -> dict:
    config = with_layers(model_config(name, tiny), layers)
    model, _ = bench_model(config)
    quantised = dataclasses.replace(model, params=fp8.quantize_params(model.params), weights="fp8")
    quantised = quantised.with_options()  # the layout `auto` holds on this device
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(1000, config.mask_token_id), prompt_len).tolist()
    ids = np.array([prompt + [config.mask_token_id] * gen_len])
    masked = ids == config.mask_token_id
    everywhere = np.ones_like(masked)
    reference = np.asarray(djax.forward_logits(model, ids))
    row: dict = {"model": name, "layers": config.n_layers, "prompt_len": prompt_len}
    row["gen_len"] = gen_len
    by_impl = {}
    for impl in IMPLS:
        ours = np.asarray(djax.forward_logits(quantised.with_options(fp8_impl=impl), ids))
        by_impl[impl] = ours
        row[impl] = {
            "all": compare(reference, ours, everywhere),
            "masked": compare(reference, ours, masked),
        }
    # fp8's weight values through the bf16 program: the rounding alone, and the programs'
    # own difference on the same values
    rounded = dataclasses.replace(model, params=dequantized(quantised.params, model.dtype))
    ours = np.asarray(djax.forward_logits(rounded, ids))
    del rounded
    row["rounded_in_bf16"] = {
        "all": compare(reference, ours, everywhere),
        "masked": compare(reference, ours, masked),
    }
    row["program_gap"] = {"all": compare(ours, by_impl["dequant"], everywhere)}
    del by_impl
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
    p.add_argument("--layers", type=int, default=None, help="only the first N layers")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        rows.append(measure(name, args.tiny, args.prompt, args.gen, args.layers))
        print({k: v for k, v in rows[-1].items() if k != "fp8_kernels"}, flush=True)
        # after every model: a run cut short keeps its rows
        save("fp8_error", {"options": vars(args), "results": rows})


if __name__ == "__main__":
    main()
