"""The routed experts' two products over token-expert pairs sorted by expert, as Pallas
Triton kernels whose row tiles each belong to one expert: djax's GPU path for LLaDA-MoE's
experts (`moe_impl="pallas"`).

A grouped matmul over fixed tiles of `block_m` sorted rows computes a tile that straddles
two experts once per expert, and its grid of `rows / block_m + experts - 1` row slots runs
every slot's whole contraction, used or not. Here the tiles follow the experts instead:
expert `e`'s `n_e`
rows make `ceil(n_e / block_m)` tiles of their own, described by a small table
(`row_tiles`), so each expert's weights are read once per column tile (plus once per extra
tile of an expert with more than `block_m` rows), and the programs past the table's used
tiles (the grid holds `max_tiles`, the most any routing can need) return at once: a forward
whose tokens reach few experts reads only theirs.

`expert_mlp` runs both products: the gate/up product with `silu(gate) * up` fused (the
gate and up columns of the `[experts, model, 2, ffn]` weight side by side in two fp32
accumulators, as `swiglu` does for the dense MLP), then the down product.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tiles as tiling

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Program shape of one product: a `block_m x block_n` output tile of one expert's
    rows in `block_k` contraction steps; Triton's `num_warps` and `num_stages`. Each block
    is a power of two >= 16."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


def tiles_for(pairs: int, groups: int, k: int, n: int) -> Tiles:
    """Rows per tile near the mean pairs per expert (16 to 64), columns and contraction
    steps of up to 128 and 64."""
    return Tiles(
        block_m=tiling.row_block(max(1, pairs // max(1, groups))),
        block_n=tiling.largest_block(n, 128),
        block_k=tiling.largest_block(k, 64),
    )


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


def _kernel(*refs, tiles, gated, gathered):
    """One (row tile, column tile) program. Refs are whole arrays, in order: the tile table
    (group, first row, rows) [n_tiles] int32; with `gathered`, the source row of each pair
    [pairs] int32; x [pairs or source rows, k]; w [groups, k, 2, n] (`gated`) or
    [groups, k, n]; out [pairs, n]."""
    from jax.experimental.pallas import triton as plgpu

    group_ref, first_ref, rows_ref, *refs = refs
    source_ref, x_ref, w_ref, out_ref = refs if gathered else (None, *refs)
    tile = pl.program_id(0)
    group, first, n_rows = group_ref[tile], first_ref[tile], rows_ref[tile]
    k = x_ref.shape[1]
    rows = pl.ds(first, tiles.block_m)
    cols = pl.ds(pl.program_id(1) * tiles.block_n, tiles.block_n)
    valid = jnp.arange(tiles.block_m) < n_rows
    row_ok = valid[:, None]

    @pl.when(n_rows > 0)
    def _():
        if gathered:  # row and column indices as arrays: Pallas's interpreter takes no mix
            sources = plgpu.load(source_ref.at[rows], mask=valid, other=0)[:, None]
            columns = jnp.arange(tiles.block_k)[None, :]

        def step(i, accs):
            ks = pl.ds(i * tiles.block_k, tiles.block_k)
            x_tile = (
                x_ref.at[sources, i * tiles.block_k + columns] if gathered else x_ref.at[rows, ks]
            )
            x = plgpu.load(x_tile, mask=row_ok, other=0.0)
            if gated:
                ws = [w_ref[group, ks, jnp.int32(side), cols] for side in (0, 1)]
            else:
                ws = [w_ref[group, ks, cols]]
            return tuple(
                acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
                for w, acc in zip(ws, accs, strict=True)
            )

        zeros = jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32)
        accs = jax.lax.fori_loop(0, k // tiles.block_k, step, (zeros,) * (2 if gated else 1))
        out = jax.nn.silu(accs[0]) * accs[1] if gated else accs[0]
        plgpu.store(out_ref.at[rows, cols], out.astype(out_ref.dtype), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def grouped_matmul(
    x: Array,
    w: Array,
    group_sizes: Array,
    source_rows: Array | None = None,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> Array:
    """Each group's rows times its own weights: `silu(x_g @ w[g, :, 0]) * (x_g @ w[g, :, 1])`
    for a gated `w`, else `x_g @ w[g]`, accumulated in fp32.

    x: [pairs, k], rows sorted by group, or with `source_rows` [pairs] int32 any [rows, k]
    whose row `source_rows[i]` is the i-th sorted row (read by the kernel: no gathered copy);
    w: [groups, k, 2, n] (gate and up) or [groups, k, n]; group_sizes: [groups] int32,
    summing to at most `pairs`. Returns [pairs, n] in x's dtype; rows past sum(group_sizes)
    are left unwritten (the caller masks them). `tiles`: the program shape (default
    `tiles_for`); `interpret`: run in Pallas's interpreter (default: exactly off GPUs, as
    the CPU tests do).
    """
    from jax.experimental.pallas import triton as plgpu

    k = x.shape[1]
    pairs = x.shape[0] if source_rows is None else source_rows.shape[0]
    groups, n, gated = w.shape[0], w.shape[-1], w.ndim == 4
    expected = (groups, k, 2, n) if gated else (groups, k, n)
    if w.shape != expected or group_sizes.shape != (groups,) or not tiling.matmul_fits(k, n):
        raise ValueError(
            f"grouped_matmul: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}; "
            f"expected w [groups, {k}, 2, n] or [groups, {k}, n], group_sizes [groups] and "
            f"{k} and n multiples of 16"
        )
    if source_rows is not None and source_rows.ndim != 1:
        raise ValueError(f"grouped_matmul: source_rows {source_rows.shape}; expected [pairs]")
    tiles = tiles or tiles_for(pairs, groups, k, n)
    blocks = (tiles.block_m, tiles.block_n, tiles.block_k)
    if not all(map(tiling.is_block, blocks)) or n % tiles.block_n or k % tiles.block_k:
        raise ValueError(
            f"{tiles}: blocks must be powers of two >= 16, block_n dividing n = {n} and "
            f"block_k dividing k = {k}"
        )
    n_tiles = max_tiles(pairs, groups, tiles.block_m)
    table = row_tiles(group_sizes, tiles.block_m, n_tiles)
    gathered = source_rows is not None
    sources = (source_rows.astype(jnp.int32),) if gathered else ()
    return pl.pallas_call(
        functools.partial(_kernel, tiles=tiles, gated=gated, gathered=gathered),
        out_shape=jax.ShapeDtypeStruct((pairs, n), x.dtype),
        grid=(n_tiles, n // tiles.block_n),
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        interpret=tiling.interpret_mode(interpret),
        name="expert_matmul_gated" if gated else "expert_matmul",
    )(*table, *sources, x, w)


def expert_mlp(
    x: Array,
    source_rows: Array,
    gate_up: Array,
    down: Array,
    group_sizes: Array,
    tiles: tuple[Tiles, Tiles] | None = None,
    interpret: bool | None = None,
) -> Array:
    """The experts' SwiGLU MLP on the rows `x[source_rows]` (sorted by expert):
    `grouped_matmul` reading them straight from `x` with the activation fused, then the
    down product.

    x: [tokens, model]; source_rows: [pairs] int32; gate_up: [experts, model, 2, ffn];
    down: [experts, ffn, model]; group_sizes: [experts] int32. Returns [pairs, model]; rows
    past sum(group_sizes) may hold anything. `tiles`: (gate/up, down) program shapes,
    default `tiles_for` each.
    """
    up_tiles, down_tiles = tiles or (None, None)
    act = grouped_matmul(x, gate_up, group_sizes, source_rows, up_tiles, interpret)
    return grouped_matmul(act, down, group_sizes, tiles=down_tiles, interpret=interpret)
