"""Probe: does fp8 rounding of random weights move the logits more than Gaussian noise of
its size once a model is deep, at LLaDA-8B's width?

Question. On an H100, `bench.fp8_error` (LLaDA-8B's shape, random N(0, 0.02) weights, bf16
programs) found fp8's weight values moving the logits as much as matched relative noise at
8 layers (15.9% against 14.9%) but 4x more at 32 (60.4% against 16.3%), while on a CPU the
two agreed at 2-4 layers of full width and at 32 layers of width 512. Is the gap in the
arithmetic of rounding at full width and full depth, or in the GPU run?

Answer (CPU, 88ea472, `bench/results/fp8_depth_float32_cpu.json` and
`fp8_depth_bfloat16_cpu.json`, the table in bench/NOTES.md): at LLaDA-8B's width the
rounding moves the logits at most 1.1x as much as the noise at every depth up to 32 layers,
with fp32 or bf16 activations alike (32 layers: 27.4% against 25.0%; bf16 27.6% against
25.2%), and both grow with depth (~17% at 8 layers, ~21% at 16), where the GPU run's noise
control barely grew (14.9% at 8 layers, 16.3% at 32). So the GPU's 4x is not e4m3
rounding compounding with depth, in either precision: this replica and the GPU run differ
in more than the rounding.

On an H100 (a7d1c9d, `--dtype bfloat16`, `fp8_depth_bfloat16_NVIDIA_H100_80GB_HBM3_x2.json`)
the replica gives what the CPU gave: 27.7% against 25.2% at 32 layers (16: 21.7% against
20.2%). A first GPU run (4087e2b) measured no rounding at all (relative RMS 4e-8): the
quantisation and its inverse ran in one program, whose round trip the GPU compiler dropped;
they run as two programs since. So neither the GPU's arithmetic nor depth by itself sets
e4m3's rounding apart from noise of its size: the gap `bench.fp8_error` measures lies in
djax's model or in that bench's setup (at 16 layers there: rounding 25.8%, noise 17.8%).

The model is LLaDA-8B's decoder layer written out here (pre-norm RMSNorm with unit scales,
fused q/k/v, RoPE with theta 500000 on every head dim, bidirectional softmax attention,
SwiGLU of 12288, residual adds), not djax's modules: one layer's weights exist at a time,
drawn as bf16 N(0, 0.02) values from a seed, so three streams run in lockstep on any host:
the weights as drawn, their fp8 rounding (`djax.models.fp8.quantize` per output channel,
dequantised, in bf16: what `rounded_in_bf16` runs), and relative Gaussian noise of that
rounding's relative RMS (`matched_noise`'s control). The input is 128 random prompt rows
and 256 copies of one mask row (`bench.fp8_error`'s 128 + 256); logits through a random
[4096, 4096] head (rounded or noised as the layers are), relative L2 error and equal argmax
against the unperturbed stream, after `--report` layers.

    python -m bench.probes.fp8_depth [--layers 32] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import save
from djax.models import fp8

WIDTH, HEADS, HEAD_DIM, HIDDEN, THETA = 4096, 32, 128, 12288, 500000.0
PROMPT, POSITIONS, VOCAB = 128, 384, 4096


def _rms(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def _rope(x):
    """x [t, heads, head_dim] rotated by position (halves rotated together)."""
    pos = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None]
    inv = 1.0 / THETA ** (jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)
    cos, sin = jnp.cos(pos * inv)[:, None], jnp.sin(pos * inv)[:, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, -1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


@jax.jit
def _layer(x, qkv, out, gate_up, down):
    t = x.shape[0]
    q, k, v = (a.reshape(t, HEADS, HEAD_DIM) for a in jnp.split(_rms(x) @ qkv, 3, -1))
    scores = jnp.einsum("thd,shd->hts", _rope(q), _rope(k), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores / np.sqrt(HEAD_DIM), -1).astype(x.dtype)
    x = x + jnp.einsum("hts,shd->thd", probs, v).reshape(t, WIDTH) @ out
    gate, up = jnp.split(_rms(x) @ gate_up, 2, -1)
    return x + (jax.nn.silu(gate) * up) @ down


_quantize = jax.jit(lambda w: fp8.quantize(w, (0,)))


def _streams(w, key):
    """(the weight, its fp8 rounding, matched relative noise), each in bf16 values, and the
    rounding's relative RMS. The e4m3 values come out of a program of their own: inside one
    program a GPU compiler may drop the round trip (`xla_allow_excess_precision`)."""
    return _rounded_and_noise(w, *_quantize(w), key)


@jax.jit
def _rounded_and_noise(w, values, scale, key):
    rounded = fp8.dequantize(values, scale, (0,), jnp.float32)
    wf = w.astype(jnp.float32)
    eps = jnp.linalg.norm(rounded - wf) / jnp.linalg.norm(wf)
    noisy = wf * (1 + eps * jax.random.normal(key, w.shape))
    return tuple(a.astype(jnp.bfloat16) for a in (wf, rounded, noisy)), eps


def _weight(key, shape):
    return (0.02 * jax.random.normal(key, shape)).astype(jnp.bfloat16)


def run(layers: int, dtype, report: tuple[int, ...]) -> list[dict]:
    key = jax.random.key(0)
    mask = _weight(jax.random.fold_in(key, 10_000), (WIDTH,))
    prompt = _weight(jax.random.fold_in(key, 10_001), (PROMPT, WIDTH))
    x0 = jnp.concatenate([prompt, jnp.broadcast_to(mask, (POSITIONS - PROMPT, WIDTH))])
    xs = [x0.astype(dtype)] * 3
    head, _ = _streams(_weight(jax.random.fold_in(key, 20_000), (WIDTH, VOCAB)), key)
    shapes = ((WIDTH, 3 * WIDTH), (WIDTH, WIDTH), (WIDTH, 2 * HIDDEN), (HIDDEN, WIDTH))
    rows, start = [], time.perf_counter()
    for layer in range(layers):
        keys = jax.random.split(jax.random.fold_in(key, layer), 2 * len(shapes))
        made = [_streams(_weight(keys[i], s), keys[len(shapes) + i]) for i, s in enumerate(shapes)]
        xs = [_layer(x, *(w[stream].astype(dtype) for w, _ in made)) for stream, x in enumerate(xs)]
        if layer + 1 not in report and layer + 1 != layers:
            continue
        logits = [np.asarray(_rms(x).astype(jnp.float32) @ h.astype(jnp.float32))
                  for x, h in zip(xs, head, strict=True)]  # fmt: skip
        row = {"layers": layer + 1, "seconds": round(time.perf_counter() - start, 1)}
        for name, ours in zip(("rounded", "noise"), logits[1:], strict=True):
            row[name] = float(np.linalg.norm(ours - logits[0]) / np.linalg.norm(logits[0]))
            row[f"{name}_equal_argmax"] = float(np.mean(ours.argmax(-1) == logits[0].argmax(-1)))
        row["rounding_rms"] = [float(eps) for _, eps in made]
        print(row, flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--report", type=int, nargs="+", default=[2, 4, 8, 16, 24, 32])
    args = parser.parse_args(argv)
    rows = run(args.layers, jnp.dtype(args.dtype), tuple(args.report))
    save("fp8_depth", {"options": vars(args), "results": rows}, args.dtype)


if __name__ == "__main__":
    main()
