"""The kernel choice, made once per program: `resolve` turns `KernelOptions` (what the
user asked, `auto` by default), the device (`Device`: compute capability and shared memory)
and the shapes of a generation's forwards into `KernelChoice`, the concrete path of every
part of a block forward and of a refresh. The layers receive it and take what it says.

djax's kernels (`djax.kernels`) are Pallas Mosaic GPU kernels for Hopper GPUs (TMA copies,
WGMMA). Rules of `auto`:
- djax's kernels run only on the GPUs they were built and tuned for (`Device.runs_kernels`:
  compute capability 9.x, whose WGMMA instructions they are written with, and >= 227 KiB of
  shared memory per block), in bf16 or fp16; XLA everywhere else. A kernel that still fails
  to compile there falls back to XLA (the engine compiles again with
  `KernelOptions.auto_as_xla`).
- The products (q/k/v, attention output and down: the split-K kernel, `split_k_mosaic`;
  the SwiGLU gate/up path, `swiglu_mosaic`) take 16-bit weights whose widths are multiples
  of 64, in forwards of at most `KERNEL_MAX_ROWS` token rows (a denoising block of one
  sequence): each CTA holds one 64-row tile, so more rows would read every weight once per
  row tile; longer forwards (refreshes) take XLA's GEMMs.
- The q/k/v product runs inside the RoPE kernel (`qkv="rope"`,
  `rope_write_mosaic.project_rope_and_write`, or `project_rope_and_write_fp8` for an fp8
  weight where the fp8 x fp8 kernels run) where both would run and the heads make at least
  `MIN_FUSED_PROGRAMS` CTAs per row tile; elsewhere the RoPE kernel finishes the product
  made apart (`rope_write_mosaic.rope_and_write`, fp8 products included). It takes
  windows of a multiple of 8 positions up to 64 (`rope_write_mosaic.fits`: block windows,
  and whole sequences that short, but for block diffusion, whose whole-sequence choice
  runs on windows of other lengths); longer windows run XLA's RoPE.
- The norm after attention moves into the products around it (`AUTO_NORM`: `tiled`, the
  split-K product and then a column-tiled add, `residual_norm_mosaic.add_scaled`, whose
  norm the SwiGLU kernel applies; `fused`, the add in the output product's epilogue,
  `residual_product_mosaic`) where both products run djax's kernels, on one device (under a
  mesh the products are summed before any norm). The other norms run the per-row kernel
  (`norm="mosaic"`, `residual_norm_mosaic.add_rms_norm`) where the model width fits it.
- With fp8 weights (`weights="fp8"`, `djax.models.fp8`) the fp8 x fp8 kernels take the
  block forwards' products and the experts where djax's kernels run (below); elsewhere the
  dense products run in XLA (the attention, RoPE and norm kernels, which read no weights,
  are chosen as above), and the MoE experts in their tiles (`moe="mosaic"`, which convert
  e4m3 tiles in the kernel) as below. XLA's fp8 path
  (`Kernels.fp8`): `scaled` (fp8 x fp8) for every forward on GPUs with fp8 tensor cores
  (`FP8_MIN_CAPABILITY`), `dequant` elsewhere. One path for the whole program: a program
  whose refreshes run `scaled` and block forwards `dequant` was measured slower than either
  alone (`bench/NOTES.md`).
- cuDNN's attention only runs refreshes: at block shapes its dense mask makes it slower
  than XLA's einsums.
- Block forwards under sparse attention take the attention path of dense ones: with
  `split_kv`, one kernel call over the compact buffers of the kept rows and the window's
  (`sparse_attention.attend_kept`).
- The MoE experts: the expert tiles (`moe="mosaic"`, `expert_tiles_mosaic`; 16-bit or fp8
  weights) where the model and local expert widths are multiples of 64, in every forward
  (their row tiles follow the experts: no row limit); in forwards of at most
  `tma_ring.ROW_TILE` token rows every token runs through each expert any of them goes to
  (`expert_rows="tokens"`: one row tile an expert, which costs what its pairs' rows cost,
  with no layout of the pairs around the kernels), in longer ones the pairs laid out by
  expert (`pairs`); else XLA's path, which sorts
  token-expert pairs into groups (`ragged_dot`) up to `GROUPED_EXPERTS_MAX_TOKENS` tokens
  per forward and runs every expert on every token above it (XLA lowers `ragged_dot` to a
  dense product over every group).

An option other than `auto` is taken as given on any device (off GPUs its kernel runs in
Mosaic GPU's interpreter) wherever its kernel fits: a ValueError names the misfit (widths,
heads, dtype, fp8 weights) otherwise. The forms `auto` limits by rows and windows keep those
limits (the products, RoPE and the norms moved into products run only in block forwards).
The fp8 x fp8 kernels (fp8 weights, `djax.kernels.fp8_matmul_mosaic`) are taken under
`fp8_impl="mosaic"` on any device, and under `auto` where djax's kernels run, both with
every dense product's contraction (a device's share under a mesh) a multiple of 128 and
its output a multiple of 64 (`mosaic` raises a ValueError otherwise; `auto` takes XLA's
`scaled` products): block forwards of at most
`KERNEL_MAX_ROWS` token rows run the q/k/v, attention-output and down products and the
SwiGLU gate/up path in the fp8 x fp8 Mosaic GPU kernel (`fp8_mosaic`; the q/k/v product
inside the RoPE kernel where the rule above puts it), their partials handed on as the
split-K kernel's are; refreshes and longer forwards run XLA's `scaled` products. There the
per-row norms (`norm="mosaic"`) before the q/k/v product, a dense MLP's gate/up path and a
MoE layer's fp8 experts also quantise their rows for them (`norm_into_fp8`:
`handoff.QuantizedRows`), and the kernels before the attention-output and down products
hand them e4m3 rows with a scale per row and 128-column slice (`attention_into_fp8` for
heads of 128 features; the gate/up kernel's activation), so no XLA quantisation runs
between them. A MoE model's experts
run by fp8 x fp8 WGMMA in their tiles (`moe="fp8_mosaic"`,
`expert_tiles_mosaic.expert_mlp_fp8`) in every forward, under `moe_impl` `auto` or
`mosaic` (`xla` is refused, and keeps `auto` from them: XLA's grouped product reads no
K-major experts), their model and local ffn widths multiples of 128. The model then holds
those weights K-major (`holds_k_major`, `Model.k_major`, `djax.models.fp8`), decided
where it is loaded. Params held K-major under options that do not take the kernels (the
fallback's) run XLA's products, which read that layout, and XLA's experts as `dense`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from djax.config import ModelConfig
from djax.kernel_options import KernelOptions
from djax.kernels import (
    flash_attention_mosaic,
    fp8_matmul_mosaic,
    residual_norm_mosaic,
    residual_product_mosaic,
    rope_write_mosaic,
    tma_ring,
)
from djax.models import fp8

# The most token rows djax's product kernels take (a block of one sequence).
KERNEL_MAX_ROWS = 32
# What a GPU needs for `auto` to take djax's kernels: the Hopper generation (compute
# capability 9.x: WGMMA) and the shared memory per block (opt-in) their tiles were built for.
KERNEL_CAPABILITY_MAJOR = 9
KERNEL_MIN_SHARED_MEMORY = 227 * 1024
# The fewest CTAs per row tile (kv heads x (group + 2), one each) the q/k/v product runs
# inside the RoPE kernel with; fewer (as under tensor parallelism) keep the split-K product,
# which spreads over more CTAs.
MIN_FUSED_PROGRAMS = 48
GROUPED_EXPERTS_MAX_TOKENS = 64
# GPUs with fp8 tensor cores (Ada, Hopper and later).
FP8_MIN_CAPABILITY = (8, 9)
# What `norm_impl="auto"` takes where djax's kernels run (a `norm_impl` value other than
# `auto`): the norm after attention tiled into the products around it.
AUTO_NORM = "tiled"


@dataclasses.dataclass(frozen=True)
class Device:
    """What the choice reads of a device: its platform (`"gpu"`, `"cpu"`, `"tpu"`), and on
    GPUs the compute capability `(major, minor)` and the shared memory a block may use
    (bytes, opt-in)."""

    platform: str
    compute_capability: tuple[int, int] | None = None
    shared_memory: int = 0

    @property
    def runs_kernels(self) -> bool:
        """Whether `auto` takes djax's kernels here: GPUs of the Hopper generation (compute
        capability 9.x, whose WGMMA instructions the Mosaic GPU kernels are written with)
        with the shared memory per block their tiles take."""
        return (
            self.platform == "gpu"
            and self.compute_capability is not None
            and self.compute_capability[0] == KERNEL_CAPABILITY_MAJOR
            and self.shared_memory >= KERNEL_MIN_SHARED_MEMORY
        )

    def __str__(self) -> str:
        if self.compute_capability is None:
            return self.platform
        major, minor = self.compute_capability
        return f"{self.platform} {major}.{minor}, {self.shared_memory // 1024} KiB shared memory"


def describe(device: Any) -> Device:
    """A `jax.Device` as `Device` (a GPU's attributes as its runtime reports them)."""
    if device.platform != "gpu":
        return Device(device.platform)
    capability = str(getattr(device, "compute_capability", "") or "")
    major, _, minor = capability.partition(".")
    return Device(
        "gpu",
        (int(major), int(minor or 0)) if major.isdigit() else None,
        int(getattr(device, "shared_memory_per_block_optin", 0) or 0),
    )


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The path of each part of a decoder layer at one number of token rows.

    attention: `xla`, `split_kv` (`flash_attention_mosaic`) or `cudnn`. qkv: the q/k/v
    product, `xla`, `mosaic` (split-K, `split_k_mosaic`), `fp8_mosaic` (fp8 weights:
    `fp8_matmul_mosaic`) or `rope` (inside the RoPE kernel; by fp8 x fp8 WGMMA for an
    fp8 weight). rope: the q/k norm, RoPE and
    K/V writes, `xla` or `mosaic` (`rope_write_mosaic`: in the q/k/v product's epilogue where
    qkv is `rope`, else on the product made apart).
    out, mlp, down: the attention-output product, the SwiGLU gate/up path and the down
    product, `xla`, `mosaic` (`split_k_mosaic`, `swiglu_mosaic`) or `fp8_mosaic`.
    norm: a residual add and RMSNorm on their own, `xla` or `mosaic`
    (`residual_norm_mosaic.add_rms_norm`). norm_into_mlp: where the norm before the
    feed-forward (a dense MLP) runs inside the products around it, `fused` (the add in the
    output product's epilogue), `tiled` (in a kernel after it) or `no`. norm_into_fp8: the
    per-row norms (`norm="mosaic"`) before the q/k/v product and a dense MLP's gate/up
    path, both `fp8_mosaic`, hand them rows already quantised to e4m3 with a scale per row
    (`residual_norm_mosaic.add_rms_norm(..., into_fp8=True)`, `handoff.QuantizedRows`), as
    the norm before a MoE layer does where its experts are `fp8_mosaic` (the rows kept
    beside them for the router, `keep_rows=True`). Where mlp and down are both `fp8_mosaic`,
    the gate/up kernel hands the down product its activation as e4m3 with a scale per row
    and 128-column slice (`fp8_matmul_mosaic.swiglu_matmul(..., out_fp8=True)`).
    attention_into_fp8: the attention (`split_kv`, head_dim 128) hands an `fp8_mosaic`
    output product its rows as e4m3 with a scale per row and head
    (`split_kv_attention(..., out_fp8=True)`; XLA's attention quantises them the same way).
    moe: the routed
    experts, `dense`, `grouped`, `mosaic` (`expert_tiles_mosaic`, 16-bit weights or fp8
    ones converted in the kernel) or `fp8_mosaic` (K-major fp8 weights by fp8 x fp8 WGMMA,
    `expert_tiles_mosaic.expert_mlp_fp8`); `resolve` says `none` for a model without
    experts. expert_rows: the rows the expert tiles (`mosaic`, `fp8_mosaic`) run, `pairs`
    (the token-expert pairs laid out by expert, `llada_moe.experts_grouped`) or `tokens`
    (every token through each expert any token goes to, `llada_moe.experts_by_token`).
    fp8: how XLA's products take fp8 weights, `dequant` or `scaled` (`djax.models.fp8`),
    `no` for weights in the model's dtype; the parts above that say `fp8_mosaic` or
    `mosaic` (moe), take them in Mosaic GPU instead."""

    attention: str = "xla"
    qkv: str = "xla"
    rope: str = "xla"
    out: str = "xla"
    mlp: str = "xla"
    down: str = "xla"
    norm: str = "xla"
    norm_into_mlp: str = "no"
    norm_into_fp8: bool = False
    attention_into_fp8: bool = False
    moe: str = "dense"
    expert_rows: str = "pairs"
    fp8: str = "no"


XLA_KERNELS = Kernels()  # XLA's paths everywhere


@dataclasses.dataclass(frozen=True)
class ForwardKernels:
    """One forward's choice: `layers` for every layer's rows, `last` for the last layer's
    rows from its attention output on, where the forward keeps only a block of them (a
    refresh; its attention's own parts are `layers`'); equal to `layers` otherwise."""

    layers: Kernels = Kernels()
    last: Kernels = Kernels()


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The resolved choice of a program: its block forwards' and its refreshes' (a
    whole-sequence forward takes `refresh`), for params of the weight format `weights`
    (`djax.models.fp8.WEIGHTS`), which the modules built with it hold; `k_major`: the
    fp8 values (dense products' and experts') are held K-major (`holds_k_major`: where
    the fp8 x fp8 kernels run them).
    The default is XLA's paths everywhere, weights in the model's dtype."""

    block: ForwardKernels = ForwardKernels()
    refresh: ForwardKernels = ForwardKernels()
    weights: str = "dtype"
    k_major: bool = False

    @classmethod
    def xla(cls, weights: str = "dtype") -> KernelChoice:
        """XLA's paths everywhere for params of the format `weights` (fp8 ones through
        `dequant`)."""
        kernels = Kernels(fp8="dequant" if weights == "fp8" else "no")
        return cls(ForwardKernels(kernels, kernels), ForwardKernels(kernels, kernels), weights)

    @property
    def xla_fp8(self) -> str:
        """XLA's path for the fp8 products the program leaves to it (`Kernels.fp8`: one for
        the whole program; "no" without fp8 weights)."""
        return self.refresh.layers.fp8

    def explain(self) -> str:
        """The choice as one line per forward (`part=path, ...`), and a line for the last
        layer's kept rows where they differ; with fp8 weights a last line names them and
        their layout (K-major where the fp8 x fp8 kernels run them)."""
        lines = []
        for name, forward in (("block forward", self.block), ("refresh", self.refresh)):
            lines.append(f"{name}: {_listed(forward.layers)}")
            if forward.last != forward.layers:
                lines.append(f"  last layer, kept rows: {_listed(forward.last, forward.layers)}")
        if self.weights != "dtype":
            layout = "values K-major" if self.k_major else "as stored"
            lines.append(f"weights: {self.weights}, {layout}")
        return "\n".join(lines)


def _listed(kernels: Kernels, base: Kernels | None = None) -> str:
    """`kernels`' fields as `name=value, ...`: all of them, or those that differ from
    `base`'s."""
    return ", ".join(
        f"{f.name}={getattr(kernels, f.name)}"
        for f in dataclasses.fields(kernels)
        if base is None or getattr(kernels, f.name) != getattr(base, f.name)
    )


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The forwards a program runs: `batch` sequences (on one device), block forwards over
    windows of `window` positions, refreshes over `seq` positions, each keeping `kept`
    positions (the block) at its last layer."""

    batch: int
    window: int
    seq: int
    kept: int

    @classmethod
    def whole_sequence(cls, batch: int, seq: int) -> Shapes:
        """A forward over every position that keeps them all (`forward_logits`)."""
        return cls(batch, seq, seq, seq)


@dataclasses.dataclass(frozen=True)
class _Widths:
    """The local widths of a model's products on one device."""

    config: ModelConfig
    shards: int
    split_experts: bool

    @property
    def kv_heads(self) -> int:
        return self.config.n_kv_heads // self.shards

    @property
    def group(self) -> int:
        return self.config.n_heads // self.config.n_kv_heads

    @property
    def qkv(self) -> tuple[int, int]:
        cfg = self.config
        return cfg.d_model, self.kv_heads * (self.group + 2) * cfg.head_dim

    @property
    def out(self) -> tuple[int, int]:
        return self.kv_heads * self.group * self.config.head_dim, self.config.d_model

    @property
    def mlp_hidden(self) -> list[int]:
        """The hidden widths of the model's dense SwiGLU MLPs (shared experts included)."""
        cfg = self.config
        hidden = []
        if not cfg.is_moe or not all(cfg.moe_layers):
            hidden.append(cfg.mlp_hidden // self.shards)
        if cfg.is_moe and cfg.shared_expert_hidden:
            hidden.append(cfg.shared_expert_hidden // self.shards)
        return hidden

    @property
    def expert_hidden(self) -> int:
        f = self.config.expert_hidden
        return f if self.split_experts else f // self.shards


def resolve(
    options: KernelOptions,
    device: Device,
    config: ModelConfig,
    dtype: Any,
    shapes: Shapes,
    shards: int = 1,
    split_experts: bool = False,
    sharded: bool = False,
    weights: str = "dtype",
    k_major: bool | None = None,
) -> KernelChoice:
    """The concrete choice for a program of `shapes` running `config` in `dtype` with
    weights of the format `weights` on `device`, its weights split `shards` ways (experts
    by expert where `split_experts`), `sharded` when it runs under a mesh (its products are
    then summed over the model axis before any norm). `k_major`: whether the params hold
    their fp8 values K-major (`Model.k_major`); None: as these options place them on this
    device (`holds_k_major`). Raises a ValueError where an option other than `auto` names a
    kernel that does not take these shapes, dtype, weights or layout."""
    widths = _Widths(config, shards, split_experts)
    rule = _Rule(options, device, widths, dtype, sharded, fp8.check_weights(weights), k_major)
    return KernelChoice(
        block=rule.forward(shapes.batch, shapes.window, shapes.kept, refresh=False),
        refresh=rule.forward(shapes.batch, shapes.seq, shapes.kept, refresh=True),
        weights=weights,
        k_major=rule.k_major,
    )


def holds_k_major(
    options: KernelOptions,
    device: Device,
    config: ModelConfig,
    dtype: Any,
    weights: str = "dtype",
    shards: int = 1,
    split_experts: bool = False,
) -> bool:
    """Whether a model of `config` in `dtype` with weights of the format `weights`, split
    as `resolve`'s `shards` and `split_experts` say, holds its fp8 values (the dense
    products' and the experts') K-major on `device` under `options`: where the fp8 x fp8
    kernels run its products (`fp8_impl="mosaic"`, and `auto` where djax's kernels run and
    take every product), whose layout this is. Raises a ValueError as `resolve` does for
    `fp8_impl="mosaic"` where they do not fit."""
    widths = _Widths(config, shards, split_experts)
    rule = _Rule(options, device, widths, dtype, shards > 1, fp8.check_weights(weights), None)
    return rule.k_major


class _Rule:
    """The rules of `resolve` for one model, dtype and device."""

    def __init__(
        self,
        options: KernelOptions,
        device: Device,
        widths: _Widths,
        dtype: Any,
        sharded: bool,
        weights: str,
        k_major: bool | None,
    ):
        self.options, self.widths, self.sharded = options, widths, sharded
        self.half = jnp.dtype(dtype).itemsize == 2
        self.dtype_name = jnp.dtype(dtype).name
        self.gpu = device.platform == "gpu"
        self.kernels_run = device.runs_kernels and self.half
        self.fp8 = weights == "fp8"
        # djax's product kernels take 16-bit weights: not fp8 ones.
        self.products_run = self.kernels_run and not self.fp8
        self.fp8_tensor_cores = (
            self.gpu
            and device.compute_capability is not None
            and device.compute_capability >= FP8_MIN_CAPABILITY
        )
        self.norm_impl = options.norm_impl
        if self.norm_impl == "auto":
            self.norm_impl = AUTO_NORM if self.kernels_run else "xla"
        if options.attention_impl in ("cudnn", "split_kv") and not self.half:
            raise ValueError(
                f"attention_impl={options.attention_impl!r} takes bf16 or fp16 inputs; got "
                f"{self.dtype_name}"
            )
        # A model without experts ignores `moe_impl`: it is checked only where it applies.
        moe = ("moe_impl",) if widths.config.is_moe else ()
        if self.fp8:
            for name in ("matmul_impl", "mlp_impl"):
                if getattr(options, name) == "mosaic":
                    raise ValueError(
                        f"{name}='mosaic' takes 16-bit weights; with weights='fp8' the "
                        "products run in XLA: give 'auto' or 'xla'"
                    )
        if self.fp8 and options.fp8_impl == "mosaic":
            misfit = self._fp8_mosaic_misfit()
            if misfit:
                raise ValueError(f"fp8_impl='mosaic' {misfit}")
        # The fp8 x fp8 kernels take the block forwards' products (and every forward's
        # experts): asked for, or under `auto` where djax's kernels run and take them all.
        wanted = self.fp8 and (
            options.fp8_impl == "mosaic"
            or (options.fp8_impl == "auto" and self.kernels_run and not self._fp8_mosaic_misfit())
        )
        # Their values are K-major (`Model.k_major`); params held so under other options (a
        # fallback's) run XLA's products, which read either layout.
        self.k_major = wanted if k_major is None else self.fp8 and k_major
        if self.fp8 and options.fp8_impl == "mosaic" and not self.k_major:
            raise ValueError(
                "fp8_impl='mosaic' reads K-major fp8 values; these params hold theirs as "
                "stored (djax.load and Model.with_options place them for the options given)"
            )
        self.fp8_kernels = wanted and self.k_major
        for name in ("matmul_impl", "mlp_impl", "rope_impl", "norm_impl", *moe):
            value = getattr(options, name)
            if value in ("mosaic", "fused", "tiled") and not tma_ring.takes_dtype(dtype):
                raise ValueError(
                    f"{name}={value!r} takes bfloat16 or float16 as the model dtype; got "
                    f"{self.dtype_name}"
                )

    def forward(self, batch: int, positions: int, kept: int, refresh: bool) -> ForwardKernels:
        """The choice for a forward of `batch` windows of `positions` positions keeping
        `kept` of them at its last layer (whose attention runs every window row)."""
        layers = self.kernels(batch * positions, positions, refresh)
        last = self.kernels(batch * kept, positions, refresh)
        window_parts = ("attention", "qkv", "rope")
        last = dataclasses.replace(last, **{name: getattr(layers, name) for name in window_parts})
        return ForwardKernels(layers, last)

    def kernels(self, rows: int, positions: int, refresh: bool) -> Kernels:
        """The choice for `rows` token rows of windows of `positions` positions."""
        w, cfg = self.widths, self.widths.config
        few = rows <= KERNEL_MAX_ROWS
        # Block diffusion runs its whole-sequence choice on windows of other lengths (a
        # block, two, the prompt), which the RoPE kernel may not take: XLA's RoPE there.
        rope = "xla" if refresh and cfg.block_diffusion else self._rope(positions)
        qkv = self._product(w.qkv, few)
        out = self._product(w.out, few)
        fp8_mosaic = self.fp8_kernels and few and not refresh
        if not w.mlp_hidden:  # no dense MLP (every layer's feed-forward is experts)
            mlp = "xla"
        elif fp8_mosaic:
            mlp = "fp8_mosaic"
        else:
            mlp = self._mosaic_or_xla(
                "mlp_impl",
                all(tma_ring.fits(cfg.d_model, h) for h in w.mlp_hidden),
                f"model and hidden widths {cfg.d_model} -> {w.mlp_hidden}",
                few,
            )
        downs = [self._product((h, cfg.d_model), few) for h in w.mlp_hidden]
        down = downs[0] if downs and all(d == downs[0] for d in downs) else "xla"
        if fp8_mosaic:
            qkv = out = "fp8_mosaic"
            down = "fp8_mosaic" if w.mlp_hidden else "xla"
        if (
            rope == "mosaic"
            and qkv in ("mosaic", "fp8_mosaic")
            and w.kv_heads * (w.group + 2) >= MIN_FUSED_PROGRAMS
        ):
            qkv = "rope"  # an fp8 weight's product by fp8 x fp8 WGMMA there
        into_mlp = self._norm_fusion(few)
        if not (
            out == "mosaic"
            and mlp == "mosaic"
            and not cfg.attn_out_bias  # the output product's epilogue adds no bias
            and (
                residual_product_mosaic.fits(*w.out)
                if into_mlp == "fused"
                else residual_norm_mosaic.fits(cfg.d_model)
            )
        ):
            into_mlp = "no"
        norm = self._norm()
        moe = self._moe(rows) if cfg.is_moe else "none"
        # The expert tiles hold up to ROW_TILE rows: forwards of as many tokens run each
        # expert's tile on all of them (the same products, no layout of the pairs).
        tiled = moe in ("mosaic", "fp8_mosaic") and rows <= tma_ring.ROW_TILE
        expert_rows = "tokens" if tiled else "pairs"
        attention = self._attention(refresh)
        return Kernels(
            attention=attention,
            qkv=qkv,
            rope=rope,
            out=out,
            mlp=mlp,
            down=down,
            norm=norm,
            norm_into_mlp=into_mlp,
            # the products after the per-row norms (q/k/v, a dense MLP's gate/up) are fp8
            norm_into_fp8=fp8_mosaic and norm == "mosaic",
            # a head is one 128-column slice of the output product's contraction
            attention_into_fp8=(
                out == "fp8_mosaic"
                and attention == "split_kv"
                and cfg.head_dim == fp8_matmul_mosaic.SLICE
            ),
            moe=moe,
            expert_rows=expert_rows,
            fp8=self._fp8(),
        )

    def _attention(self, refresh: bool) -> str:
        impl, cfg = self.options.attention_impl, self.widths.config
        if impl == "cudnn":
            return "cudnn" if refresh else "xla"
        fits = flash_attention_mosaic.fits(cfg.head_dim)
        if impl == "split_kv" and not fits:
            raise ValueError(
                f"attention_impl='split_kv' takes a head dim that is a multiple of 64; "
                f"got {cfg.head_dim}"
            )
        if impl != "auto":
            return impl
        if self.kernels_run and fits:
            return "split_kv"
        return "cudnn" if refresh and self.gpu and self.half else "xla"

    def _product(self, widths: tuple[int, int], few: bool) -> str:
        k, n = widths
        return self._mosaic_or_xla("matmul_impl", tma_ring.fits(k, n), f"a product {k} -> {n}", few)

    def _mosaic_or_xla(self, option: str, fits: bool, unfit: str, few: bool) -> str:
        """The rule of the product options (`matmul_impl`, `mlp_impl`): `mosaic` where the
        widths are not multiples of 64 (`tma_ring.fits`) raises a ValueError naming `option`
        and `unfit` (what it got); `mosaic`, and `auto` where the product kernels run and
        the widths fit, take the kernel in forwards of at most `KERNEL_MAX_ROWS` token rows
        (`few`), XLA's product in longer ones."""
        impl = getattr(self.options, option)
        if impl == "mosaic" and not fits:
            raise ValueError(
                f"{option}='mosaic' takes widths that are multiples of 64; got {unfit}"
            )
        wanted = impl == "mosaic" or (impl == "auto" and self.products_run and fits)
        return "mosaic" if wanted and few else "xla"

    def _rope(self, positions: int) -> str:
        """`mosaic` for windows of `positions` rows the RoPE kernel takes
        (`rope_write_mosaic.fits`: block windows) where asked for or, under `auto`, where
        djax's kernels run; `xla` otherwise. `mosaic` raises a ValueError where the model's
        heads or width do not fit."""
        impl, cfg = self.options.rope_impl, self.widths.config
        shortest = tma_ring.ROW_ALIGN  # a window it takes: the heads and the width decide
        heads_fit = rope_write_mosaic.fits(shortest, cfg.d_model, cfg.head_dim, cfg.rope_dim)
        if impl == "mosaic" and not heads_fit:
            raise ValueError(
                f"rope_impl='mosaic' takes head_dim in {rope_write_mosaic.HEAD_DIMS} with "
                "rotary halves and rest multiples of 8, and a model width that is a multiple "
                f"of 64; got head_dim={cfg.head_dim}, rotary_dim={cfg.rope_dim}, "
                f"d_model={cfg.d_model}"
            )
        wanted = impl == "mosaic" or (impl == "auto" and self.kernels_run and heads_fit)
        fits = rope_write_mosaic.fits(positions, cfg.d_model, cfg.head_dim, cfg.rope_dim)
        return "mosaic" if wanted and fits else "xla"

    def _norm(self) -> str:
        """A residual norm left on its own: `xla` under `norm_impl="xla"`, else the per-row
        kernel (`mosaic`) where the model width fits it (`residual_norm_mosaic.row_fits`);
        a ValueError where `mosaic` was asked for and does not fit, `xla` for the other
        forms."""
        if self.norm_impl == "xla":
            return "xla"
        d = self.widths.config.d_model
        if residual_norm_mosaic.row_fits(d):
            return "mosaic"
        if self.options.norm_impl == "mosaic":
            raise ValueError(
                f"norm_impl='mosaic' takes a model width that is a multiple of 512 up to "
                f"65536; got {d}"
            )
        return "xla"

    def _fp8(self) -> str:
        """XLA's fp8 path; where the fp8 kernels run, `scaled` for the products they leave
        to XLA."""
        if not self.fp8:
            return "no"
        impl = self.options.fp8_impl
        if self.fp8_kernels:
            return "scaled"
        if impl != "auto":
            return impl
        return "scaled" if self.fp8_tensor_cores else "dequant"

    def _fp8_mosaic_misfit(self) -> str:
        """What keeps the fp8 x fp8 kernels from this model (completing "fp8_impl='mosaic'
        ..."), or "" where they take every dense product (a device's share of it under a
        mesh) and, for a MoE model, the experts (`fp8_matmul_mosaic.fits`: the model and
        local expert ffn widths multiples of 128) under a `moe_impl` that reads K-major
        experts (`auto` or `mosaic`)."""
        w, cfg = self.widths, self.widths.config
        products = {"q/k/v": w.qkv, "attention output": w.out}
        for h in w.mlp_hidden:
            products[f"gate/up ({h})"] = (cfg.d_model, h)
            products[f"down ({h})"] = (h, cfg.d_model)
        if cfg.is_moe:
            if self.options.moe_impl == "xla":
                return (
                    "holds the experts K-major, which moe_impl='xla' does not read; give "
                    "moe_impl 'auto' or 'mosaic'"
                )
            k_tile = fp8_matmul_mosaic.K_TILE
            if cfg.d_model % k_tile or w.expert_hidden % k_tile:
                return (
                    f"takes expert widths that are multiples of {k_tile} (both contract an "
                    f"expert product); got model {cfg.d_model}, local expert ffn "
                    f"{w.expert_hidden}"
                )
        for name, (k, n) in products.items():
            if not fp8_matmul_mosaic.fits(k, n):
                return (
                    f"takes products whose contraction is a multiple of "
                    f"{fp8_matmul_mosaic.K_TILE} and output a multiple of {tma_ring.TILE}; "
                    f"got the {name} product {k} -> {n}"
                )
        return ""

    def _norm_fusion(self, few: bool) -> str:
        """Where the norm before the feed-forward moves into the products around it, before
        the products are checked: `fused` or `tiled` as `norm_impl` (or `AUTO_NORM`) says,
        in forwards of at most `KERNEL_MAX_ROWS` token rows on one device; `no` otherwise."""
        if self.norm_impl not in ("fused", "tiled") or self.sharded or not few:
            return "no"
        return self.norm_impl

    def _moe(self, tokens: int) -> str:
        cfg, w = self.widths.config, self.widths
        impl = self.options.moe_impl
        if self.fp8_kernels:  # `_fp8_mosaic_misfit` took the experts' widths
            return "fp8_mosaic"
        if self.k_major:  # XLA's product of every expert reads K-major values; ragged_dot not
            return "dense"
        fits = tma_ring.fits(cfg.d_model, w.expert_hidden)
        if impl == "mosaic" and not fits:
            raise ValueError(
                f"moe_impl='mosaic' takes widths that are multiples of 64; got model "
                f"{cfg.d_model}, local expert ffn {w.expert_hidden}"
            )
        if impl == "mosaic" or (impl == "auto" and self.kernels_run and fits):
            return "mosaic"
        return "grouped" if tokens <= GROUPED_EXPERTS_MAX_TOKENS else "dense"
