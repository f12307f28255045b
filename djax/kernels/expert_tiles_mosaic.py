"""The routed experts' two products over token-expert pairs sorted by expert, as Pallas
Mosaic GPU kernels (Hopper: TMA copies, WGMMA) whose row tiles each belong to one expert
(`moe_impl="mosaic"`), taking weights of the rows' dtype or fp8 weights (converted in the
kernel, or K-major by fp8 x fp8 WGMMA where the fp8 x fp8 kernels run).

A grouped matmul over fixed tiles of sorted rows computes a tile that straddles two
experts once per expert, and runs every tile slot's whole contraction, used or not. Here
the tiles follow the experts instead: each expert's rows make tiles of their own,
described by a small table (`row_tiles`), so each expert's weights are read once per
column tile (plus once per extra row tile of an expert with more rows than a tile), and the
CTAs past the table's used tiles (the grid holds `max_tiles`, the most any routing can
need) return at once: a forward whose tokens reach few experts reads only theirs.

The kernels take the rows in an aligned layout: the pairs sorted by expert, each expert's
rows from a multiple of 8 (`aligned_layout`; the rows between experts are padding), as a
TMA copy between a swizzled tile (tiled 8 rows at a time) and GMEM must start at a row
that Mosaic GPU's layout inference (jax 0.11's default lowering, named by the kernels) can
prove a multiple of 8: `pl.multiple_of` on the tile table's first row, true by this
layout. The stores then copy whole 8-row groups of the swizzled output tile.

Expert `e`'s `a_e` aligned rows (`n_e` rounded up to 8) make `ceil(a_e / r)` =
`ceil(n_e / r)` row tiles, `r` being the program's `Tiles.rows` (8 to 64, a multiple of 8;
`row_tile_for` takes the most rows an expert can hold, the forward's tokens: a block's 32
are read 32 at a time, not 64, and no expert of it in two tiles). Each CTA owns one (row
tile, `block_n` columns) and streams its expert's weight tiles through the ring of
`tma_ring`; rules beyond the ring's:

- The rows: a tile's `r` rows are read from its first row by TMA into the first rows of
  each 64-row slot (rows of the next expert or past the array's end come along, read as
  zeros past the end; their products, and those of the slot's stale rows past `r`, are
  never stored). The gate/up product's rows are the pairs' token rows, gathered into an
  aligned [rows, model] copy by XLA before the kernel (TMA copies whole boxes, not rows by
  index); the down product's rows are the gate/up product's output, in the same layout.
- The stores: a tile writes its aligned rows (its expert's rows and their padding), by
  TMA copies of 64, 32, 16 and 8 rows chosen by the bits of its row count, so no tile
  writes into another expert's rows.
- fp8 weights (e4m3 values with an fp32 scale per output channel, as
  `djax.models.fp8.Fp8Weight`): each step's e4m3 weight tile comes into the ring by TMA,
  is converted to the rows' dtype in registers and stored to a swizzled slot of that dtype
  that WGMMA reads (`tma_ring.stream`'s `converted`); the accumulator is multiplied by its
  columns' scales in fp32 before the activation and the store. This is the `dequant`
  product of `djax.models.fp8` (values converted exactly, product in fp32, scaled per
  channel), with the product kept in fp32 until the scale.
- fp8 x fp8 (`grouped_matmul_fp8`, `expert_mlp_fp8`; `moe="fp8_mosaic"`): Hopper's WGMMA
  takes 8-bit operands only K-major, so the weights come K-major ([experts, 2, ffn, model]
  and [experts, model, ffn], as a model holding its fp8 values K-major does) and the
  rows as e4m3: the token rows with a scale per row (`fp8_matmul_mosaic.quantize_rows`,
  before the gather), the activation with a scale per row of each 128-column tile
  (`fp8_matmul_mosaic.quantize_slices`), which the gate/up kernel writes itself: each CTA
  holds its rows' whole 128 columns of `silu(gate) * up` in fp32, so it quantises them
  before the store and stores their scales beside them, and no pass over the activation
  is left between the two products. Both e4m3 tiles go from the ring's K-major form to the
  tensor cores as they are (`fp8_matmul_mosaic.k_major_multiply`, which in the interpreter
  copies the weight tile transposed first), `block_k` a multiple of 128 (`fp8_tiles_for`);
  the fp32 product is multiplied by its rows' scales (the slot's 64, read by TMA from the
  tile's first row) and its columns' before the activation and the store
  (`fp8_matmul_mosaic.scale_products`). The down product takes its rows' scales per
  128-column slice of the contraction (`tma_ring.SliceScales`): each slice's product is
  scaled by them as it is added. Rows, tile table and stores as above.

`expert_mlp` runs both products: the gate/up product with `silu(gate) * up` fused (gate and
up weight tiles side by side in two accumulators), then the down product, both in the
aligned layout, which its caller makes (`djax.models.llada_moe.group_layout`) and reads
back.

The every-token layout (`EveryToken`; `expert_mlp_every_token`, `expert_mlp_fp8_every_token`)
is for forwards whose tokens fit one row tile (at most 64: a block's). Each expert that any
token goes to runs all the tokens in one tile, reading them by TMA as they are (row 0 on),
and writes their outputs from row `e * r`; the down product reads those rows back in
place. A tile's WGMMAs cost the same at 32 rows as at the ~4 an expert's pairs hold, so
this computes no more than the aligned layout where it matters, and no layout, gather or
tile table is built around the kernels: each CTA finds its tile from its expert's count of
pairs. The caller reads each pair's output at (its expert, its token).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import fp8_matmul_mosaic, tma_ring
from djax.kernels.handoff import QuantizedRows
from djax.kernels.tma_ring import ROW_ALIGN, ROW_TILE, Tiles

Array = jax.Array

FP8 = jnp.float8_e4m3fn
SCALE_BYTES = 4  # a column's fp32 scale
BLOCK_ROWS = 32  # row tiles of at most this many rows are a block forward's (its tokens)


def tiles_for(group_rows: int, k: int, n: int) -> Tiles:
    """128 columns (64 where 128 do not divide n) in 64-wide steps, 4 stages, row tiles
    of `row_tile_for(group_rows)` rows."""
    block_n = 128 if n % 128 == 0 else tma_ring.TILE
    rows = row_tile_for(group_rows)
    return Tiles(block_n=block_n, block_k=tma_ring.TILE, splits=1, stages=4, rows=rows)


def converted_tiles_for(group_rows: int, k: int, n: int) -> Tiles:
    """`tiles_for`'s tiles for e4m3 weights converted in the kernel: 2 stages where the row
    tiles take at most `BLOCK_ROWS` rows (a block forward), so two CTAs share an SM and one converts
    its tiles while the other multiplies (the gate/up product's ring, converted slots and
    output tile take 97 KB of shared memory at 2 stages, 145 KB at 4); `tiles_for`'s 4
    stages where they take more (a refresh)."""
    base = tiles_for(group_rows, k, n)
    return dataclasses.replace(base, stages=2) if base.rows <= BLOCK_ROWS else base


def default_tiles_for(converted: bool):
    """The tile rule of a product of 16-bit weights (`tiles_for`) or of e4m3 ones converted
    in the kernel (`converted_tiles_for`)."""
    return converted_tiles_for if converted else tiles_for


def fp8_tiles_for(group_rows: int, k: int, n: int) -> Tiles:
    """`tiles_for`'s tiles at one byte a value: block_k 128 (the bytes of a 16-bit step; a
    multiple of 128 as 8-bit K-major slots need) in 4 stages, or 256 in 2 where the row
    tiles take at most `BLOCK_ROWS` rows (a block forward) and 256 divides k: half the steps, in the
    same shared memory."""
    base = tiles_for(group_rows, k, n)
    wide = 2 * fp8_matmul_mosaic.K_TILE
    if base.rows <= BLOCK_ROWS and k % wide == 0:
        return dataclasses.replace(base, block_k=wide, stages=2)
    return dataclasses.replace(base, block_k=fp8_matmul_mosaic.K_TILE)


def row_tile_for(group_rows: int) -> int:
    """The rows of a tile where a group holds at most `group_rows` rows (the experts' MLP:
    its tokens, as each token reaches an expert once): those rounded up to a multiple of 8
    and a power of two, 16 to 64, so no group of a block forward is read in two tiles."""
    aligned = tma_ring.aligned(max(1, group_rows))
    return min(ROW_TILE, max(16, 1 << (aligned - 1).bit_length()))


def max_tiles(pairs: int, groups: int, block_m: int) -> int:
    """The most row tiles `pairs` rows in `groups` groups can make: each group of `n` rows
    makes `ceil(n / block_m)` <= `(n + block_m - 1) / block_m`, and no tile is empty."""
    return max(1, min(pairs, (pairs + groups * (block_m - 1)) // block_m))


def row_tiles(group_sizes: Array, block_m: int, n_tiles: int) -> tuple[Array, Array, Array]:
    """The tile table of rows sorted by group: group `g`'s `n_g` rows (after those of
    groups `< g`) make `ceil(n_g / block_m)` tiles, in order.

    group_sizes: [groups] int32. Returns (group [n_tiles], first row [n_tiles], rows
    [n_tiles]), int32; tiles past the used ones have 0 rows (and group and first row 0).
    """
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    per_group = (sizes + block_m - 1) // block_m
    tiles_end = jnp.cumsum(per_group)  # [groups]: tiles of groups <= g
    tile = jnp.arange(n_tiles, dtype=jnp.int32)
    group = jnp.sum(tiles_end[None, :] <= tile[:, None], axis=1, dtype=jnp.int32)
    used = group < groups
    group = jnp.where(used, group, 0)
    within = tile - (tiles_end - per_group)[group]  # the tile's index inside its group
    first_row = jnp.cumsum(sizes)[group] - sizes[group] + within * block_m
    rows = jnp.clip(sizes[group] - within * block_m, 0, block_m)
    return group, jnp.where(used, first_row, 0), jnp.where(used, rows, 0)


def pair_table(aligned_sizes: Array, block_m: int, rows: int) -> Array:
    """The tile table [3 n_tiles] int32 of `rows` rows in the aligned layout of groups of
    `aligned_sizes` [groups] (multiples of 8): `row_tiles`' tiles (`max_tiles` of them),
    each tile's group, then first rows (of x and of the output), then rows."""
    n_tiles = max_tiles(rows, aligned_sizes.shape[0], block_m)
    return jnp.concatenate(row_tiles(aligned_sizes, block_m, n_tiles))


