"""The kernel choice, made once per program: `resolve` turns `KernelOptions` (what the
user asked, `auto` by default), the device (`Device`: compute capability and shared memory)
and the shapes of a generation's forwards into `KernelChoice`, the concrete path of every
part of a block forward and of a refresh. The layers receive it and take what it says.

Rules of `auto`:
- djax's kernels run only on GPUs they were built and tuned for (`Device.runs_kernels`:
  compute capability >= 9.0 and >= 227 KiB of shared memory per block), in bf16 or fp16;
  XLA everywhere else. A kernel that still fails to compile there falls back to XLA (the
  engine compiles again with `KernelOptions.auto_as_xla`).
- With fp8 weights (`weights="fp8"`, `djax.models.fp8`) the dense products run in XLA
  (djax's Triton product kernels take 16-bit weights; the attention, RoPE and norm kernels,
  which read no weights, are chosen as above), and the MoE experts in their Mosaic GPU
  tiles (`moe="mosaic"`, which convert e4m3 tiles in the kernel) on Hopper kernel GPUs
  (`Device.runs_wgmma`) where the widths are multiples of 64, in XLA elsewhere. XLA's fp8
  path (`Kernels.fp8`): `scaled` (fp8 x fp8) for every forward on GPUs with fp8 tensor cores
  (`FP8_MIN_CAPABILITY`), `dequant` elsewhere. One path for the whole program: a program
  whose refreshes run `scaled` and block forwards `dequant` was measured slower than either
  alone (`bench/NOTES.md`).
- The products, the SwiGLU kernel and the norm fused into the next product take at most
  `KERNEL_MAX_ROWS` token rows (a denoising block of one sequence), the rows their tiles
  were built for; more rows take XLA's GEMMs.
- cuDNN's attention only runs refreshes: at block shapes its dense mask makes it slower
  than XLA's einsums.
- Block forwards under sparse attention (`Shapes.sparse`) attend in XLA's einsums whatever
  `attention_impl` says (`sparse_attention.attend_kept`: the split-K/V kernel takes one
  contiguous key range, not the compact rows beside the window's).
- The MoE experts' XLA path sorts token-expert pairs into groups (`ragged_dot`) up to
  `GROUPED_EXPERTS_MAX_TOKENS` tokens per forward and runs every expert on every token
  above it (XLA lowers `ragged_dot` to a dense product over every group).

An option other than `auto` is taken as given wherever its kernel fits (a ValueError naming
the misfit otherwise), except the fused forms, which need their rows and products as above.
`mosaic` (`matmul_impl`, `mlp_impl`: the Pallas Mosaic GPU ports of the split-K and SwiGLU
kernels, `djax.kernels.split_k_mosaic` / `swiglu_mosaic`, for Hopper GPUs) is taken only when
asked for, with 16-bit weights and widths that are multiples of 64, in forwards of at most
`KERNEL_MAX_ROWS` token rows (block forwards, as `auto` takes the Triton kernels): each CTA
holds one 64-row tile, so more rows would read every weight once per row tile; longer
forwards run XLA's products. The Mosaic GPU
kernels take the norm moved into the products before the feed-forward as the Triton ones
do (`fused`: `residual_product_mosaic`; `tiled`: the split-K product, then the tiled add,
`residual_norm_mosaic`), and the norms left on their own run the norm kernel's Mosaic GPU
port (`norm="mosaic"`) where `norm_impl` would take the Triton one;
the Triton q/k/v product inside the RoPE kernel is not taken with them, so under `mosaic`
the q/k/v product keeps its RoPE kernel apart and the norm before attention is not moved.
`rope_impl="mosaic"` (`djax.kernels.rope_write_mosaic`, Hopper GPUs) is also taken only when
asked for, with 16-bit weights, heads of 64 or 128 features and a model width that is a
multiple of 64: it runs the q/k/v product with the RoPE kernel in its epilogue (`qkv="rope"`)
in forwards of at most `KERNEL_MAX_ROWS` token rows whose windows it takes
(`rope_write_mosaic.fits`: block windows), and XLA's RoPE in the others (refreshes; the
q/k/v product there as `matmul_impl` gives it); the norm before attention stays apart.
`attention_impl="split_kv_mosaic"` (the split-K/V kernel's Mosaic GPU port,
`djax.kernels.flash_attention_mosaic`) is likewise taken only when asked for, for block
forwards and refreshes, with 16-bit inputs and head dims that are multiples of 64.
`moe_impl="mosaic"` (`djax.kernels.expert_tiles_mosaic`), the one expert kernel that takes
fp8 weights as well as 16-bit ones, runs every forward's experts where asked (no row limit:
its row tiles follow the experts); `auto` takes it only for fp8 weights (above).
`fp8_impl="mosaic"` (fp8 weights, `djax.kernels.fp8_matmul_mosaic`, Hopper GPUs) is taken
only when asked for, on one device, with every dense product's contraction a multiple
of 128 and its output a multiple of 64: block forwards of at most `KERNEL_MAX_ROWS` token
rows run the q/k/v, attention-output and down products and the SwiGLU gate/up path in the
fp8 x fp8 Mosaic GPU kernel (`fp8_mosaic`), their partials handed on as the split-K
kernels' are; refreshes and longer forwards run XLA's `scaled` products, and the experts
keep their own choice (`moe_impl`). The model then holds those weights K-major
(`KernelChoice.k_major`, `djax.models.fp8`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from djax.config import ModelConfig
from djax.kernel_options import KernelOptions
from djax.kernels import (
    flash_attention,
    flash_attention_mosaic,
    fp8_matmul_mosaic,
    residual_norm_mosaic,
    residual_product,
    residual_product_mosaic,
    rope_write,
    rope_write_mosaic,
    tiles,
    tma_ring,
)
from djax.models import fp8

# The most token rows djax's product kernels take under `auto` (a block of one sequence).
KERNEL_MAX_ROWS = 32
# What a GPU needs for `auto` to take djax's kernels: the compute capability and the shared
# memory per block (opt-in) of the GPUs their tiles were built for.
KERNEL_MIN_CAPABILITY = (9, 0)
KERNEL_MIN_SHARED_MEMORY = 227 * 1024
# The fewest heads (kv heads x (group + 2), one program each) the q/k/v product runs inside
# the RoPE kernel with; fewer (as under tensor parallelism) keep the split-K product, which
# spreads over more programs.
MIN_FUSED_PROGRAMS = 48
GROUPED_EXPERTS_MAX_TOKENS = 64
# GPUs with fp8 tensor cores (Ada, Hopper and later).
FP8_MIN_CAPABILITY = (8, 9)


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
        """Whether `auto` takes djax's kernels here."""
        return (
            self.platform == "gpu"
            and self.compute_capability is not None
            and self.compute_capability >= KERNEL_MIN_CAPABILITY
            and self.shared_memory >= KERNEL_MIN_SHARED_MEMORY
        )

    @property
    def runs_wgmma(self) -> bool:
        """Whether `auto` takes djax's Pallas Mosaic GPU kernels here: kernel GPUs of the Hopper
        generation (compute capability 9.x), whose WGMMA instructions they are written with."""
        return self.runs_kernels and self.compute_capability[0] == KERNEL_MIN_CAPABILITY[0]

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

    attention: `xla`, `split_kv`, `split_kv_mosaic` (its Mosaic GPU port) or `cudnn`. qkv:
    the q/k/v product, `xla`, `pallas` (split-K), `mosaic` (split-K in Mosaic GPU),
    `fp8_mosaic` (fp8 weights: `fp8_matmul_mosaic`) or `rope` (inside the RoPE kernel).
    rope: the q/k norm, RoPE and K/V writes, `xla`, `pallas` or `mosaic` (in the Mosaic GPU
    q/k/v product's epilogue; qkv is then `rope`).
    out, mlp, down: the attention-output product, the SwiGLU gate/up path and the down
    product, `xla`, `pallas`, `mosaic` or `fp8_mosaic`.
    norm: a residual add and RMSNorm on their own, `xla`, `pallas` or `mosaic` (its Mosaic
    GPU port, where `matmul_impl="mosaic"` asked for Mosaic GPU products). norm_into_mlp /
    norm_into_attention: where the norm before the feed-forward (a dense MLP) / before the
    next layer's attention runs inside the products around it, `fused` (the add in the
    product's epilogue), `tiled` (in a kernel after it) or `no`. moe: the routed experts,
    `dense`, `grouped`, `pallas` or `mosaic` (`resolve` says `none` for a model without
    experts).
    fp8: how XLA's products take fp8 weights, `dequant` or `scaled` (`djax.models.fp8`),
    `no` for weights in the model's dtype; the parts above that say `fp8_mosaic`, and
    `moe="mosaic"`, take them in Mosaic GPU instead."""

    attention: str = "xla"
    qkv: str = "xla"
    rope: str = "xla"
    out: str = "xla"
    mlp: str = "xla"
    down: str = "xla"
    norm: str = "xla"
    norm_into_mlp: str = "no"
    norm_into_attention: str = "no"
    moe: str = "dense"
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
    dense products' fp8 values are held K-major (`fp8.k_major`, under `fp8_impl="mosaic"`).
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

    def explain(self) -> str:
        """The choice as one line per forward (`part=path, ...`), and a line for the last
        layer's kept rows where they differ; with fp8 weights a last line names them and
        their layout (K-major under `fp8_impl="mosaic"`)."""
        lines = []
        for name, forward in (("block forward", self.block), ("refresh", self.refresh)):
            lines.append(f"{name}: {_listed(forward.layers)}")
            if forward.last != forward.layers:
                lines.append(f"  last layer, kept rows: {_listed(forward.last, forward.layers)}")
        if self.weights != "dtype":
            layout = "dense products' values K-major" if self.k_major else "as stored"
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
    positions (the block) at its last layer; `sparse`: the block forwards attend to each
    head's kept keys (`djax.models.sparse_attention`)."""

    batch: int
    window: int
    seq: int
    kept: int
    sparse: bool = False

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
) -> KernelChoice:
    """The concrete choice for a program of `shapes` running `config` in `dtype` with
    weights of the format `weights` on `device`, its weights split `shards` ways (experts
    by expert where `split_experts`), `sharded` when it runs under a mesh (its products are
    then summed over the model axis before any norm). Raises a ValueError where an option
    other than `auto` names a kernel that does not take these shapes, dtype or weights."""
    widths = _Widths(config, shards, split_experts)
    rule = _Rule(options, device, widths, dtype, sharded, fp8.check_weights(weights))
    return KernelChoice(
        block=rule.forward(
            shapes.batch, shapes.window, shapes.kept, refresh=False, sparse=shapes.sparse
        ),
        refresh=rule.forward(shapes.batch, shapes.seq, shapes.kept, refresh=True),
        weights=weights,
        k_major=fp8.k_major(weights, options.fp8_impl),
    )


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
    ):
        self.options, self.widths, self.sharded = options, widths, sharded
        self.half = jnp.dtype(dtype).itemsize == 2
        self.dtype_name = jnp.dtype(dtype).name
        self.gpu = device.platform == "gpu"
        self.kernels_pay = device.runs_kernels and self.half
        self.wgmma_pays = device.runs_wgmma and self.half
        self.fp8 = weights == "fp8"
        # djax's product kernels take 16-bit weights: not fp8 ones.
        self.products_pay = self.kernels_pay and not self.fp8
        self.fp8_tensor_cores = (
            self.gpu
            and device.compute_capability is not None
            and device.compute_capability >= FP8_MIN_CAPABILITY
        )
        if options.attention_impl in ("cudnn", "split_kv_mosaic") and not self.half:
            raise ValueError(
                f"attention_impl={options.attention_impl!r} takes bf16 or fp16 inputs; got "
                f"{self.dtype_name}"
            )
        # A model without experts ignores `moe_impl`: it is checked only where it applies.
        moe = ("moe_impl",) if widths.config.is_moe else ()
        if self.fp8:
            for name in ("matmul_impl", "mlp_impl", *moe):
                if getattr(options, name) in ("pallas", "mosaic") and not (
                    name == "moe_impl" and options.moe_impl == "mosaic"
                ):
                    raise ValueError(
                        f"{name}={getattr(options, name)!r} takes 16-bit weights; with "
                        "weights='fp8' the products run in XLA: give 'auto' or 'xla'"
                    )
        if self.fp8 and options.fp8_impl == "mosaic":
            self._check_fp8_mosaic()
        if self.fp8 and options.rope_impl == "mosaic":
            raise ValueError(
                "rope_impl='mosaic' runs the q/k/v product of 16-bit weights; with "
                "weights='fp8' give 'auto', 'xla' or 'pallas'"
            )
        for name in ("matmul_impl", "mlp_impl", "rope_impl", *moe):
            if getattr(options, name) == "mosaic" and not tma_ring.takes_dtype(dtype):
                raise ValueError(
                    f"{name}='mosaic' takes bfloat16 or float16 as the model dtype; got "
                    f"{self.dtype_name}"
                )

    def forward(
        self, batch: int, positions: int, kept: int, refresh: bool, sparse: bool = False
    ) -> ForwardKernels:
        """The choice for a forward of `batch` windows of `positions` positions keeping
        `kept` of them at its last layer (whose attention runs every window row), its
        attention `sparse` or dense."""
        layers = self.kernels(batch * positions, positions, refresh, sparse)
        last = self.kernels(batch * kept, positions, refresh, sparse)
        window_parts = ("attention", "qkv", "rope", "norm_into_attention")
        last = dataclasses.replace(last, **{name: getattr(layers, name) for name in window_parts})
        return ForwardKernels(layers, last)

    def kernels(self, rows: int, positions: int, refresh: bool, sparse: bool = False) -> Kernels:
        """The choice for `rows` token rows of windows of `positions` positions."""
        o, w, cfg = self.options, self.widths, self.widths.config
        few = rows <= KERNEL_MAX_ROWS
        if o.rope_impl == "mosaic":
            rope = self._mosaic_rope(positions, few)
        else:
            rope = self._pallas_or_xla(
                "rope_impl",
                o.rope_impl,
                rope_write.fits(cfg.head_dim, cfg.rope_dim),
                f"heads whose rotary halves ({cfg.rope_dim // 2}) and unrotated rest "
                f"({cfg.head_dim - cfg.rope_dim}) are powers of two or zero; got "
                f"head_dim={cfg.head_dim}, rotary_dim={cfg.rope_dim}",
                self.kernels_pay,
            )
        qkv = "rope" if rope == "mosaic" else self._product(w.qkv, few)
        out = self._product(w.out, few)
        fp8_mosaic = self.fp8 and o.fp8_impl == "mosaic" and few and not refresh
        if fp8_mosaic:
            mlp = "fp8_mosaic"
        elif o.mlp_impl == "mosaic":
            mlp = self._mosaic(
                "mlp_impl",
                all(tma_ring.fits(cfg.d_model, h) for h in w.mlp_hidden),
                f"model and hidden widths {cfg.d_model} -> {w.mlp_hidden}",
                few,
            )
        else:
            mlp = self._pallas_or_xla(
                "mlp_impl",
                o.mlp_impl,
                all(tiles.matmul_fits(cfg.d_model, h) for h in w.mlp_hidden),
                f"model and hidden widths that are multiples of 16; got {cfg.d_model} -> "
                f"{w.mlp_hidden}",
                self.products_pay and few,
            )
        downs = [self._product((h, cfg.d_model), few) for h in w.mlp_hidden]
        down = downs[0] if downs and all(d == downs[0] for d in downs) else "xla"
        if fp8_mosaic:
            qkv = out = down = "fp8_mosaic"
        if (
            rope == "pallas"
            and qkv == "pallas"
            and few
            and w.kv_heads * (w.group + 2) >= MIN_FUSED_PROGRAMS
            and rope_write.projection_fits(positions, cfg.d_model, cfg.head_dim, cfg.rope_dim)
        ):
            qkv = "rope"
        fusing = self._norm_fusion(few)
        into_mlp = (
            fusing
            if fusing != "no"
            and out in ("pallas", "mosaic")
            and mlp in ("pallas", "mosaic")
            and _fits(w.out, out)
            and not cfg.attn_out_bias  # the output product's epilogue adds no bias
            else "no"
        )
        into_attention = (
            fusing
            if fusing != "no"
            and down == "pallas"
            and qkv == "rope"
            and rope == "pallas"
            and all(residual_product.fits(h, cfg.d_model) for h in w.mlp_hidden)
            else "no"
        )
        if o.norm_impl == "auto":
            norm = "pallas" if self.kernels_pay else "xla"
        else:  # `fused` and `tiled` run the norms they cannot move into a product as `pallas`
            norm = "xla" if o.norm_impl == "xla" else "pallas"
        if (
            norm == "pallas"
            and o.matmul_impl == "mosaic"
            and residual_norm_mosaic.row_fits(cfg.d_model)
        ):  # after Mosaic GPU products, the norm kernel's Mosaic GPU port
            norm = "mosaic"
        return Kernels(
            attention="xla" if sparse else self._attention(refresh),
            qkv=qkv,
            rope=rope,
            out=out,
            mlp=mlp,
            down=down,
            norm=norm,
            norm_into_mlp=into_mlp,
            norm_into_attention=into_attention,
            moe=self._moe(rows) if cfg.is_moe else "none",
            fp8=self._fp8(),
        )

    def _attention(self, refresh: bool) -> str:
        impl, cfg = self.options.attention_impl, self.widths.config
        if impl == "cudnn":
            return "cudnn" if refresh else "xla"
        if impl == "split_kv_mosaic" and not flash_attention_mosaic.fits(cfg.head_dim):
            raise ValueError(
                f"attention_impl='split_kv_mosaic' takes a head dim that is a multiple of 64; "
                f"got {cfg.head_dim}"
            )
        if impl != "auto":
            return impl
        if self.kernels_pay and flash_attention.fits(cfg.head_dim):
            return "split_kv"
        return "cudnn" if refresh and self.gpu and self.half else "xla"

    def _product(self, widths: tuple[int, int], few: bool) -> str:
        k, n = widths
        if self.options.matmul_impl == "mosaic":
            return self._mosaic("matmul_impl", tma_ring.fits(k, n), f"a product {k} -> {n}", few)
        return self._pallas_or_xla(
            "matmul_impl",
            self.options.matmul_impl,
            tiles.matmul_fits(k, n),
            f"products whose contraction and output widths are multiples of 16; got {k} -> {n}",
            self.products_pay and few,
        )

    def _mosaic_rope(self, positions: int, few: bool) -> str:
        """`rope_impl="mosaic"`: `mosaic` for windows of `positions` rows the kernel takes in
        forwards of at most `KERNEL_MAX_ROWS` token rows (`few`: its q/k/v product holds one
        64-row tile per CTA, as the other Mosaic GPU products), `xla` otherwise; a ValueError
        where the model's heads or width do not fit."""
        cfg = self.widths.config
        shortest = tma_ring.ROW_ALIGN  # a window it takes: the heads and the width decide
        if not rope_write_mosaic.fits(shortest, cfg.d_model, cfg.head_dim, cfg.rope_dim):
            raise ValueError(
                f"rope_impl='mosaic' takes head_dim in {rope_write_mosaic.HEAD_DIMS} with "
                "rotary halves and rest multiples of 8, and a model width that is a multiple "
                f"of 64; got head_dim={cfg.head_dim}, rotary_dim={cfg.rope_dim}, "
                f"d_model={cfg.d_model}"
            )
        fits = rope_write_mosaic.fits(positions, cfg.d_model, cfg.head_dim, cfg.rope_dim)
        return "mosaic" if fits and few else "xla"

    def _fp8(self) -> str:
        """XLA's fp8 path; under `mosaic`, `scaled` for the products it leaves to XLA."""
        if not self.fp8:
            return "no"
        impl = self.options.fp8_impl
        if impl == "mosaic":
            return "scaled"
        if impl != "auto":
            return impl
        return "scaled" if self.fp8_tensor_cores else "dequant"

    def _check_fp8_mosaic(self) -> None:
        """`fp8_impl="mosaic"`: a ValueError unless it runs on one device and the kernel
        takes every dense product (`fp8_matmul_mosaic.fits`)."""
        if self.sharded:
            raise ValueError(
                "fp8_impl='mosaic' runs on one device (its K-major weights have no sharded "
                "layout); under a mesh give 'auto', 'dequant' or 'scaled'"
            )
        w, cfg = self.widths, self.widths.config
        products = {"q/k/v": w.qkv, "attention output": w.out}
        for h in w.mlp_hidden:
            products[f"gate/up ({h})"] = (cfg.d_model, h)
            products[f"down ({h})"] = (h, cfg.d_model)
        for name, (k, n) in products.items():
            if not fp8_matmul_mosaic.fits(k, n):
                raise ValueError(
                    f"fp8_impl='mosaic' takes products whose contraction is a multiple of "
                    f"{fp8_matmul_mosaic.K_TILE} and output a multiple of {tma_ring.TILE}; "
                    f"got the {name} product {k} -> {n}"
                )

    def _norm_fusion(self, few: bool) -> str:
        """Where a residual norm moved into the next product runs its add, before the
        products are checked: `tiled` under `auto` (the split-K product, then a tiled
        kernel: on GPUs of the fastest memory the unsplit `fused` product cannot keep up),
        `no` where it does not apply."""
        impl = self.options.norm_impl
        wanted = impl in ("fused", "tiled") or (impl == "auto" and self.kernels_pay)
        if not wanted or self.sharded or not few:
            return "no"
        return impl if impl in ("fused", "tiled") else "tiled"

    def _moe(self, tokens: int) -> str:
        cfg, w = self.widths.config, self.widths
        fits = tiles.matmul_fits(cfg.d_model, w.expert_hidden)
        impl = self.options.moe_impl
        if impl == "mosaic":
            return self._mosaic(
                "moe_impl",
                tma_ring.fits(cfg.d_model, w.expert_hidden),
                f"model {cfg.d_model}, local expert ffn {w.expert_hidden}",
                True,
            )
        if impl == "pallas" and not fits:
            raise ValueError(
                f"moe_impl='pallas' takes model and local expert widths that are multiples "
                f"of 16; got model {cfg.d_model}, local expert ffn {w.expert_hidden}"
            )
        if impl == "pallas" or (impl == "auto" and self.products_pay and fits):
            return "pallas"
        if (
            impl == "auto"
            and self.fp8
            and self.wgmma_pays
            and tma_ring.fits(cfg.d_model, w.expert_hidden)
        ):
            return "mosaic"  # the one expert kernel that reads fp8 weights
        return "grouped" if tokens <= GROUPED_EXPERTS_MAX_TOKENS else "dense"

    @staticmethod
    def _mosaic(option: str, fits: bool, unfit: str, rows_fit: bool) -> str:
        """`mosaic`, asked for: a ValueError naming `option` and `unfit` (what it got) where
        the widths are not multiples of 64 (`tma_ring.fits`); `mosaic` where the forward's
        rows suit the kernel (`rows_fit`), else `xla`."""
        if not fits:
            raise ValueError(
                f"{option}='mosaic' takes widths that are multiples of 64; got {unfit}"
            )
        return "mosaic" if rows_fit else "xla"

    @staticmethod
    def _pallas_or_xla(option: str, impl: str, fits: bool, unfit: str, pays: bool) -> str:
        """The rule every Pallas-kernel option shares: `pallas` where the kernel does not
        fit raises a ValueError naming `option` and `unfit` (what the kernel takes and what
        it got); `auto` is `pallas` where it fits and `pays`, else `xla`."""
        if impl == "pallas" and not fits:
            raise ValueError(f"{option}='pallas' takes {unfit}")
        if impl != "auto":
            return impl
        return "pallas" if pays and fits else "xla"


def _fits(widths: tuple[int, int], impl: str) -> bool:
    """Whether the residual product of `impl` (`pallas` or `mosaic`) takes these widths."""
    return (residual_product_mosaic if impl == "mosaic" else residual_product).fits(*widths)
