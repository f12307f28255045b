"""Rules shared by djax's Pallas Triton kernels (`flash_attention`, `swiglu`, `split_k`,
`residual_norm`, `residual_product`, `rope_write`): the block sizes Triton takes, the
program shape of the unsplit product kernels, and when a kernel runs in Pallas's
interpreter instead (off GPUs, which is how the CPU tests run them)."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class ProductTiles:
    """Program shape of an unsplit product kernel for few rows (`swiglu`,
    `residual_product`): a `block_m x block_n` output tile over the whole contraction in
    `block_k` steps; Triton's `num_warps` and `num_stages`. Each block is a power of two
    >= 16. The defaults are the SwiGLU kernel's; each kernel's `tiles_for` gives its own."""

    block_m: int = 32
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def check(self, k: int, n: int) -> None:
        """Raise a ValueError naming these tiles unless they fit a `k -> n` product."""
        blocks = (self.block_m, self.block_n, self.block_k)
        if not all(map(is_block, blocks)) or n % self.block_n or k % self.block_k:
            raise ValueError(
                f"{self}: blocks must be powers of two >= 16, block_n dividing n = {n} and "
                f"block_k dividing k = {k}"
            )


def is_block(n: int) -> bool:
    """Whether `n` is a Triton tile size: a power of two, at least 16."""
    return n >= 16 and is_power_of_two(n)


def is_power_of_two(n: int) -> bool:
    """Whether `n` is a power of two: the tile widths Triton takes outside matmuls."""
    return n >= 1 and n & (n - 1) == 0


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
