"""Tile rules of djax's kernels: the block sizes Pallas Triton takes (`expert_tiles`), the
largest block dividing a width (the Mosaic GPU products' contraction steps too), and when a
kernel runs in Pallas's interpreter instead (off GPUs, which is how the CPU tests run
them)."""

from __future__ import annotations

import jax


def is_block(n: int) -> bool:
    """Whether `n` is a Triton tile size: a power of two, at least 16."""
    return n >= 16 and n & (n - 1) == 0


def matmul_fits(k: int, n: int) -> bool:
    """Whether a matmul kernel takes a contraction of `k` into `n` columns: both multiples
    of 16, so every tile is whole."""
    return k % 16 == 0 and n % 16 == 0


def row_block(m: int) -> int:
    """The row tile for a product of `m` token rows: all of them (at least 16) up to 64."""
    return max(16, 1 << (m - 1).bit_length()) if m <= 64 else 64


def largest_block(n: int, limit: int) -> int:
    """The largest power of two <= `limit` (itself a power of two) that divides `n`."""
    block = limit
    while n % block:
        block //= 2
    return block


def interpret_mode(interpret: bool | None) -> bool:
    """A kernel's `interpret` argument: None means Pallas's interpreter exactly off GPUs.
    On a GPU the interpreter's program is compiled by XLA, which by default may keep fp32
    values where the kernel rounds to a 16-bit dtype and back (`xla_allow_excess_precision`):
    there it is no reference for a kernel's rounding."""
    return jax.default_backend() != "gpu" if interpret is None else interpret
