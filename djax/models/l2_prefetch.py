"""Reading the start of the next product's weights into the GPU's L2 cache from inside a
latency-bound kernel, so HBM is busy while the small kernels between matmuls run.

A 32-token block forward alternates bandwidth-bound matmuls with small kernels (norms,
RoPE, K/V writes) that leave HBM idle for a few microseconds each (bench/NOTES.md). A small
kernel given a `Prefetch` runs extra programs that load the first bytes of each contraction
slice of the weight the next matmul will read, with L2's evict-last policy, and discard
them; the matmul then finds them in L2. The kernel's own programs are unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array
CHUNK_BYTES = 64 << 10  # per extra program
TILE = 4096  # elements per load


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which bytes to read (static): `chunks` programs per slice, over `slices` equal slices
    of `slice_elems` elements each, `chunk_elems` elements per program."""

    slices: int
    slice_elems: int
    chunks: int
    chunk_elems: int

    @property
    def programs(self) -> int:
        return self.slices * self.chunks


def plan(weight: Array, slices: int, nbytes: int) -> Plan | None:
    """Read about `nbytes` of `weight` [k, ...] (row-major): the start of each of `slices`
    equal slices of its first axis, as a split-K matmul reads it first. None when nothing
    fits (too small a weight or budget)."""
    elems = weight.size
    chunk_elems = CHUNK_BYTES // weight.dtype.itemsize
    slice_elems = elems // slices
    chunks = min(nbytes // slices // CHUNK_BYTES, slice_elems // chunk_elems)
    if chunks < 1 or elems % slices or chunk_elems % TILE:
        return None
    return Plan(slices, slice_elems, chunks, chunk_elems)


def read(weight_ref, sink_ref, program, p: Plan) -> None:
    """The body of extra program `program` (0-based): load its chunk of the flat weight
    through L2 (evict-last) and store the chunk's sum to `sink_ref[program]`, so the loads
    are kept."""
    from jax.experimental.pallas import triton as plgpu

    start = (program // p.chunks) * p.slice_elems + (program % p.chunks) * p.chunk_elems

    def step(i, total):
        tile = plgpu.load(
            weight_ref.at[pl.ds(start + i * TILE, TILE)], eviction_policy="evict_last"
        )
        return total + jnp.sum(tile.astype(jnp.float32))

    sink_ref[program] = jax.lax.fori_loop(0, p.chunk_elems // TILE, step, jnp.float32(0))