@dataclasses.dataclass(frozen=True)
class EveryToken:
    """The every-token layout of a product (instead of a tile table): one row tile a
    group, which, where the group's count of pairs (the kernel's table operand,
    [groups] int32) is not 0, holds all the tokens, `rows` of them (rounded up to 8, at
    most the tile's rows `block_m`), written from output row `g * block_m`; x read from
    row 0 (`from_tokens`: the tokens themselves) or from the tile's output row (a product
    in this layout)."""

    rows: int
    from_tokens: bool

    @classmethod
    def of(cls, tokens: int, block_m: int, from_tokens: bool) -> EveryToken:
        """The layout of `tokens` tokens in row tiles of `block_m` rows."""
        if tokens > block_m:
            raise ValueError(
                f"expert_tiles_mosaic: {tokens} tokens in row tiles of {block_m}; the "
                "every-token layout holds a group's tokens in one tile"
            )
        return cls(tma_ring.aligned(tokens), from_tokens)

    @classmethod
    def pair(cls, tokens: int, up: Tiles, down: Tiles) -> tuple[EveryToken, EveryToken]:
        """The layouts of an MLP's gate/up product (reading the tokens) and down product
        (reading the gate/up output in place), whose tiles must hold the same rows."""
        if up.rows != down.rows:
            raise ValueError(
                f"expert_tiles_mosaic: the every-token layout takes gate/up and down tiles of "
                f"the same rows; got {up.rows} and {down.rows}"
            )
        return cls.of(tokens, up.rows, True), cls.of(tokens, down.rows, False)


