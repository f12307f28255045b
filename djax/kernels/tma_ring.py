"""What djax's Pallas Mosaic GPU kernels (`split_k_mosaic`, `swiglu_mosaic`,
`residual_product_mosaic`, `rope_write_mosaic`, `expert_tiles_mosaic`, `fp8_matmul_mosaic`;
the attention and norm kernels take its layouts and stores) share: their tile rules, the
ring of shared-memory slots each CTA streams its operands through, and how they run off
GPUs (Mosaic GPU's interpreter, which is how the CPU tests check them).

Each CTA owns one tile of `block_n` output columns (of one contraction slice, for the
split-K product) and steps through the contraction `block_k` at a time: TMA copies bring
the step's x tile [64, block_k] and weight tiles [block_k, block_n] into a ring of `stages`
slots, one barrier per slot and operand; WGMMA multiplies them into fp32 accumulators of 64
rows, the row tile of one warpgroup. Rules:

- x's rows are read 64 at a time from the x array itself: the rows past its end are read
  by TMA as zeros (their products are never stored), so a block's 32 rows need no padded
  copy. TMA takes row counts that are multiples of 8; the wrappers pad other counts.
- Slots and tiles are swizzled for WGMMA at 128 bytes (64 16-bit values), or 64 bytes for
  32-column tiles (both operands of a WGMMA share their swizzle): `block_n` is 32 or a
  multiple of 64, `block_k` a multiple of 64, and the operands 16-bit (bf16 or fp16).
- Each step's products are waited for before its slot is refilled with the step `stages`
  ahead, so `stages - 1` steps of copies are in flight while one multiplies.
- 8-bit operands multiplied as they are (fp8 x fp8 WGMMA, `fp8_matmul_mosaic` and
  `expert_tiles_mosaic`'s fp8 form) must both be K-major: the ring's `k_major` form holds
  weight tiles [block_n, block_k] (the weight stored [n, k]) and swizzles every slot at
  128 bytes = 128 values, so `block_k` is a multiple of 128 (`Tiles.check`'s
  `itemsize=1`).
- Rows scaled per contraction slice (`SliceScales`: 8-bit rows whose scale changes every
  `width` values along k, as `expert_tiles_mosaic`'s down product takes the activation the
  gate/up product quantised per column tile): each step's product runs one WGMMA per slice
  into a fresh accumulator, which is waited for and added to the step's accumulator times
  its rows' scales for that slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

ROW_TILE = 64  # WGMMA's row tile: the rows of one warpgroup's accumulator
ROW_ALIGN = 8  # TMA reads x's rows in runs of 8
SWIZZLE = 128  # bytes of a swizzled row: 64 16-bit values
TILE = SWIZZLE // 2  # block_n (but for NARROW) and block_k are multiples of this
NARROW = 32  # the one narrower block_n, swizzled at 64 bytes
# Shared memory a CTA's slots and output tile may take (of the 227 KiB a Hopper block has).
SHARED_MEMORY = 224 * 1024


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape of a Mosaic GPU product: a CTA per `block_n` output columns (and per
    contraction slice, of `splits`), stepping `block_k` at a time through a ring of
    `stages` slots. `block_n` is 32 or a multiple of 64, `block_k` a multiple of 64.
    `rows`: the rows of x a step copies into its 64-row slot (a multiple of 8 up to 64);
    WGMMA multiplies all 64, and the products of the slot's rows past `rows` (stale
    values) are never stored, so a kernel whose row tiles hold at most `rows` rows reads
    no more of x than it uses."""

    block_n: int = 128
    block_k: int = 64
    splits: int = 1
    stages: int = 4
    rows: int = ROW_TILE

    @property
    def swizzle(self) -> int:
        """Bytes of a swizzled row of this program's slots: 64 for 32-column tiles, else
        128."""
        return 2 * NARROW if self.block_n == NARROW else SWIZZLE

    def check(
        self,
        k: int,
        n: int,
        weights: int,
        out_bytes: int,
        extra: int = 0,
        itemsize: int = 2,
        row_tiled: bool = False,
    ) -> None:
        """Raise a ValueError naming these tiles unless they divide a `k -> n` product and
        the ring of x and `weights` weight tiles per slot (of `itemsize` bytes a value), with
        an output tile of `out_bytes` per value and `extra` bytes of other scratch, fits in
        `SHARED_MEMORY`. `block_k` must fill whole swizzled rows: a multiple of
        `SWIZZLE // itemsize` values (64 16-bit, 128 8-bit). `rows` is 64 but for kernels
        whose row tiles take fewer (`row_tiled`: a multiple of 8 up to 64)."""
        bn, bk, splits = self.block_n, self.block_k, self.splits
        k_tile = SWIZZLE // itemsize
        whole = (bn % TILE == 0 or bn == NARROW) and bk % k_tile == 0
        rows = self.rows == ROW_TILE or (
            row_tiled and 0 < self.rows <= ROW_TILE and self.rows % ROW_ALIGN == 0
        )
        if not whole or not rows or splits < 1 or self.stages < 1 or n % bn or k % (splits * bk):
            raise ValueError(
                f"{self}: block_n must be {NARROW} or a multiple of {TILE} dividing n = {n}, "
                f"block_k a multiple of {k_tile}, splits x block_k dividing k = {k} and rows "
                f"{ROW_TILE} (a multiple of {ROW_ALIGN} up to {ROW_TILE} in row-tiled kernels)"
            )
        used = self.shared_bytes(weights, out_bytes, itemsize) + extra
        if used > SHARED_MEMORY:
            raise ValueError(f"{self}: {used} bytes of shared memory; at most {SHARED_MEMORY}")

    def shared_bytes(self, weights: int, out_bytes: int, itemsize: int = 2) -> int:
        """Shared memory of the slots (x and `weights` weight tiles, `itemsize` bytes a
        value) and the output tile (`out_bytes` per value)."""
        slot = ROW_TILE * self.block_k + weights * self.block_k * self.block_n
        return self.stages * slot * itemsize + ROW_TILE * self.block_n * out_bytes


