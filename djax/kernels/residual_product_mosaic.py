"""A block layer's attention-output or down product with the residual add in its epilogue,
leaving the RMSNorm after it to the next product, as a Pallas Mosaic GPU kernel (Hopper: TMA
copies, WGMMA): the attention output's under `norm_impl="fused"`.

Each CTA owns one row tile of 64 and `block_n` columns, streams its x and weight tiles
through a ring (`tma_ring`), and finishes its tile:
`h = residual + x @ w` (the product rounded to h's dtype first), `h * scale` and the tile's
share of each row's sum of squares (`handoff.ScaledRows`). The residual tile and the whole
scale vector come in by TMA while the weights stream.

Unsplit (`Tiles.splits` 1) a CTA runs the whole contraction. Split, the `splits` CTAs of a
cluster each run one slice of it for the same tile and leave their fp32 partial product in
their shared memory; after a cluster barrier the first CTA adds the others' (read through
distributed shared memory) to its own and finishes the tile, and a second barrier keeps the
others alive until it has read them. Wider column tiles (128-byte weight rows) then still
spread over as many CTAs as the narrow unsplit ones, and the epilogue runs once per tile.
Mosaic GPU's interpreter has no clusters: the split form runs compiled only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from djax.kernels import tma_ring
from djax.kernels.handoff import ScaledRows
from djax.kernels.tma_ring import NARROW, ROW_TILE, Tiles

Array = jax.Array


def tiles_for(m: int, k: int, n: int) -> Tiles:
    """32-column tiles (128 CTAs at a 4096-wide model) in
    up to 128-wide steps, 6 stages."""
    return Tiles(block_n=NARROW, block_k=tma_ring.largest_block(k, 128), splits=1, stages=6)


# The most column tiles (rows of the scale's one TMA copy).
MAX_COLUMN_TILES = 256


def fits(k: int, n: int) -> bool:
    """Whether the kernel takes a contraction of `k` into `n` columns at `tiles_for`'s
    tiles: both multiples of 64, at most `MAX_COLUMN_TILES` of 32 columns."""
    return tma_ring.fits(k, n) and n // NARROW <= MAX_COLUMN_TILES


def _f32_swizzled() -> tuple:
    """The transforms of a partial product's tile [64, block_n] fp32 in shared memory:
    swizzled in 32-column (128-byte) tiles, so an accumulator is stored and read in its
    own layout without bank conflicts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (
        plgpu.TilingTransform((8, tma_ring.SWIZZLE // 4)),
        plgpu.SwizzleTransform(tma_ring.SWIZZLE),
    )


# The contraction slices a cluster's CTAs may share (`Tiles.splits`): cluster sizes every
# Hopper GPU launches.
CLUSTER_SPLITS = (1, 2, 4)


def check_tiles(tiles: Tiles, k: int, n: int) -> None:
    """Raise a ValueError naming `tiles` unless the kernel takes them for a `k -> n` product
    of 16-bit values: `splits` in `CLUSTER_SPLITS`, at most `MAX_COLUMN_TILES` column tiles,
    and the ring with the epilogue's tiles (the residual, h, `h * scale`, and with splits
    the fp32 partial product a cluster's CTAs share), the scale and the sums of squares
    within shared memory (`Tiles.check`)."""
    if tiles.splits not in CLUSTER_SPLITS or n // tiles.block_n > MAX_COLUMN_TILES:
        raise ValueError(
            f"{tiles}: the residual product takes splits in {CLUSTER_SPLITS} and at most "
            f"{MAX_COLUMN_TILES} column tiles"
        )
    partial = ROW_TILE * tiles.block_n * 4 if tiles.splits > 1 else 0
    epilogue = ROW_TILE * tiles.block_n * 2 * 3 + n * 2 + ROW_TILE * 4 + partial
    tiles.check(k, n, weights=1, out_bytes=0, extra=epilogue)


def _cluster_sync() -> None:
    """Inside a kernel run in clusters: every thread of the cluster's CTAs waits here until
    all have arrived, their earlier shared-memory writes then visible to all of them
    (`barrier.cluster` arrive with release, wait with acquire semantics)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def sync(_launch_ctx):
        from jax._src.lib.mlir.dialects import nvvm

        nvvm.cluster_arrive(aligned=True)  # release: this thread's writes before it
        nvvm.cluster_wait(aligned=True)  # acquire: the cluster's writes before its arrivals

    sync()


def scaled_rows_tile(residual, y, scale_smem, column_tile, dtype, interpreting: bool):
    """Inside a kernel, one tile of `ScaledRows` (`handoff`): `h = residual + y` rounded to
    `dtype` (the sum in fp32, `y` already rounded as its contract says), `h * scale` in
    `dtype` and each row's sum of squares of the stored `h`, in fp32. residual: [rows,
    cols] tile; y: fp32 [rows, cols]; scale_smem: the norm scale by column tile, [tiles,
    cols], read at `column_tile` once h is made (the order the lowering's layouts were
    checked in on GPUs). Returns (h, scaled, squares [rows])."""
    h = (residual.astype(jnp.float32) + y).astype(dtype)
    hf = h.astype(jnp.float32)
    scale = tma_ring.accumulator_columns(scale_smem[column_tile], interpreting)
    scale = jax.lax.broadcast_in_dim(scale.astype(jnp.float32), hf.shape, [1])
    return h, (hf * scale).astype(dtype), jnp.sum(hf * hf, axis=1)


def _kernel(
    x_gmem,
    w_gmem,
    res_gmem,
    scale_gmem,
    h_gmem,
    scaled_gmem,
    squares_gmem,
    *scratch,
    tiles,
    steps,
    m,
    column_tiles,
    interpreting,
):
    """One CTA: one (row tile, column tile) of x [m8, k] @ w [k, n] with residual [m8, n]
    and scale [n // block_n, block_n], into h, scaled [m, n] and squares
    [n // block_n, m8]; with `tiles.splits` > 1 one slice of the contraction, its CTA
    `split` of a cluster, whose first CTA adds the others' partial products (read from
    their shared memory) and finishes the tile."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if tiles.splits > 1:
        *scratch, partial_smem = scratch
        split = jax.lax.axis_index("split")
    else:
        split = 0
    *ring, res_smem, scale_smem, inputs_bar, h_smem, scaled_smem, squares_smem = scratch
    cta = jax.lax.axis_index("cta")
    row_tile, column_tile = cta // column_tiles, cta % column_tiles
    start = column_tile * tiles.block_n
    cols = pl.ds(start, tiles.block_n)
    rows = pl.ds(row_tile * ROW_TILE, ROW_TILE)

    def leading(body):
        """`body` run by the CTA that finishes the tile: the only one, or a cluster's first."""
        if tiles.splits == 1:
            body()
        else:
            pl.when(split == 0)(body)

    @leading
    def _inputs():
        plgpu.copy_gmem_to_smem(res_gmem.at[rows, cols], res_smem, inputs_bar.at[0])
        plgpu.copy_gmem_to_smem(scale_gmem, scale_smem, inputs_bar.at[1])

    def epilogue(product):
        dtype = h_smem.dtype
        y = product.astype(dtype).astype(jnp.float32)
        plgpu.barrier_wait(inputs_bar.at[0])
        plgpu.barrier_wait(inputs_bar.at[1])
        h, scaled, squares = scaled_rows_tile(
            res_smem[...], y, scale_smem, column_tile, dtype, interpreting
        )
        h_smem[...] = h
        scaled_smem[...] = scaled
        squares_smem[...] = squares

    def finish(product):
        if tiles.splits == 1:
            epilogue(product)
            return
        partial_smem[...] = product
        _cluster_sync()  # every slice's partial product is in its CTA's shared memory

        @pl.when(split == 0)
        def _sum():
            total = product
            for peer in range(1, tiles.splits):
                peer_partial = plgpu.cluster_ref(partial_smem, {"split": peer})
                total = total + peer_partial[...]
            epilogue(total)

        _cluster_sync()  # the first CTA has read the others' shared memory: they may end

    tma_ring.stream(
        x_gmem, [lambda ks: w_gmem.at[ks, cols]], ring, tiles, split * steps, steps, rows, finish
    )

    @leading
    def _store():
        tma_ring.store_rows(
            h_smem,
            lambda rows: h_gmem.at[rows, cols],
            row_tile,
            m,
            (scaled_smem, lambda rows: scaled_gmem.at[rows, cols], m),
            (squares_smem, lambda rows: squares_gmem.at[column_tile, rows], squares_gmem.shape[1]),
        )


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def residual_product(
    x: Array,
    w: Array,
    residual: Array,
    scale: Array,
    eps: float,
    tiles: Tiles | None = None,
    interpret: bool | None = None,
) -> tuple[Array, ScaledRows]:
    """`h = residual + x @ w` and the inputs of the RMSNorm after it, in one Mosaic GPU
    kernel.

    x: [..., k]; w: [k, n]; residual: [..., n]; scale: [n], the norm's learned scale, and
    `eps` its epsilon; all bf16 or all fp16, k and n multiples of 64 (`fits`). Returns (h,
    `ScaledRows`), h shaped and typed like residual.
    Row counts that are not multiples of 8 are padded with zero rows for the kernel (extra
    copies of x and the residual, and a slice of the sums of squares). `tiles`: the program
    shape (default `tiles_for`; `splits` > 1 over a cluster's CTAs, compiled only:
    `check_tiles`); `interpret`: run in Mosaic GPU's interpreter (default: exactly off
    GPUs, as the CPU tests do).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    k, n = w.shape
    if (
        x.shape[-1] != k
        or residual.shape != (*x.shape[:-1], n)
        or scale.shape != (n,)
        or not fits(k, n)
    ):
        raise ValueError(
            f"residual_product_mosaic.residual_product: x {x.shape}, w {w.shape}, residual "
            f"{residual.shape}, scale {scale.shape}; expected x [..., {k}], residual "
            f"[..., {n}] and scale [{n}], with k and n multiples of 64, n at most "
            f"{MAX_COLUMN_TILES * NARROW}"
        )
    name = "residual_product_mosaic.residual_product"
    tma_ring.check_operands(name, x, w)
    if residual.dtype != x.dtype or scale.dtype != x.dtype:
        raise ValueError(
            f"{name}: residual {residual.dtype}, scale {scale.dtype}; expected x's {x.dtype}"
        )
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    m8 = tma_ring.aligned(m)
    tiles = tiles or tiles_for(m, k, n)
    check_tiles(tiles, k, n)
    column_tiles = n // tiles.block_n
    params = tma_ring.interpret_params(interpret)
    if params is not None and tiles.splits > 1:
        raise ValueError(
            f"{tiles}: splits > 1 (a cluster's CTAs reading each other's shared memory) "
            "has no Mosaic GPU interpreter; it runs compiled, on a Hopper GPU"
        )
    cluster = {"cluster": (tiles.splits,), "cluster_names": ("split",)} if tiles.splits > 1 else {}
    out = jax.ShapeDtypeStruct((m, n), residual.dtype)
    tile = (ROW_TILE, tiles.block_n)
    swizzled = tma_ring.swizzled(tiles.swizzle)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            tiles=tiles,
            steps=k // (tiles.splits * tiles.block_k),
            m=m,
            column_tiles=column_tiles,
            interpreting=params is not None,
        ),
        out_type=(out, out, jax.ShapeDtypeStruct((column_tiles, m8), jnp.float32)),
        grid=(pl.cdiv(m, ROW_TILE) * column_tiles,),
        grid_names=("cta",),
        scratch_types=[
            *tma_ring.ring_scratch(tiles, x.dtype, weights=1),
            plgpu.SMEM(tile, x.dtype, transforms=swizzled),  # the residual tile
            plgpu.SMEM((column_tiles, tiles.block_n), x.dtype),  # the scale, by column tile
            plgpu.Barrier(num_barriers=2),
            plgpu.SMEM(tile, x.dtype),  # h
            plgpu.SMEM(tile, x.dtype),  # h * scale
            plgpu.SMEM((ROW_TILE,), jnp.float32),  # the sums of squares
            # with splits: this CTA's partial product, read by its cluster's first CTA
            *(
                [plgpu.SMEM(tile, jnp.float32, transforms=_f32_swizzled())]
                if tiles.splits > 1
                else []
            ),
        ],
        interpret=params,
        **cluster,
    )
    res = residual.reshape(m, n)
    inputs = (tma_ring.aligned_rows(rows), w, tma_ring.aligned_rows(res))
    h, scaled, squares = kernel(*inputs, scale.reshape(column_tiles, tiles.block_n))
    lead = residual.shape[:-1]
    squares = squares[:, :m] if m8 != m else squares
    return h.reshape(residual.shape), ScaledRows(
        scaled.reshape(residual.shape), squares.reshape(-1, *lead), eps
    )
