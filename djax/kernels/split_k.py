"""A split-K matmul for few rows, as a Pallas Triton kernel, whose fp32 partial products are
summed by the kernel that consumes them: djax's GPU path for the q/k/v, attention-output and
down products of a denoising block forward.

With 32 rows these products read megabytes of weights to produce a few hundred kilobytes,
and the output alone has too few tiles to occupy every SM (4096 columns are 32 tiles of 128
on 132 SMs). Cutting the contraction into `splits` slices gives each SM its own stream of
weight tiles; the slices' sums come back as `Partials`. XLA does the same with its own
split-K GEMMs, but their reduction is a separate kernel whenever the consumer is a custom
call, which would cost djax's fused residual/norm and RoPE kernels their gain.
Here the consumers (`residual_norm.add_rms_norm`, `rope_write.rope_and_write`) add the
slices themselves, and `Partials.total()` does it for XLA paths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling
from djax.kernels.handoff import Partials

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape: a `block_m x block_n` output tile over one of `splits` equal slices
    of the contraction, in `block_k` steps; Triton's `num_warps` and `num_stages`."""

    block_m: int = 32
    block_n: int = 128
    block_k: int = 64
    splits: int = 4
    num_warps: int = 4
    num_stages: int = 4


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """Column tiles of up to 128 and the fewest contraction slices that give one wave of programs
    (>= 96, for a GPU of ~132 SMs); 128-wide steps when unsplit, else 64. At LLaDA-8B's
    block products this leaves q/k/v (4096 -> 12288) unsplit and cuts the attention output
    (4096 -> 4096) and down (12288 -> 4096) products into 4 slices."""
    block_n = tiling.largest_block(n, 128)
    splits = 1
    while (n // block_n) * splits < 96 and k % (splits * 2 * 64) == 0 and splits < 8:
        splits *= 2
    block_k = tiling.largest_block(k // splits, 128 if splits == 1 else 64)
    return Tiles(block_m=tiling.row_block(m), block_n=block_n, block_k=block_k, splits=splits)


def _kernel(x_ref, w_ref, out_ref, *, tiles, steps, program=None):
    """One output tile of one slice. Refs are whole arrays: x [m, k], w [k, n];
    out [splits, m, n] fp32. `program`: the program's (row tile, column tile, slice) where a
    kernel holding other work as well numbers its programs itself (default: this grid's
    ids)."""
    from jax.experimental.pallas import triton as plgpu

    m = x_ref.shape[0]
    row_tile, column_tile, split = program or (pl.program_id(0), pl.program_id(1), pl.program_id(2))
    rows = pl.ds(row_tile * tiles.block_m, tiles.block_m)
    cols = pl.ds(column_tile * tiles.block_n, tiles.block_n)
    row_ok = row_tile * tiles.block_m + jnp.arange(tiles.block_m) < m

    def step(i, acc):
        ks = pl.ds((split * steps + i) * tiles.block_k, tiles.block_k)
        x = plgpu.load(x_ref.at[rows, ks], mask=row_ok[:, None], other=0.0)
        return acc + jnp.dot(x, w_ref[ks, cols], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32))
    plgpu.store(out_ref.at[split, rows, cols], acc, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def matmul_partials(
    x: Array, w: Array, tiles: Tiles | None = None, interpret: bool | None = None
) -> Partials:
    """`x @ w` as `tiles.splits` fp32 partial products.

    x: [..., k]; w: [k, n]. Returns `Partials` with parts [splits, ..., n] and x's dtype.
    `tiles`: the program shape (default `tiles_for`); `interpret`: run in Pallas's
    interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import triton as plgpu

    k, n = w.shape
    if x.shape[-1] != k or not tiling.matmul_fits(k, n):
        raise ValueError(
            f"matmul_partials: x {x.shape}, w {w.shape}; expected x [..., {k}] and k, n "
            "multiples of 16"
        )
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    tiles = tiles or tiles_for(m, k, n)
    blocks = (tiles.block_m, tiles.block_n, tiles.block_k)
    if (
        not all(map(tiling.is_block, blocks))
        or n % tiles.block_n
        or k % (tiles.splits * tiles.block_k)
    ):
        raise ValueError(
            f"{tiles}: blocks must be powers of two >= 16, block_n dividing n = {n} and "
            f"splits x block_k dividing k = {k}"
        )
    steps = k // (tiles.splits * tiles.block_k)
    parts = pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, steps=steps),
        out_shape=jax.ShapeDtypeStruct((tiles.splits, m, n), jnp.float32),
        grid=(pl.cdiv(m, tiles.block_m), n // tiles.block_n, tiles.splits),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=tiling.interpret_mode(interpret),
        name="matmul_partials",
    )(rows, w)
    return Partials(parts.reshape((tiles.splits, *x.shape[:-1], n)), x.dtype)
