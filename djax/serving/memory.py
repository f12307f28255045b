"""The serving engine's memory budget: which (batch, sequence) block calls fit on a device.

The budget is what a device may hold beside the weights: `memory_fraction` × the device's
memory (`device.memory_stats()["bytes_limit"]`, the memory JAX may allocate) or the
explicit `memory_bytes`, minus the weights' bytes on that device. JAX's GPU allocator takes
75% of a GPU by default; `size_device_pool` (which `djax serve` runs before JAX starts)
raises that to `POOL_FRACTION`, leaving the rest to what CUDA holds outside the pool (its
context, libraries' handles, communication buffers). A block call's bytes are
its compiled program's own figures (`Compiled.memory_analysis()`): arguments + outputs +
temporaries, less the weights among the arguments. The K/V buffers, the refresh's
activations and the step's logits (one vocabulary chunk of them under `logits_chunk`) are
temporaries of the call: the serving engine rebuilds the K/V in every call, so nothing of
a row outlives its call on the device beyond its carried block. The device runs calls one
after the other, so a budget holds one call at a time. Where a backend gives no
memory analysis the call's bytes are estimated (`estimate_call_bytes`: the K/V buffers and
the logits, no other activation, so an estimate falls short of the true need).

A call's bytes grow with its batch and its sequence; the engine relies on it: a bucket
over the budget means every larger one is too (`MemoryBudget.never_fits`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from djax import sharding
from djax.model import Model

# The share of each GPU that `size_device_pool` gives JAX's allocator.
POOL_FRACTION = 0.95
# The environment variables that size JAX's GPU pool (the second is the older name).
POOL_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def size_device_pool(environ: dict[str, str] | None = None) -> str | None:
    """Let JAX's GPU allocator take `POOL_FRACTION` of each GPU instead of its default 75%,
    unless `environ` (default `os.environ`) sizes the pool already (`POOL_VARIABLES`). Takes
    effect only before JAX starts its GPU backend; the CPU has no such pool. Returns the
    variable it set, or None."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in POOL_VARIABLES):
        return None
    environ[POOL_VARIABLES[0]] = str(POOL_FRACTION)
    return POOL_VARIABLES[0]


def device_memory(model: Model) -> int | None:
    """The bytes JAX may allocate on each of the model's devices (the least of them), or
    None where the backend reports no memory figure (the CPU)."""
    devices = model.mesh.devices.flat if model.mesh is not None else jax.local_devices()[:1]
    limits = []
    for device in devices:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits)


def memory_in_use(model: Model) -> tuple[int, int] | None:
    """(bytes in use now, the most in use since the process started) on the fullest of the
    model's devices, or None where the backend reports no memory figure (the CPU)."""
    devices = model.mesh.devices.flat if model.mesh is not None else jax.local_devices()[:1]
    now = peak = 0
    for device in devices:
        stats = device.memory_stats()
        if not stats or "bytes_in_use" not in stats:
            return None
        now = max(now, int(stats["bytes_in_use"]))
        peak = max(peak, int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])))
    return now, peak


def weight_bytes(params: Any) -> int:
    """The weights' bytes on one device: a split weight counts its shard, a replicated one
    its whole."""
    total = 0
    for leaf in jax.tree.leaves(params):
        shards = getattr(leaf, "addressable_shards", None)  # a host array has none
        total += shards[0].data.nbytes if shards else leaf.nbytes
    return total


def analysed_call_bytes(compiled: Any, weights: int) -> int | None:
    """A compiled block call's bytes on a device beside the weights: arguments + outputs +
    temporaries of its memory analysis, less the outputs that reuse a donated argument's
    buffer (counted once: the phase scheduler's pool) and less `weights`; None where the
    backend gives no analysis."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    if stats is None:
        return None
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    total -= getattr(stats, "alias_size_in_bytes", 0)
    return max(int(total) - weights, 0)


def estimate_call_bytes(
    model: Model, batch: int, seq: int, block_length: int, logits_chunk: int | None
) -> int:
    """The fallback for a backend without memory analysis, per device as the budget is: a
    call's K/V buffers (keys and values of every layer, [rows, seq, kv_heads, head_dim] in
    the model's dtype, this device's rows of `batch` and its heads) plus its step's fp32
    logits ([rows, block_length, chunk], the chunk being `logits_chunk` ids or this
    device's whole vocabulary when None). Other activations are not counted."""
    cfg = model.config
    shards = 1 if model.mesh is None else model.mesh.shape[sharding.model_axis(model.mesh)]
    data = 1 if model.mesh is None else model.mesh.shape[sharding.DATA]
    rows = -(-batch // data)  # the data axis splits the batch
    kv_heads = max(cfg.n_kv_heads // shards, 1)
    itemsize = jax.numpy.dtype(model.dtype).itemsize
    kv = 2 * cfg.n_layers * rows * seq * kv_heads * cfg.head_dim * itemsize
    vocab = cfg.vocab_size // shards
    vocab = vocab if logits_chunk is None else min(logits_chunk, vocab)
    return kv + 4 * rows * block_length * vocab


@dataclasses.dataclass
class MemoryBudget:
    """The bytes block calls may use on a device (`limit`; None: no budget, every call
    fits) and the bytes of each compiled call, by (batch, sequence, sampling)."""

    limit: int | None
    variants: tuple[bool, ...]  # the sampling variants served
    calls: dict[tuple[int, int, bool], int] = dataclasses.field(default_factory=dict)

    def record(self, batch: int, seq: int, sampling: bool, nbytes: int) -> None:
        self.calls[batch, seq, sampling] = nbytes

    def over(self, batch: int, seq: int, sampling: bool) -> bool:
        """Whether this call is known to exceed the budget."""
        nbytes = self.calls.get((batch, seq, sampling))
        return self.limit is not None and nbytes is not None and nbytes > self.limit

    def never_fits(self, batch: int, seq: int) -> bool:
        """Whether a call no larger in batch and sequence is known to exceed the budget, in
        some sampling variant (so this bucket would too, and need not be compiled)."""
        return any(b <= batch and s <= seq and self.over(b, s, x) for b, s, x in self.calls)

    def fits(self, batch: int, seq: int) -> bool:
        """Whether a call of this bucket fits, whatever its rows' sampling: every served
        variant was compiled and is within the budget."""
        if self.limit is None:
            return True
        return all(
            (batch, seq, x) in self.calls and not self.over(batch, seq, x) for x in self.variants
        )

    def call_bytes(self, batch: int, seq: int) -> int | None:
        """The most bytes a call of this bucket takes (over the sampling variants), or None
        when none was compiled."""
        known = [self.calls[batch, seq, x] for x in self.variants if (batch, seq, x) in self.calls]
        return max(known) if known else None


def budget_bytes(
    model: Model, memory_fraction: float, memory_bytes: int | None
) -> tuple[int | None, int]:
    """The block calls' budget on each device (None when neither `memory_bytes` nor a
    device memory figure is known) and the weights' bytes it leaves out. Raises ValueError
    when the weights leave nothing."""
    weights = weight_bytes(model.params)
    total = memory_bytes
    source = f"memory_bytes={memory_bytes}"
    if total is None:
        device = device_memory(model)
        if device is None:
            return None, weights
        total = int(memory_fraction * device)
        source = f"memory_fraction={memory_fraction} of the device's {device} bytes"
    if total <= weights:
        raise ValueError(
            f"the weights take {weights} bytes a device, {source} gives {total}: nothing "
            "is left for the block calls"
        )
    return total - weights, weights
