"""The SwiGLU gate/up product for few rows with its activation fused, as a Pallas Triton
kernel: djax's GPU path for the first MLP matmul of a denoising block forward.

In a block forward XLA runs the fused gate/up matmul and then a separate kernel for
`silu(gate) * up`. This kernel reads the gate and up columns of the `[model, 2, hidden]`
weight side by side into two fp32 accumulators and writes `silu(gate) * up` directly. Each
program owns a `block_m x block_n` tile of the output and loops over the model dim in
`block_k` steps, Triton pipelining the weight loads over `num_stages`.

The `x` tile is never normalised in registers before the product: that stops Triton's load
pipelining. Given `ScaledRows` (rows already multiplied by the norm's scale,
`handoff.ScaledRows`) the kernel applies the RMSNorm after the product instead, as
one scale per accumulator row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling
from djax.kernels.handoff import ScaledRows, load_inv_rms

Array = jax.Array


# The program shape: `block_n` columns of gate and of up
Tiles = tiling.ProductTiles


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """128 columns of each side, 64-wide contraction steps, 4 warps, 4 stages: the fastest
    program shape at a block's rows of LLaDA-8B's MLP."""
    return Tiles(
        block_m=tiling.row_block(m),
        block_n=tiling.largest_block(n, 128),
        block_k=tiling.largest_block(k, 64),
    )


def _kernel(x_ref, w_ref, *refs, tiles, eps):
    """One output tile. Refs are whole arrays: x [m, k], w [k, 2, n], with `eps` the
    squares [tiles, m] of `ScaledRows`; out [m, n]."""
    from jax.experimental.pallas import triton as plgpu

    squares_ref, out_ref = refs if eps is not None else (None, *refs)
    m, k = x_ref.shape
    rows = pl.ds(pl.program_id(0) * tiles.block_m, tiles.block_m)
    cols = pl.ds(pl.program_id(1) * tiles.block_n, tiles.block_n)
    row_ok = pl.program_id(0) * tiles.block_m + jnp.arange(tiles.block_m) < m

    def step(i, accs):
        ks = pl.ds(i * tiles.block_k, tiles.block_k)
        x = plgpu.load(x_ref.at[rows, ks], mask=row_ok[:, None], other=0.0)
        return tuple(
            acc + jnp.dot(x, w_ref[ks, side, cols], preferred_element_type=jnp.float32)
            for side, acc in enumerate(accs)
        )

    # The RMSNorm of x, as rows scaled after the product: the sums of squares are read
    # before the weight loop, so their load is not in the kernel's tail.
    if squares_ref is not None:
        inv_rms = load_inv_rms(squares_ref, (rows,), row_ok, k, eps)
    zeros = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
    gate, up = jax.lax.fori_loop(0, k // tiles.block_k, step, (zeros, zeros))
    if squares_ref is not None:
        gate, up = gate * inv_rms, up * inv_rms
    out = jax.nn.silu(gate) * up
    plgpu.store(out_ref.at[rows, cols], out.astype(out_ref.dtype), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def swiglu_matmul(
    x: Array | ScaledRows,
    w: Array,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Array:
    """`silu(x @ w[:, 0]) * (x @ w[:, 1])` in one kernel.

    x: [m, k], or `ScaledRows` [m, k] whose RMSNorm the kernel applies to the product's
    rows; w: [k, 2, n] (gate and up). Returns [m, n] in x's dtype, accumulated in
    fp32. `tiles`: the program shape (default `tiles_for`); `interpret`: run in Pallas's
    interpreter (default: exactly off GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import triton as plgpu

    inputs = [x.scaled, w, x.squares] if isinstance(x, ScaledRows) else [x, w]
    eps = x.eps if isinstance(x, ScaledRows) else None
    m, k = inputs[0].shape
    n = w.shape[-1]
    if w.shape[:2] != (k, 2) or not tiling.matmul_fits(k, n):
        raise ValueError(
            f"swiglu_matmul: x {x.shape}, w {w.shape}; expected w [{k}, 2, n] with {k} and n "
            "multiples of 16"
        )
    tiles = tiles or tiles_for(m, k, n)
    tiles.check(k, n)
    return pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, eps=eps),
        out_shape=jax.ShapeDtypeStruct((m, n), inputs[0].dtype),
        grid=(pl.cdiv(m, tiles.block_m), n // tiles.block_n),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=tiling.interpret_mode(interpret),
        name="swiglu_matmul",
    )(*inputs)
