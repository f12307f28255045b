"""A weight matmul for few rows with its neighbours fused, as a Pallas Triton kernel: djax's
GPU path for the weight products of a denoising block forward (a few dozen token rows).

A 32-token LLaDA-8B block forward streams its weights through four matmuls per layer, and
between them XLA runs ~9 small kernels of ~2 µs each (two RMSNorms, two residual adds,
SiLU·up, ...): 0.6 ms of a 4.6 ms forward on an H200 (bench/NOTES.md). This kernel computes

    out = [residual +] epilogue(rms_norm?(x) @ w)

in one pass over the weights. The RMSNorm's sum of squares accumulates inside the loop over
the contraction axis and scales the fp32 accumulator at the end (a per-row scale commutes
with the product); the norm's elementwise scale multiplies each loaded tile of `x`. With a
`[k, 2, n]` weight (gate and up side by side, as `GatedMLP` stores them) it returns
`silu(x @ w[:, 0]) * (x @ w[:, 1])` from two accumulators.

Each program owns a `block_m x block_n` tile of the output and loops over the contraction
axis in `block_k` steps, Triton pipelining the weight loads over `num_stages`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape: a `block_m x block_n` output tile, `block_k` contraction steps,
    Triton's `num_warps` and `num_stages`. Each block is a power of two >= 16."""

    block_m: int = 32
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def _power_of_two_from_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _largest_block(n: int, limit: int) -> int:
    """The largest power of two <= limit that divides n."""
    block = limit
    while n % block:
        block //= 2
    return block


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """The program shape for an `[m, k] @ [k, n]` product: all rows in one tile up to 64,
    output columns split over at least ~256 programs, 256-wide contraction steps."""
    block_m = min(64, max(16, pl.next_power_of_2(m)))
    block_n = _largest_block(n, 64)
    while block_n > 16 and n // block_n < 256:
        block_n //= 2
    return Tiles(block_m=block_m, block_n=block_n, block_k=_largest_block(k, 256))


def fits(k: int, n: int) -> bool:
    """Whether the kernel takes a `[k, n]` weight: both dims multiples of 16 (row counts of
    any size are tiled and masked)."""
    return k % 16 == 0 and n % 16 == 0


def _kernel(x_ref, w_ref, scale_ref, residual_ref, out_ref, *, tiles, eps, swiglu):
    """One output tile. Refs are whole arrays: x [m, k], w [k, n] or [k, 2, n], scale [k] or
    None, residual [m, n] or None; out [m, n]."""
    from jax.experimental.pallas import triton as plgpu

    m, k = x_ref.shape
    rows = pl.ds(pl.program_id(0) * tiles.block_m, tiles.block_m)
    cols = pl.ds(pl.program_id(1) * tiles.block_n, tiles.block_n)
    row_ok = pl.program_id(0) * tiles.block_m + jnp.arange(tiles.block_m) < m
    sides = (0, 1) if swiglu else (None,)

    def step(i, carry):
        accs, sum_sq = carry
        ks = pl.ds(i * tiles.block_k, tiles.block_k)
        x = plgpu.load(x_ref.at[rows, ks], mask=row_ok[:, None], other=0.0)
        if scale_ref is not None:
            xf = x.astype(jnp.float32)
            sum_sq = sum_sq + jnp.sum(xf * xf, axis=1)
            x = x * scale_ref[ks][None, :]
        accs = tuple(
            acc
            + jnp.dot(
                x,
                w_ref[ks, cols] if side is None else w_ref[ks, side, cols],
                preferred_element_type=jnp.float32,
            )
            for acc, side in zip(accs, sides, strict=True)
        )
        return accs, sum_sq

    zeros = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
    carry = (tuple(zeros for _ in sides), jnp.zeros((tiles.block_m,), jnp.float32))
    accs, sum_sq = jax.lax.fori_loop(0, k // tiles.block_k, step, carry)
    if scale_ref is not None:
        inv_rms = jax.lax.rsqrt(sum_sq / k + eps)
        accs = tuple(acc * inv_rms[:, None] for acc in accs)
    out = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
    if residual_ref is not None:
        residual = plgpu.load(residual_ref.at[rows, cols], mask=row_ok[:, None], other=0.0)
        out = out + residual.astype(jnp.float32)
    plgpu.store(out_ref.at[rows, cols], out.astype(out_ref.dtype), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def fused_matmul(
    x: Array,
    w: Array,
    norm_scale: Array | None = None,
    residual: Array | None = None,
    eps: float = 1e-6,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> Array:
    """`[residual +] epilogue(rms_norm?(x) @ w)` in one kernel.

    x: [m, k]; w: [k, n], or [k, 2, n] for SwiGLU (returns `silu(x' @ w[:, 0]) *
    (x' @ w[:, 1])`); norm_scale: [k] or None — when given, x' is x RMS-normalised over k
    (with `eps`) times `norm_scale`, else x' = x; residual: [m, n] or None, added last.
    Returns [m, n] in x's dtype, accumulated in fp32. `tiles`: the program shape (default
    `tiles_for`); `interpret=True` runs on any backend (for tests on CPUs).
    """
    from jax.experimental.pallas import triton as plgpu

    m, k = x.shape
    swiglu = w.ndim == 3
    n = w.shape[-1]
    if w.shape[0] != k or (swiglu and w.shape[1] != 2) or not fits(k, n):
        raise ValueError(
            f"fused_matmul: x {x.shape}, w {w.shape}; expected w [k, n] or [k, 2, n] with "
            f"k = {k} and k, n multiples of 16"
        )
    if norm_scale is not None and norm_scale.shape != (k,):
        raise ValueError(f"fused_matmul: norm_scale {norm_scale.shape}; expected ({k},)")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"fused_matmul: residual {residual.shape}; expected ({m}, {n})")
    tiles = tiles or tiles_for(m, k, n)
    blocks = (tiles.block_m, tiles.block_n, tiles.block_k)
    if not all(map(_power_of_two_from_16, blocks)) or n % tiles.block_n or k % tiles.block_k:
        raise ValueError(
            f"{tiles}: blocks must be powers of two >= 16, block_n dividing n = {n} and "
            f"block_k dividing k = {k}"
        )
    kernel = functools.partial(_kernel, tiles=tiles, eps=eps, swiglu=swiglu)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, tiles.block_m), n // tiles.block_n),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=interpret,
        name="fused_matmul",
    )(x, w, norm_scale, residual)
