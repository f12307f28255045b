"""KV-cache policies: when a step refreshes the whole sequence, and which window a cached
step feeds.

Buffers are fixed-shape, one `(keys, values)` pair per layer, each
`[batch, seq, kv_heads, head_dim]` (kv heads local to the device under tensor
parallelism). A refresh is a forward over the whole sequence that rewrites every
position's K/V (and decodes the block from its logits, counting as one step). A cached step
feeds a window of `W` positions; its fresh K/V replace the buffer inside the write range,
and its queries attend to the whole buffer.

| policy   | cached step feeds                        | writes fresh K/V for             |
|----------|------------------------------------------|----------------------------------|
| none     | (every step is a whole-sequence forward) | -                                |
| prefix   | `[prompt_end, seq)` (fixed shape)        | `[block_start, seq)`             |
| dual     | `[block_start, block_end)`               | the same                         |
| vicinity | `before + block + after` positions       | `[start − before, end + after)`  |
|          | (shifted to fit inside the sequence)     | clipped to the sequence          |

`prefix` feeds a fixed `[prompt_end, seq)` window so its shape never changes; positions of
finished blocks in it take their K/V from the cache, exactly as if they were not fed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from djax.models.layers import LayerKV, Window

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """A cache policy and its parameters (static).

    refresh_every: also refresh every k steps inside a block (0: never). before/after/warmup:
    the `vicinity` window and its no-cache warm-up steps at the start of the generation.
    """

    name: str = "dual"
    refresh_every: int = 0
    before: int = 16
    after: int = 16
    warmup: int = 4

    @property
    def cached(self) -> bool:
        return self.name != "none"

    @property
    def conditional_refresh(self) -> bool:
        """Whether a step after a block's first may still be a refresh."""
        return self.refresh_every > 0 or (self.name == "vicinity" and self.warmup > 0)

    def window_length(self, prompt_len: int, block_len: int, seq_len: int) -> int:
        if self.name == "dual":
            return block_len
        if self.name == "prefix":
            return seq_len - prompt_len
        if self.name == "vicinity":
            return min(self.before + block_len + self.after, seq_len)
        raise ValueError(f"policy {self.name!r} has no cached window")

    def window(self, block_start: Array, prompt_len: int, block_len: int, seq_len: int) -> Window:
        """The cached step's window for a block starting at `block_start`."""
        if self.name == "dual":
            return Window(block_start)
        if self.name == "prefix":
            return Window(prompt_len, block_start, seq_len)
        width = self.window_length(prompt_len, block_len, seq_len)
        lo = jnp.maximum(block_start - self.before, 0)
        hi = jnp.minimum(block_start + block_len + self.after, seq_len)
        return Window(jnp.clip(block_start - self.before, 0, seq_len - width), lo, hi)

    def refresh_now(self, step_in_block: Array, step: Array) -> Array:
        """Whether a step (not a block's first) refreshes; `step` counts the whole generation."""
        due = jnp.zeros((), bool)
        if self.refresh_every > 0:
            due = due | (step_in_block % self.refresh_every == 0)
        if self.name == "vicinity":
            due = due | (step < self.warmup)
        return due


def init_buffers(
    params: dict, n_layers: int, batch: int, seq_len: int, dtype
) -> tuple[LayerKV, ...]:
    """Zeroed per-layer K/V buffers sized from the (local) attention weights: `qkv`
    [model, kv_heads, group + 2, head_dim], or its fp8 scale [kv_heads, group + 2, head_dim]
    where it has one (its values may be held K-major, `djax.models.fp8`)."""
    buffers = []
    for i in range(n_layers):
        attn = params[f"attn_{i}"]
        kv_heads, _, head_dim = attn["qkv_scale" if "qkv_scale" in attn else "qkv"].shape[-3:]
        shape = (batch, seq_len, kv_heads, head_dim)
        buffers.append((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
    return tuple(buffers)
