"""Which implementation each part of the forward takes: what `auto` picks for each `*_impl`
module option on each backend, dtype and shape (each choice's measured reason is in its
docstring and bench/NOTES.md); the options' names and values are `djax.kernel_options`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from djax.kernel_options import KERNEL_OPTIONS, check_choice
from djax.models import flash_attention, pallas_tiles, residual_product, rope_write, split_k, swiglu

ATTENTION_IMPLS = KERNEL_OPTIONS["attention_impl"].choices
MLP_IMPLS = KERNEL_OPTIONS["mlp_impl"].choices
NORM_IMPLS = KERNEL_OPTIONS["norm_impl"].choices
MATMUL_IMPLS = KERNEL_OPTIONS["matmul_impl"].choices
ROPE_IMPLS = KERNEL_OPTIONS["rope_impl"].choices
# The fewest heads (kv heads x (group + 2), one program each) `fuse_qkv_rope` fuses: LLaDA-MoE's
# 48, the smallest count measured to gain (13.6 µs against 10.5 + 5.4 on an H200). Fewer, as
# under tensor parallelism, keep the split-K product, which spreads over more programs.
MIN_FUSED_PROGRAMS = 48


def resolve_attention_impl(impl: str, head_dim: int = 128, dtype: Any = jnp.bfloat16) -> str:
    """The attention implementation for heads of `head_dim` in `dtype`.

    `auto` on GPUs with 16-bit inputs is djax's split-K/V Pallas kernel where its tiles fit
    the head dim, else cuDNN's fused attention; XLA's einsums for fp32 and off GPUs. On an
    H200, in device time, the kernel takes 6.1 µs for a 32-query block against 384 keys
    (cuDNN 15.2, einsums 10.6) and 13.6 µs for a 384-token refresh (cuDNN 19.8, einsums
    36.0); bench/NOTES.md has the sweeps (and the H100's) and the generations.
    """
    check_choice("attention_impl", impl, ATTENTION_IMPLS)
    half = jnp.dtype(dtype).itemsize == 2
    if impl == "cudnn" and not half:
        raise ValueError(
            f"attention_impl='cudnn' takes bf16 or fp16 inputs; got {jnp.dtype(dtype).name}"
        )
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu" or not half:
        return "xla"
    return "split_kv" if flash_attention.fits(head_dim) else "cudnn"


def _pallas_or_xla(
    option: str, impl: str, choices: tuple[str, ...], fits: bool, unfit: str, fast: bool
) -> str:
    """The rule every Pallas-kernel option shares: `impl` checked against `choices`;
    `pallas` where the kernel does not fit raises a ValueError naming `option` and `unfit`
    (what the kernel takes and what it got); `auto` is `pallas` where it fits and `fast`
    (the measured case), else `xla`."""
    check_choice(option, impl, choices)
    if impl == "pallas" and not fits:
        raise ValueError(f"{option}='pallas' takes {unfit}")
    if impl != "auto":
        return impl
    return "pallas" if fast and fits else "xla"


def _gpu_half(dtype: Any) -> bool:
    return jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2


def resolve_mlp_impl(impl: str, rows: int, d_model: int, hidden: int, dtype: Any) -> str:
    """The gate/up path of a SwiGLU MLP over `rows` token rows.

    `auto` on GPUs with 16-bit weights and at most `swiglu.MAX_ROWS` rows (a denoising block
    of one sequence) is djax's Pallas kernel with the activation fused; XLA's matmul and a
    separate activation kernel for refreshes, larger batches, fp32 and off GPUs. On an H200
    the kernel took 48.7 µs per LLaDA-8B layer where XLA took 52.9 (bench/NOTES.md).
    """
    return _pallas_or_xla(
        "mlp_impl",
        impl,
        MLP_IMPLS,
        pallas_tiles.matmul_fits(d_model, hidden),
        f"model and hidden widths that are multiples of 16; got {d_model} -> {hidden}",
        _gpu_half(dtype) and rows <= swiglu.MAX_ROWS,
    )


def resolve_matmul_impl(impl: str, rows: int, k: int, n: int, dtype: Any) -> str:
    """How the q/k/v, attention-output and down products of `rows` token rows run: `auto`
    on GPUs with 16-bit weights and at most `split_k.MAX_ROWS` rows (a denoising block of
    one sequence) is djax's split-K kernel, its partial products summed by the next
    kernel (`split_k`); XLA's GEMMs for refreshes, larger batches, fp32 and off GPUs."""
    return _pallas_or_xla(
        "matmul_impl",
        impl,
        MATMUL_IMPLS,
        pallas_tiles.matmul_fits(k, n),
        f"products whose contraction and output widths are multiples of 16; got {k} -> {n}",
        _gpu_half(dtype) and rows <= split_k.MAX_ROWS,
    )


def resolve_norm_impl(impl: str, dtype: Any) -> str:
    """How a residual add and the RMSNorm after it run where they are not fused into the
    products around them (`fuse_residual_norm`): `auto` is djax's one-kernel Pallas path
    (`residual_norm`) on GPUs with 16-bit activations, else XLA's (two kernels on GPUs);
    `fused` and `tiled` run these sites as `pallas`."""
    check_choice("norm_impl", impl, NORM_IMPLS)
    impl = "pallas" if impl in ("fused", "tiled") else impl
    return _pallas_or_xla("norm_impl", impl, NORM_IMPLS, True, "", _gpu_half(dtype))


def fuse_residual_norm(
    norm_impl: str, matmul_impl: str, rows: int, k: int, n: int, dtype: Any, sharded: bool
) -> bool:
    """Whether the RMSNorm after a `[rows, k] @ [k, n]` product and its residual add runs in
    the next product's kernel (which takes `ScaledRows`), the add either in the product's
    own kernel or in a tiled kernel after it (`residual_norm_form`): under `fused` or
    `tiled`, or `auto` on GPUs with 16-bit weights, where the product takes djax's kernels
    (`matmul_impl` resolves to `pallas`) on at most `split_k.MAX_ROWS` rows (a block of one
    sequence) and is not sharded (under tensor parallelism it is all-reduced first). The
    caller checks that the next product's kernel takes `ScaledRows`."""
    check_choice("norm_impl", norm_impl, NORM_IMPLS)
    wanted = norm_impl in ("fused", "tiled") or (norm_impl == "auto" and _gpu_half(dtype))
    return (
        wanted
        and not sharded
        and rows <= split_k.MAX_ROWS
        and residual_product.fits(k, n)
        and resolve_matmul_impl(matmul_impl, rows, k, n, dtype) == "pallas"
    )


def residual_norm_form(norm_impl: str) -> str:
    """Where the residual add runs when `fuse_residual_norm` moves the norm into the next
    product: `fused`, in the epilogue of the product before, run unsplit
    (`residual_product`); `tiled`, in a kernel of its own after the split-K product, tiled
    over columns (`residual_norm.add_scaled`). `auto` takes `fused` on H100s
    (`_unsplit_products_pay`), `tiled` elsewhere."""
    check_choice("norm_impl", norm_impl, NORM_IMPLS)
    if norm_impl in ("fused", "tiled"):
        return norm_impl
    return "fused" if _unsplit_products_pay() else "tiled"


def _unsplit_products_pay() -> bool:
    """Whether the GPU is one where `residual_product`'s unsplit products beat the split-K
    kernel with its norm kernel: they stream ~3.0 TB/s of kernel time whatever their
    tiling (likely a per-SM ceiling). An H100 reads at ~3.0 TB/s: the output product with
    its norm took 14.95 µs against 17.51, the down product 37.02 against 39.49, and the
    generation gained 1.4-1.6%. An H200 reads at 4.36 TB/s: 13.55-13.8 against 13.95 and
    33.5-34 against 29.58, and the generation lost 3.8% (bench/NOTES.md)."""
    return "H100" in jax.devices()[0].device_kind


def resolve_rope_impl(impl: str, head_dim: int, rotary_dim: int, dtype: Any) -> str:
    """How the q/k norm and clip, RoPE and the K/V buffer writes run: `auto` is djax's
    one-kernel Pallas path (`rope_write`) on GPUs with 16-bit activations where its tiles
    fit the heads, else XLA's (a RoPE kernel and one buffer write per K and V on GPUs)."""
    return _pallas_or_xla(
        "rope_impl",
        impl,
        ROPE_IMPLS,
        rope_write.fits(head_dim, rotary_dim),
        f"heads whose rotary halves ({rotary_dim // 2}) and unrotated rest "
        f"({head_dim - rotary_dim}) are powers of two or zero; got head_dim={head_dim}, "
        f"rotary_dim={rotary_dim}",
        _gpu_half(dtype),
    )


def fuse_qkv_rope(
    matmul_impl: str, rope_impl: str, x_shape: tuple, w_shape: tuple, rotary_dim: int, dtype: Any
) -> bool:
    """Whether a layer's q/k/v product (x [b, t, model] @ w [model, kv_heads, group + 2,
    head_dim]) runs inside its RoPE/K/V-write kernel (`rope_write.project_rope_and_write`):
    where both would take djax's kernels (`matmul_impl` resolves to the split-K kernel;
    `rope_impl`, already resolved, is `pallas`), the fused kernel's tiles fit, the rows are
    a block's (at most `split_k.MAX_ROWS`, whatever `matmul_impl` says: the kernel keeps
    every sequence's rows in registers) and there are at least `MIN_FUSED_PROGRAMS` heads
    (one program each; split-K spreads the product over more). It saves a launch and the
    product's round trip through memory: on an H200 a LLaDA-8B block layer's q/k/v product
    and RoPE kernel took 26.5 + 3.0 µs, the fused kernel 27.7 (bench/NOTES.md)."""
    (b, t, model), (kv_heads, slots, head_dim) = x_shape, w_shape[1:]
    return (
        rope_impl == "pallas"
        and resolve_matmul_impl(matmul_impl, b * t, model, kv_heads * slots * head_dim, dtype)
        == "pallas"
        and b * t <= split_k.MAX_ROWS
        and kv_heads * slots >= MIN_FUSED_PROGRAMS
        and rope_write.projection_fits(t, model, head_dim, rotary_dim)
    )