def largest_block(n: int, limit: int) -> int:
    """The largest power of two <= `limit` (itself a power of two) that divides `n`."""
    block = limit
    while n % block:
        block //= 2
    return block


def fits(k: int, n: int) -> bool:
    """Whether the Mosaic GPU products take a contraction of `k` into `n` columns: both
    multiples of 64, so every swizzled tile is whole."""
    return k % TILE == 0 and n % TILE == 0


def takes_dtype(dtype: Any) -> bool:
    """Whether the Mosaic GPU products take operands of `dtype` (WGMMA's 16-bit inputs)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_operands(name: str, x: Array, w: Array) -> None:
    """Raise a ValueError naming `name` unless x and w are 16-bit of one dtype."""
    if not takes_dtype(x.dtype) or w.dtype != x.dtype:
        raise ValueError(
            f"{name}: x {x.dtype}, w {w.dtype}; expected both bfloat16 or both float16"
        )


def aligned(m: int) -> int:
    """`m` rounded up to a multiple of `ROW_ALIGN`, the rows TMA reads at a time."""
    return -(-m // ROW_ALIGN) * ROW_ALIGN


def aligned_rows(rows: Array) -> Array:
    """rows [m, k] with zero rows up to a multiple of `ROW_ALIGN` (itself when aligned)."""
    missing = aligned(rows.shape[0]) - rows.shape[0]
    return jnp.pad(rows, ((0, missing), (0, 0))) if missing else rows


def interpret_params(interpret: bool | None) -> Any:
    """A kernel's `interpret` argument as `plgpu.kernel` takes it: None (compile for the
    GPU) or Mosaic GPU's interpreter parameters, reading rows past x's end as zeros as TMA
    does. `interpret` None means the interpreter exactly off GPUs."""
    if not (jax.default_backend() != "gpu" if interpret is None else interpret):
        return None
    # No public name in jax 0.10; only the CPU tests take this path.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def accumulator_rows(value: Array, interpreting: bool) -> Array:
    """Inside a kernel: a vector `value` [64] read from shared memory, laid out as the rows of
    an accumulator (so it broadcasts along an accumulator's columns). The layout cast is
    the identity on values; Mosaic GPU's interpreter has no rule for it and takes the value
    as it is."""
    return _laid_out(value, 1, interpreting)


def accumulator_columns(value: Array, interpreting: bool) -> Array:
    """Inside a kernel: a vector `value` [block_n] read from shared memory, laid out as the
    columns of an accumulator (so it broadcasts along an accumulator's rows); as
    `accumulator_rows`."""
    return _laid_out(value, 0, interpreting)


def _laid_out(value: Array, reduced: int, interpreting: bool) -> Array:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpreting:
        return value
    return plgpu.layout_cast(value, plgpu.Layout.WGMMA.reduce(reduced))


def swizzled(swizzle: int = SWIZZLE, itemsize: int = 2) -> tuple:
    """The transforms of a tile of values of `itemsize` bytes (16-bit by default) swizzled
    at `swizzle` bytes, as WGMMA reads them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def ring_scratch(
    tiles: Tiles, dtype: Any, weights: int, w_dtype: Any = None, k_major: bool = False
) -> list:
    """Scratch of a ring: the x slots [stages, 64, block_k], `weights` weight slots
    [stages, block_k, block_n] each (of `w_dtype`, default `dtype`; 8-bit slots are
    swizzled at their rows' bytes, up to 128), then one barrier array per operand.
    `k_major`: the weight slots are [stages, block_n, block_k] (the contraction
    contiguous, as 8-bit WGMMA reads both operands) and every slot is swizzled at 128 bytes
    of its own values."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x_slots = (tiles.stages, ROW_TILE, tiles.block_k)
    w_slots = (tiles.stages, tiles.block_k, tiles.block_n)
    w_dtype = jnp.dtype(dtype if w_dtype is None else w_dtype)
    x_transforms = swizzled(tiles.swizzle)
    w_swizzle = tiles.swizzle
    if w_dtype.itemsize == 1:
        w_swizzle = min(SWIZZLE, tiles.block_n)
    w_transforms = swizzled(w_swizzle, w_dtype.itemsize)
    if k_major:
        w_slots = (tiles.stages, tiles.block_n, tiles.block_k)
        x_transforms = swizzled(SWIZZLE, jnp.dtype(dtype).itemsize)
        w_transforms = swizzled(SWIZZLE, w_dtype.itemsize)
    return [
        plgpu.SMEM(x_slots, dtype, transforms=x_transforms),
        *(plgpu.SMEM(w_slots, w_dtype, transforms=w_transforms) for _ in range(weights)),
        *(plgpu.Barrier(num_barriers=tiles.stages) for _ in range(weights + 1)),
    ]


@dataclasses.dataclass(frozen=True)
class SliceScales:
    """x's rows scaled per contraction slice of `width` values (a multiple of 128, dividing
    block_k; K-major weight slots only): `of(j)` is the scales [64] of the slot's rows for
    slice `j` (counted from k = 0), laid out as an accumulator's rows; `ready()` waits for
    them, once, after the ring's first fetches are issued; `interpreting`: in Mosaic GPU's
    interpreter (no layouts)."""

    width: int
    of: Callable[[Array], Array]
    ready: Callable[[], None]
    interpreting: bool


def stream(
    x_gmem,
    w_tiles: Sequence[Callable[[Any], Any]],
    ring: Sequence,
    tiles: Tiles,
    first_step,
    steps: int,
    rows,
    finish: Callable[..., None],
    converted: Sequence | None = None,
    multiply: Callable[[Any, Any, Any], None] | None = None,
    slice_scales: SliceScales | None = None,
) -> None:
    """Inside a kernel: multiply x's rows by each weight over `steps` contraction steps from
    `first_step` through the ring, then call `finish` with the fp32 products [64, block_n]
    (one per weight, as arrays) while their accumulators are live. `w_tiles[i](ks)` is
    weight i's GMEM tile at contraction indexer `ks`; `ring` the scratch refs of
    `ring_scratch`; `rows` the indexer of x's rows (64, or `tiles.rows` copied into the
    first rows of each slot). `converted`: one swizzled slot
    [block_k, block_n] of x's dtype per weight, into which each step's weight tile (of
    another dtype, as fp8) is converted before its WGMMA. `multiply(acc, x_slot, w_slot)`
    issues a step's product into an accumulator ref (default `plgpu.wgmma`; K-major weight
    slots need theirs read transposed). `slice_scales`: x's rows scaled per contraction
    slice (`SliceScales`), applied to each slice's product before it is accumulated."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    multiply = multiply or plgpu.wgmma
    acc_shape = (ROW_TILE, tiles.block_n)

    count = len(w_tiles)
    x_slots, w_slots = ring[0], ring[1 : 1 + count]
    x_bars, w_bars = ring[1 + count], ring[2 + count : 2 + 2 * count]

    def fetch(step, slot):
        ks = pl.ds((first_step + step) * tiles.block_k, tiles.block_k)
        x_slot = x_slots.at[slot]
        if rows.size != ROW_TILE:
            x_slot = x_slots.at[slot, pl.ds(0, rows.size)]
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, ks], x_slot, x_bars.at[slot])
        for w_tile, slots, bars in zip(w_tiles, w_slots, w_bars, strict=True):
            plgpu.copy_gmem_to_smem(w_tile(ks), slots.at[slot], bars.at[slot])

    for step in range(min(tiles.stages, steps)):
        fetch(step, step)
    if slice_scales is not None:
        slice_scales.ready()
    targets = [None] * count if converted is None else list(converted)

    def x_operand(slot):
        """The step's x slot, once its copy is in."""
        plgpu.barrier_wait(x_bars.at[slot])
        return x_slots.at[slot]

    def w_operand(slot, side):
        """Weight `side`'s operand of the step, once its copy (and conversion) is in."""
        plgpu.barrier_wait(w_bars[side].at[slot])
        operand, into = w_slots[side].at[slot], targets[side]
        if into is not None:  # its WGMMA of the last step is done (waited below)
            into[...] = converted_values(operand[...], into.dtype)
            plgpu.commit_smem()
            operand = into
        return operand

    def refill(i, slot):
        @pl.when(i + tiles.stages < steps)
        def _refill():
            fetch(i + tiles.stages, slot)

    if slice_scales is not None:
        # Each slice's product into a fresh accumulator, read and added to the step's
        # carried sums times its rows' scales.
        width = slice_scales.width
        per_step = tiles.block_k // width

        def sliced_step(i, sums):
            slot = jax.lax.rem(i, tiles.stages)
            x_slot = x_operand(slot)
            sums = list(sums)
            for side in range(count):
                operand = w_operand(slot, side)

                def products(*parts, operand=operand):
                    for j, part in enumerate(parts):  # issued together, then read
                        cols = pl.ds(j * width, width)
                        multiply(part, x_slot.at[:, cols], operand.at[:, cols])
                    return [part[...] for part in parts]  # the first read waits for all

                parts = pl.run_scoped(products, *[plgpu.ACC(acc_shape, jnp.float32)] * per_step)
                for j, part in enumerate(parts):
                    scale = slice_scales.of((first_step + i) * per_step + j)
                    sums[side] = sums[side] + part * jax.lax.broadcast_in_dim(scale, acc_shape, [0])
            refill(i, slot)
            return tuple(sums)

        zeros = accumulator(jnp.zeros(acc_shape, jnp.float32), slice_scales.interpreting)
        finish(*jax.lax.fori_loop(0, steps, sliced_step, (zeros,) * count))
        return

    def scope(*accs):
        @pl.loop(0, steps)
        def _step(i):
            slot = jax.lax.rem(i, tiles.stages)
            x_slot = x_operand(slot)
            for side, acc in enumerate(accs):  # each issued as soon as its weight is in
                multiply(acc, x_slot, w_operand(slot, side))
            plgpu.wgmma_wait(0)  # this step's products are done: its slot may be refilled
            refill(i, slot)

        finish(*(acc[...] for acc in accs))

    acc = plgpu.ACC(acc_shape, jnp.float32)
    pl.run_scoped(scope, *([acc] * count))


