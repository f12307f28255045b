"""Where each request's tokens sit in a block call's fixed-shape arrays, and the shape
buckets the serving engine compiles.

A row of a block call holds one request at one block: its current block first (all mask
ids, at `[0, block)`), then its context (the prompt and the blocks already committed), then
its later answer positions (mask ids), then padding. Attention is bidirectional and every
position carries its own RoPE position, so this order computes exactly what the request's
natural layout `prompt | answer` would, while every row's block sits at the same place:
rows of different requests at different blocks share one compiled program.

Block diffusion (LLaDA2, `RowLayout.causal`) aligns blocks at position 0 and attends
block-causally, so a row holds no later positions, and its current block starts at the last
block boundary of its context: the block holds the context's tail (the prompt's last
tokens, for its first generated block) before its mask ids, and the whole blocks before it
follow.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Sequence buckets (tokens of a row: prompt + whole answer); the serving engine adds the
# longest sequence it serves.
SEQ_BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def batch_buckets(max_batch: int, multiple: int = 1) -> tuple[int, ...]:
    """Powers of two below `max_batch`, then `max_batch`, each rounded up to `multiple` (the
    mesh's data-parallel size)."""
    sizes = [b for b in (2**i for i in range(16)) if b < max_batch] + [max_batch]
    return tuple(sorted({-(-b // multiple) * multiple for b in sizes}))


def seq_buckets(max_sequence: int, block_length: int) -> tuple[int, ...]:
    """The compiled row lengths: `SEQ_BUCKETS` that hold more than one block and fit under
    `max_sequence`, then `max_sequence` itself."""
    fits = [s for s in SEQ_BUCKETS if block_length < s < max_sequence]
    return (*fits, max_sequence)


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket ≥ value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Token ids of the layout: `mask` fills the answer, `pad` the rest; `causal`: the
    block-diffusion layout."""

    block_length: int
    mask_id: int
    pad_id: int
    causal: bool = False

    def tail(self, context_length: int) -> int:
        """How many context tokens a row's next block holds before its masks: the tokens past
        the last block boundary (block-causal rows), else none."""
        return context_length % self.block_length if self.causal else 0

    def arrays(self, batch: int, seq: int) -> dict[str, np.ndarray]:
        """Empty call inputs: every row an empty slot (pad tokens, no masks, its first
        block of keys valid so attention stays finite)."""
        arrays = {
            "tokens": np.full((batch, seq), self.pad_id, np.int32),
            "key_valid": np.zeros((batch, seq), bool),
            "positions": np.zeros((batch, seq), np.int32),
        }
        arrays["key_valid"][:, : self.block_length] = True
        return arrays

    def fill(
        self,
        arrays: dict[str, np.ndarray],
        row: int,
        context: np.ndarray,
        later: int,
    ) -> None:
        """Lay out one request at its next block in row `row` of `arrays`.

        context: [c] int32, the prompt then the committed answer tokens; later: answer
        positions after the current block (0 for block-causal rows, whose block starts at
        the last block boundary of the context and holds its `tail` first). Needs
        block_length + c + later ≤ seq.
        """
        block = self.block_length
        tail = self.tail(len(context))
        if self.causal and later:
            raise ValueError(f"later={later}; block-causal rows hold no later positions")
        head, c = context[: len(context) - tail], len(context) - tail
        end = block + c + later
        tokens, valid, positions = arrays["tokens"], arrays["key_valid"], arrays["positions"]
        tokens[row, :block] = self.mask_id
        tokens[row, :tail] = context[c:]
        tokens[row, block : block + c] = head
        tokens[row, block + c : end] = self.mask_id
        tokens[row, end:] = self.pad_id
        valid[row, :end] = True
        valid[row, end:] = False
        positions[row, :block] = np.arange(c, c + block)
        positions[row, block : block + c] = np.arange(c)
        positions[row, block + c : end] = np.arange(c + block, c + block + later)
        positions[row, end:] = 0