def _silu_times(gate: Array, up: Array) -> Array:
    """`silu(gate) * up` in fp32, written with the ops Mosaic GPU lowers."""
    return gate / (1.0 + jnp.exp(-gate)) * up


def aligned_rows(pairs: int, groups: int, align: int = ROW_ALIGN) -> int:
    """Rows of an aligned layout of `pairs` rows in `groups` groups: each group padded to a
    multiple of `align` adds at most `align - 1` rows; a multiple of `align` itself."""
    rows = pairs + groups * (align - 1)
    return -(-rows // align) * align


def aligned_layout(group_sizes: Array, pairs: int) -> tuple[Array, Array, Array]:
    """The aligned layout of `pairs` rows sorted by group: group `g`'s `n_g` rows, in order,
    from row `A_g` = the sum of the earlier groups' sizes rounded up to multiples of 8 (so
    a multiple of 8); the rows past sum(group_sizes) after the last group, in order.

    group_sizes: [groups] int32, summing to at most `pairs`. Returns (position [pairs]: the
    aligned row of each sorted row; source [aligned_rows]: the sorted row each aligned row
    holds, 0 for padding rows; aligned sizes [groups]: `n_g` rounded up to 8), int32.
    """
    if group_sizes.ndim != 1:
        raise ValueError(f"expert_tiles_mosaic: group_sizes {group_sizes.shape}; expected [groups]")
    sizes = group_sizes.astype(jnp.int32)
    aligned = (sizes + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    ends = jnp.cumsum(sizes)
    # each sorted row's shift: its group's aligned start minus its start (the last for the
    # rows past every group)
    shift = jnp.cumsum(aligned) - aligned - (ends - sizes)
    shift = jnp.append(shift, jnp.sum(aligned) - ends[-1])
    row = jnp.arange(pairs, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right", method="compare_all")
    position = row + shift[group]
    rows = aligned_rows(pairs, sizes.shape[0])
    source = jnp.zeros(rows, jnp.int32).at[position].set(row, unique_indices=True)
    # Materialised once: fused into the gathers that take them, XLA recomputes their
    # compare-and-sums for every gathered value.
    return jax.lax.optimization_barrier((position, source, aligned))


def _store_tile(first, n_rows, *tiles) -> None:
    """Inside a kernel: the first `n_rows` (8 to 64, a multiple of 8) rows of each of
    `tiles`, pairs (smem, dst) of a shared-memory tile [64, ...] and a callable taking an
    indexer of GMEM rows and giving where they go, to the rows from `first` (a multiple of
    8), by one TMA copy per set bit of `n_rows` (copies of 64, 32, 16 and 8 rows), each from
    and to a multiple of 8 rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.commit_smem()
    done = 0
    size = ROW_TILE
    while size >= ROW_ALIGN:

        @pl.when(n_rows & size != 0)
        def _copy(size=size, done=done):
            for smem, dst in tiles:
                plgpu.copy_smem_to_gmem(smem.at[pl.ds(done, size)], dst(pl.ds(first + done, size)))

        done = done + (n_rows & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0)


# How a kernel takes its weights: of the rows' dtype; e4m3 converted to the rows' dtype in
# the kernel; e4m3 K-major times e4m3 rows (fp8 x fp8 WGMMA).
DTYPE, CONVERTED, FP8_PRODUCT = "dtype", "converted", "fp8"


def _kernel(
    *refs,
    tiles,
    steps,
    n,
    n_tiles,
    column_tiles,
    gated,
    form,
    out_fp8,
    x_slices,
    every_token,
    interpreting,
):
    """One CTA: one (row tile, column tile). Refs in order: the tile table [3 n_tiles]
    int32 of the aligned layout (each tile's group, then first rows, then rows), or with
    `every_token` (`EveryToken`) each group's count of pairs [groups]; x [rows, k] (e4m3
    under `FP8_PRODUCT`); w [groups, k, 2n] (`gated`: gate columns, then up columns) or
    [groups, k, n], K-major under `FP8_PRODUCT` ([groups, 2n or n, k]); under
    `FP8_PRODUCT` the rows' scales, [1, rows] fp32, or with `x_slices` one row of scales
    per slice of `fp8_matmul_mosaic.SLICE` columns [x_slices, rows]; under `CONVERTED` and
    `FP8_PRODUCT` the columns' scales [groups, 2n or n] fp32; out [out rows, n] (with
    `out_fp8` e4m3, then its scales [n / block_n, out rows] fp32: each column tile's rows
    quantised on their own). Scratch: the ring's, the output tile, then under `CONVERTED`
    the converted weight slots, under `FP8_PRODUCT` the rows' scale tile [1 or x_slices,
    64]; with scales the columns' scale tile [weights, block_n] and the scales' barriers; in
    the interpreter under `FP8_PRODUCT` the untransposed weight tile
    (`fp8_matmul_mosaic.k_major_multiply`); with `out_fp8` the output's scale tile [64]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    table_gmem, x_gmem, w_gmem, *refs = refs
    row_scale_gmem = refs.pop(0) if form == FP8_PRODUCT else None
    scale_gmem = refs.pop(0) if form != DTYPE else None
    out_gmem, *refs = refs
    out_scale_gmem = refs.pop(0) if out_fp8 else None
    scratch = refs
    weights = 2 if gated else 1
    ring, (out_smem, *rest) = scratch[: 2 * weights + 2], scratch[2 * weights + 2 :]
    out_scale_smem = rest.pop() if out_fp8 else None
    cta = jax.lax.axis_index("cta")
    tile, column_tile = cta // column_tiles, cta % column_tiles
    if every_token is None:
        group, n_rows = table_gmem[tile], table_gmem[2 * n_tiles + tile]
        x_row = first = pl.multiple_of(table_gmem[n_tiles + tile], ROW_ALIGN)  # aligned layout
    else:
        group = tile
        n_rows = jnp.where(table_gmem[tile] > 0, every_token.rows, 0)
        first = pl.multiple_of(tile * tiles.rows, ROW_ALIGN)
        x_row = 0 if every_token.from_tokens else first
    start = column_tile * tiles.block_n
    cols = pl.ds(start, tiles.block_n)
    offsets = [start, n + start] if gated else [start]
    rows = pl.ds(x_row, tiles.rows)

    def w_tile(ks, offset):
        if form == FP8_PRODUCT:
            return w_gmem.at[group, pl.ds(offset, tiles.block_n), ks]
        return w_gmem.at[group, ks, pl.ds(offset, tiles.block_n)]

    @pl.when(n_rows > 0)
    def _tile():
        converted = row_scale_smem = multiply = slice_scales = None
        scales = rest
        if form == CONVERTED:
            converted, scales = rest[:weights], rest[weights:]
        elif form == FP8_PRODUCT:
            row_scale_smem, *scales = rest
            multiply = fp8_matmul_mosaic.k_major_multiply(scales[2] if interpreting else None)
        if form != DTYPE:
            scale_smem, scale_bar = scales[0], scales[1]
            for side, offset in enumerate(offsets):
                plgpu.copy_gmem_to_smem(
                    scale_gmem.at[pl.ds(group, 1), pl.ds(offset, tiles.block_n)],
                    scale_smem.at[pl.ds(side, 1)],
                    scale_bar.at[side],
                )
        if form == FP8_PRODUCT:  # the scales of the slot's 64 rows (past the end: zeros)
            plgpu.copy_gmem_to_smem(
                row_scale_gmem.at[:, pl.ds(x_row, ROW_TILE)], row_scale_smem, scale_bar.at[weights]
            )
        if x_slices:
            slice_scales = tma_ring.SliceScales(
                fp8_matmul_mosaic.SLICE,
                lambda j: tma_ring.accumulator_rows(row_scale_smem[j], interpreting),
                lambda: plgpu.barrier_wait(scale_bar.at[weights]),
                interpreting,
            )

        def finish(*products):
            if form != DTYPE:
                waited = weights + (form == FP8_PRODUCT and not x_slices)
                for bar in range(waited):
                    plgpu.barrier_wait(scale_bar.at[bar])
                products = fp8_matmul_mosaic.scale_products(
                    products, scale_smem, None if x_slices else row_scale_smem, interpreting
                )
            out = _silu_times(*products) if gated else products[0]
            if out_fp8:  # each row of the tile quantised on its own
                scale = fp8_matmul_mosaic.scale_of(jnp.max(jnp.abs(out), axis=1))
                out_scale_smem[...] = scale
                scale = jax.lax.broadcast_in_dim(scale, out.shape, [0])
                out = fp8_matmul_mosaic.e4m3_values(out, scale)
            out_smem[...] = out.astype(out_smem.dtype)

        tma_ring.stream(
            x_gmem,
            [lambda ks, offset=offset: w_tile(ks, offset) for offset in offsets],
            ring,
            tiles,
            0,
            steps,
            rows,
            finish,
            converted,
            multiply,
            slice_scales,
        )
        stored = [(out_smem, lambda rows: out_gmem.at[rows, cols])]
        if out_fp8:
            stored.append((out_scale_smem, lambda rows: out_scale_gmem.at[column_tile, rows]))
        _store_tile(first, n_rows, *stored)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_matmul(
    x: Array,
    w: Array,
    group_sizes: Array,
    scale: Array | None = None,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Array:
    """Each group's rows times its own weights: `silu(x_g @ w[g, :, 0]) * (x_g @ w[g, :, 1])`
    for a gated `w`, else `x_g @ w[g]`, accumulated in fp32.

    x: [pairs, k], rows sorted by group, bf16 or fp16; w: [groups, k, 2, n] (gate and up)
    or [groups, k, n], of x's dtype, or e4m3 (`float8_e4m3fn`) with `scale` [groups, 2, n]
    or [groups, n] fp32, each output column's scale (the product is `(x_g @ w[g]) * scale`,
    before the activation); k and n multiples of 64; group_sizes: [groups] int32, summing
    to at most `pairs`. Returns [pairs, n] in x's dtype; rows past sum(group_sizes) may
    hold anything (the caller masks them). The rows go to the kernel in the aligned layout
    (`aligned_layout`: a gather of x and one of the result). `tiles`: the program shape
    (default `tiles_for`, `converted_tiles_for` for e4m3 weights; `splits` must be 1);
    `interpret`: run in Mosaic GPU's interpreter (default: exactly off GPUs, as the CPU
    tests do).
    """
    if x.ndim != 2:
        raise ValueError(f"expert_tiles_mosaic.grouped_matmul: x {x.shape}; expected [pairs, k]")
    position, source, aligned = aligned_layout(group_sizes, x.shape[0])
    tiles = tiles or default_tiles_for(scale is not None)(x.shape[0], x.shape[1], w.shape[-1])
    rows = source.shape[0]
    table = pair_table(aligned, tiles.rows, rows)
    return _product(x[source], w, table, rows, scale, tiles, interpret)[position]


@functools.partial(jax.jit, static_argnames=("tiles", "dtype", "interpret"))
def grouped_matmul_fp8(
    xq: Array,
    x_scale: Array,
    w_t: Array,
    w_scale: Array,
    group_sizes: Array,
    tiles: Tiles | None = None,
    dtype=jnp.bfloat16,
    interpret: bool | None = None,
) -> Array:
    """`grouped_matmul`'s products by fp8 x fp8 WGMMA: each group's e4m3 rows times its
    K-major e4m3 weights, the fp32 product times each row's and each column's scale (before
    the activation of a gated `w_t`).

    xq: [pairs, k] e4m3, rows sorted by group, x_scale [pairs] fp32 (`quantize_rows`);
    w_t: [groups, 2, n, k] (gate and up) or [groups, n, k] e4m3 (the weights [groups, k,
    ...] K-major), w_scale [groups, 2, n] or [groups, n] fp32; k a multiple of 128, n of
    64; group_sizes as `grouped_matmul`'s. Returns [pairs, n] in `dtype`; rows past
    sum(group_sizes) may hold anything. `tiles`: default `fp8_tiles_for`."""
    if xq.ndim != 2 or jnp.dtype(dtype) not in fp8_matmul_mosaic.OUT_DTYPES:
        raise ValueError(
            f"expert_tiles_mosaic.grouped_matmul_fp8: xq {xq.shape}, dtype {jnp.dtype(dtype)}; "
            "expected xq [pairs, k] and dtype bfloat16, float16 or float32"
        )
    position, source, aligned = aligned_layout(group_sizes, xq.shape[0])
    tiles = tiles or fp8_tiles_for(xq.shape[0], xq.shape[1], w_t.shape[-2])
    rows = source.shape[0]
    table = pair_table(aligned, tiles.rows, rows)
    out = _fp8_product(
        xq[source], x_scale[source], w_t, w_scale, table, rows, tiles, dtype, interpret
    )
    return out[position]


@functools.partial(jax.jit, static_argnames=("out_rows", "tiles", "interpret", "every_token"))
def _product(
    x: Array,
    w: Array,
    table: Array,
    out_rows: int,
    scale: Array | None,
    tiles: Tiles,
    interpret: bool | None,
    every_token: EveryToken | None = None,
) -> Array:
    """`grouped_matmul` on rows x [rows, k] over the tile table `table` (`pair_table`; with
    `every_token`, the groups' counts of pairs) into [out_rows, n], the rows no tile writes
    holding anything."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "expert_tiles_mosaic.grouped_matmul"
    rows, k = x.shape
    groups, n, gated = w.shape[0], w.shape[-1], w.ndim == 4
    expected = (groups, k, 2, n) if gated else (groups, k, n)
    if w.shape != expected or not tma_ring.fits(k, n):
        raise ValueError(
            f"{name}: x {x.shape}, w {w.shape}; expected w [groups, {k}, 2, n] or "
            f"[groups, {k}, n] and {k} and n multiples of 64"
        )
    scaled = scale is not None
    if scaled:
        if w.dtype != FP8 or not tma_ring.takes_dtype(x.dtype):
            raise ValueError(
                f"{name}: x {x.dtype}, w {w.dtype} with a scale; expected x bfloat16 or "
                "float16 and w float8_e4m3fn"
            )
        if scale.shape != w.shape[:1] + w.shape[2:] or scale.dtype != jnp.float32:
            raise ValueError(
                f"{name}: scale {scale.shape} {scale.dtype}; expected "
                f"{w.shape[:1] + w.shape[2:]} float32"
            )
    else:
        tma_ring.check_operands(name, x, w)
    if tiles.splits != 1:
        raise ValueError(f"{tiles}: the expert products take splits=1")
    weights = 2 if gated else 1
    extra = 0
    if scaled:  # the converted slots and scales; the ring's e4m3 slots take 1 byte a value
        tile = tiles.block_k * tiles.block_n
        converted, fp8_slots = weights * tile * x.dtype.itemsize, tiles.stages * weights * tile
        extra = converted + weights * tiles.block_n * SCALE_BYTES - fp8_slots
    tiles.check(k, n, weights=weights, out_bytes=x.dtype.itemsize, extra=extra, row_tiled=True)
    width = weights * n
    inputs = [x, w.reshape(groups, k, width)]
    scratch = []
    if scaled:
        inputs.append(scale.reshape(groups, width))
        converted = (tiles.block_k, tiles.block_n)
        transforms = tma_ring.swizzled(tiles.swizzle)
        scratch += [
            *(plgpu.SMEM(converted, x.dtype, transforms=transforms) for _ in range(weights)),
            plgpu.SMEM((weights, tiles.block_n), jnp.float32),
            plgpu.Barrier(num_barriers=weights),
        ]
    ring = tma_ring.ring_scratch(tiles, x.dtype, weights, w.dtype)
    form = CONVERTED if scaled else DTYPE
    return _launch(
        form, inputs, table, out_rows, ring, scratch, tiles, n, gated, x.dtype, interpret,
        every_token=every_token,
    )  # fmt: skip


@functools.partial(
    jax.jit, static_argnames=("out_rows", "tiles", "dtype", "interpret", "every_token")
)
def _fp8_product(
    xq: Array,
    x_scale: Array,
    w_t: Array,
    w_scale: Array,
    table: Array,
    out_rows: int,
    tiles: Tiles,
    dtype,
    interpret: bool | None,
    every_token: EveryToken | None = None,
) -> Array | tuple[Array, Array]:
    """`grouped_matmul_fp8` on rows xq [rows, k] over the tile table `table` into
    `out_rows` rows (as `_product`), their scales x_scale [rows] (per row) or
    [k / SLICE, rows] (per slice of `fp8_matmul_mosaic.SLICE` columns,
    `fp8_matmul_mosaic.quantize_slices`). `dtype` e4m3 (a gated product, 128-column
    tiles): the output quantised per row of each column tile, as (values [rows, n] e4m3,
    scales [n / SLICE, rows] fp32), the form x takes per slice."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    name = "expert_tiles_mosaic.grouped_matmul_fp8"
    rows, k = xq.shape
    x_slices = k // fp8_matmul_mosaic.SLICE if x_scale.ndim == 2 else 0
    if x_slices and x_scale.shape != (x_slices, rows):
        raise ValueError(
            f"{name}: x_scale {x_scale.shape}; expected [{rows}] or [{x_slices}, {rows}] (per "
            f"slice of {fp8_matmul_mosaic.SLICE} columns)"
        )
    out_fp8 = jnp.dtype(dtype) == FP8
    row_scale = x_scale[0] if x_slices else x_scale  # checked as [rows]
    out_dtype = jnp.float32 if out_fp8 else dtype  # checked among the 16/32-bit outputs
    fp8_matmul_mosaic.check_operands(name, xq, row_scale, w_t, w_scale, out_dtype)
    groups, n, gated = w_t.shape[0], w_t.shape[-2], w_t.ndim == 4
    expected = (groups, 2, n, k) if gated else (groups, n, k)
    if w_t.shape != expected:
        raise ValueError(
            f"{name}: xq {xq.shape}, w_t {w_t.shape}; expected w_t [groups, 2, n, {k}] or "
            f"[groups, n, {k}]"
        )
    if tiles.splits != 1:
        raise ValueError(f"{tiles}: the expert products take splits=1")
    if out_fp8 and (not gated or tiles.block_n != fp8_matmul_mosaic.SLICE):
        raise ValueError(
            f"{name}: an e4m3 output takes a gated product of {fp8_matmul_mosaic.SLICE}-column "
            f"tiles; got w_t {w_t.shape}, {tiles}"
        )
    out_bytes = jnp.dtype(dtype).itemsize
    extra = (max(x_slices, 1) - 1 + out_fp8) * ROW_TILE * SCALE_BYTES
    fp8_matmul_mosaic.check_tiles(
        tiles, k, n, gated=gated, out_bytes=out_bytes, row_tiled=True, extra=extra
    )
    weights = 2 if gated else 1
    width = weights * n
    inputs = [
        xq,
        w_t.reshape(groups, width, k),
        x_scale.reshape(max(x_slices, 1), rows),
        w_scale.reshape(groups, width),
    ]
    scratch = [
        plgpu.SMEM((max(x_slices, 1), ROW_TILE), jnp.float32),
        plgpu.SMEM((weights, tiles.block_n), jnp.float32),
        plgpu.Barrier(num_barriers=weights + 1),
    ]
    if tma_ring.interpret_params(interpret) is not None:  # `k_major_multiply`'s tile
        scratch.append(plgpu.SMEM((tiles.block_k, tiles.block_n), FP8))
    if out_fp8:  # the output tile's row scales
        scratch.append(plgpu.SMEM((ROW_TILE,), jnp.float32))
    ring = tma_ring.ring_scratch(tiles, FP8, weights, k_major=True)
    return _launch(
        FP8_PRODUCT,
        inputs,
        table,
        out_rows,
        ring,
        scratch,
        tiles,
        n,
        gated,
        dtype,
        interpret,
        x_slices=x_slices,
        every_token=every_token,
    )


def _launch(
    form,
    inputs,
    table,
    rows,
    ring,
    scratch,
    tiles,
    n,
    gated,
    dtype,
    interpret,
    x_slices=0,
    every_token=None,
):
    """The kernel of `form` on `inputs` (x, w, then the scales `_kernel` takes) over the
    tile table `table` (`pair_table`, or the groups' counts of pairs in the layout
    `every_token`), its scratch the `ring`, the output tile and `scratch`; returns [rows,
    n] in `dtype`, or for e4m3 (values, their scales [n / block_n, rows]). `x_slices`: x's
    scales per contraction slice (`_kernel`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k = inputs[0].shape[1]
    per_tile = 1 if every_token else 3
    if table.ndim != 1 or table.shape[0] % per_tile:
        raise ValueError(
            f"expert_tiles_mosaic: tile table {table.shape}; expected [{per_tile} n_tiles]"
        )
    n_tiles = table.shape[0] // per_tile
    column_tiles = n // tiles.block_n
    out_fp8 = jnp.dtype(dtype) == FP8
    out_type = jax.ShapeDtypeStruct((rows, n), dtype)
    if out_fp8:
        out_type = (out_type, jax.ShapeDtypeStruct((column_tiles, rows), jnp.float32))
    params = tma_ring.interpret_params(interpret)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            steps=k // tiles.block_k,
            n=n,
            n_tiles=n_tiles,
            column_tiles=column_tiles,
            gated=gated,
            form=form,
            out_fp8=out_fp8,
            x_slices=x_slices,
            every_token=every_token,
            interpreting=params is not None,
        ),
        out_type=out_type,
        grid=(n_tiles * column_tiles,),
        grid_names=("cta",),
        scratch_types=[*ring, plgpu.SMEM((ROW_TILE, tiles.block_n), dtype), *scratch],
        # jax 0.11's default, named so jax 0.10's CUDA lowering runs the same layout inference
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=params,
    )
    return kernel(table, *inputs)


def expert_mlp(
    x: Array,
    source_rows: Array,
    gate_up: Array,
    down: Array,
    group_sizes: Array,
    gate_up_scale: Array | None = None,
    down_scale: Array | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
    interpret: bool | None = None,
) -> Array:
    """The experts' SwiGLU MLP on rows in the aligned layout: row `i` holds token
    `source_rows[i]` (gathered by XLA), `grouped_matmul`'s product with the activation
    fused, then the down product on its output in the same layout.

    x: [tokens, model]; source_rows: [rows] int32, rows a multiple of 8, each expert's rows
    from a multiple of 8 (the layout `djax.models.llada_moe.group_layout` makes at
    `align=ROW_ALIGN`: padding rows hold any token); gate_up: [experts, model, 2, ffn];
    down: [experts, ffn, model]; group_sizes: [experts] int32, multiples of 8 (padding
    included); with fp8 weights their scales gate_up_scale [experts, 2, ffn] and
    down_scale [experts, model] (`grouped_matmul`). Returns [rows, model]; padding rows and
    rows past sum(group_sizes) may hold anything. `tiles`: (gate/up, down) program shapes,
    default `tiles_for` each (`converted_tiles_for` for e4m3 weights).
    """
    _check_layout("expert_tiles_mosaic.expert_mlp", source_rows)
    up_tiles, down_tiles = _mlp_tiles_16bit(tiles, x, gate_up, gate_up_scale)
    rows = source_rows.shape[0]
    tables = [pair_table(group_sizes, t.rows, rows) for t in (up_tiles, down_tiles)]
    act = _product(x[source_rows], gate_up, tables[0], rows, gate_up_scale, up_tiles, interpret)
    return _product(act, down, tables[1], rows, down_scale, down_tiles, interpret)


def expert_mlp_every_token(
    x: Array,
    counts: Array,
    gate_up: Array,
    down: Array,
    gate_up_scale: Array | None = None,
    down_scale: Array | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
    interpret: bool | None = None,
) -> Array:
    """`expert_mlp`'s products in the every-token layout (`EveryToken`): each expert that
    any token goes to runs all the tokens, read as they are (no gather), one row tile an
    expert; its tokens' outputs land in rows of their own.

    x: [tokens, model], tokens at most the tiles' rows (64 at most); counts: [experts]
    int32, each expert's pairs (only whether it is 0 matters);
    weights and `tiles` as `expert_mlp`'s, both tilings of the same rows. Returns [experts,
    R, model], R the tiles' rows (`row_tile_for(tokens)` by default): expert e's output of
    token t at [e, t]; the rest (t >= tokens, experts not routed) may hold anything.
    """
    up_tiles, down_tiles = _mlp_tiles_16bit(tiles, x, gate_up, gate_up_scale)
    experts, block_m = gate_up.shape[0], up_tiles.rows
    rows = experts * block_m
    up, down_layout = EveryToken.pair(x.shape[0], up_tiles, down_tiles)
    x = tma_ring.aligned_rows(x)
    act = _product(x, gate_up, counts, rows, gate_up_scale, up_tiles, interpret, up)
    out = _product(act, down, counts, rows, down_scale, down_tiles, interpret, down_layout)
    return out.reshape(experts, block_m, -1)


def _mlp_tiles(tiles, default, tokens: int, model: int, ffn: int):
    """The (gate/up, down) tiles of an MLP of widths `model` -> `ffn` -> `model`: those
    given, else `default(tokens, k, n)` each."""
    up_tiles, down_tiles = tiles or (None, None)
    return up_tiles or default(tokens, model, ffn), down_tiles or default(tokens, ffn, model)


def _mlp_tiles_16bit(tiles, x: Array, gate_up: Array, gate_up_scale: Array | None):
    """`_mlp_tiles` of the MLPs on 16-bit weights [experts, model, 2, ffn] or e4m3 ones
    converted in the kernel (`gate_up_scale` given): `default_tiles_for` their form."""
    default = default_tiles_for(gate_up_scale is not None)
    return _mlp_tiles(tiles, default, x.shape[0], gate_up.shape[1], gate_up.shape[-1])


def _check_layout(name: str, source_rows: Array) -> None:
    if source_rows.ndim != 1 or source_rows.shape[0] % ROW_ALIGN:
        raise ValueError(
            f"{name}: source_rows {source_rows.shape}; expected [rows], rows a multiple of "
            f"{ROW_ALIGN} (the aligned layout)"
        )


def expert_mlp_fp8(
    x: Array | QuantizedRows,
    source_rows: Array,
    gate_up_t: Array,
    gate_up_scale: Array,
    down_t: Array,
    down_scale: Array,
    group_sizes: Array,
    tiles: tuple[Tiles, Tiles] | None = None,
    interpret: bool | None = None,
) -> Array:
    """`expert_mlp` by fp8 x fp8 WGMMA (`grouped_matmul_fp8`) on K-major e4m3 weights: the
    token rows quantised per row (`fp8_matmul_mosaic.quantize_rows`) and gathered into the
    aligned layout with their scales, the gate/up product with the activation fused and
    quantised per row of each 128-column tile in the kernel
    (`fp8_matmul_mosaic.quantize_slices` of the fp32 activation), then the down product,
    each contraction slice's product times its rows' scales.

    x: [tokens, model] bf16 or fp16, or its rows already quantised (`QuantizedRows`, as the
    norm before the experts hands them on); source_rows and group_sizes as `expert_mlp`'s
    (the aligned layout); gate_up_t: [experts, 2, ffn, model] e4m3, gate_up_scale
    [experts, 2, ffn] fp32; down_t: [experts, model, ffn] e4m3, down_scale [experts, model]
    fp32; model and ffn multiples of 128. Returns [rows, model] in x's dtype; padding rows
    and rows past sum(group_sizes) may hold anything. `tiles`: (gate/up, down) program
    shapes, default `fp8_tiles_for` each.
    """
    _check_layout("expert_tiles_mosaic.expert_mlp_fp8", source_rows)
    rows = source_rows.shape[0]
    tokens = _fp8_rows("expert_tiles_mosaic.expert_mlp_fp8", x)
    up_tiles, down_tiles = _mlp_tiles(
        tiles, fp8_tiles_for, tokens.shape[0], gate_up_t.shape[-1], gate_up_t.shape[-2]
    )
    tables = [pair_table(group_sizes, t.rows, rows) for t in (up_tiles, down_tiles)]
    act = _fp8_product(
        tokens.values[source_rows],
        tokens.scale[source_rows],
        gate_up_t,
        gate_up_scale,
        tables[0],
        rows,
        up_tiles,
        FP8,  # quantised per row of each 128-column tile, as the down product takes it
        interpret,
    )
    return _fp8_product(*act, down_t, down_scale, tables[1], rows, down_tiles, x.dtype, interpret)


def expert_mlp_fp8_every_token(
    x: Array | QuantizedRows,
    counts: Array,
    gate_up_t: Array,
    gate_up_scale: Array,
    down_t: Array,
    down_scale: Array,
    tiles: tuple[Tiles, Tiles] | None = None,
    interpret: bool | None = None,
) -> Array:
    """`expert_mlp_fp8`'s products in the every-token layout of `expert_mlp_every_token`
    (its arguments and result; the weights and x as `expert_mlp_fp8`'s)."""
    tokens = _fp8_rows("expert_tiles_mosaic.expert_mlp_fp8_every_token", x)
    up_tiles, down_tiles = _mlp_tiles(
        tiles, fp8_tiles_for, tokens.shape[0], gate_up_t.shape[-1], gate_up_t.shape[-2]
    )
    experts, block_m = gate_up_t.shape[0], up_tiles.rows
    rows = experts * block_m
    up, down = EveryToken.pair(tokens.shape[0], up_tiles, down_tiles)
    values = tma_ring.aligned_rows(tokens.values)
    scale = tma_ring.aligned_rows(tokens.scale[:, None])[:, 0]
    act = _fp8_product(
        values, scale, gate_up_t, gate_up_scale, counts, rows, up_tiles, FP8, interpret, up
    )
    out = _fp8_product(*act, down_t, down_scale, counts, rows, down_tiles, x.dtype, interpret, down)
    return out.reshape(experts, block_m, -1)


def _fp8_rows(name: str, x: Array | QuantizedRows) -> QuantizedRows:
    """x [tokens, model] as e4m3 rows with a scale per row (as they are where quantised)."""
    if len(x.shape) != 2:
        raise ValueError(f"{name}: x {x.shape}; expected [tokens, model]")
    return fp8_matmul_mosaic.quantized(x)  # per token: the pairs share its rows