def accumulator(value: Array, interpreting: bool) -> Array:
    """Inside a kernel: `value` [64, n] laid out as a WGMMA accumulator (the identity on
    values; as `accumulator_rows`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return value if interpreting else plgpu.layout_cast(value, plgpu.Layout.WGMMA)


def converted_values(values: Array, dtype: Any) -> Array:
    """Inside a kernel: 8-bit float `values` in `dtype` (bf16 or fp16), exactly. Hopper
    converts e4m3 only to fp16 (whose 10-bit mantissa and range hold every e4m3 value), so
    bf16 is reached through fp16 and fp32."""
    if values.dtype.itemsize != 1 or jnp.dtype(dtype) == jnp.dtype(jnp.float16):
        return values.astype(dtype)
    return values.astype(jnp.float16).astype(jnp.float32).astype(dtype)


def store_rows(out_smem, dst, row_tile, m: int, *more) -> None:
    """Inside a kernel: the first rows of an output tile `out_smem` [64, ...] to `dst`, the
    GMEM rows of this CTA's row tile `row_tile` (of an output of `m` rows) at its columns,
    a callable taking the rows' indexer: 64 rows, or what is left of `m` in the last row
    tile. `more`: further (out_smem, dst, m) triples stored the same way."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.commit_smem()
    for smem, to, rows in ((out_smem, dst, m), *more):
        last, left = (rows - 1) // ROW_TILE, rows - (rows - 1) // ROW_TILE * ROW_TILE
        if left == ROW_TILE:
            plgpu.copy_smem_to_gmem(smem, to(pl.ds(row_tile * ROW_TILE, ROW_TILE)))
            continue

        @pl.when(row_tile < last)
        def _whole(smem=smem, to=to):
            plgpu.copy_smem_to_gmem(smem, to(pl.ds(row_tile * ROW_TILE, ROW_TILE)))

        @pl.when(row_tile == last)
        def _rest(smem=smem, to=to, last=last, left=left):
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(0, left)], to(pl.ds(last * ROW_TILE, left)))

    plgpu.wait_smem_to_gmem(0)


def load(ref, layout: Any, optimized: bool = True) -> Array:
    """Inside a kernel: the whole of `ref` read in `layout` by `plgpu.load` (with
    `optimized`), which jax 0.10 takes with an index argument and later versions on the ref
    alone (the argument is deprecated there)."""
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)
