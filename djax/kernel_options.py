"""The kernel options `djax.load` takes (`attention_impl=...`, ...) as `KernelOptions`, a
frozen dataclass whose fields are the options: each field's metadata holds its choices
(`auto` first) and what `auto` picks, and `load`, `Model.with_options` and the CLI's
`choices` all read them from there. `djax.models.kernel_choice.resolve` turns the options
into the concrete choice for a device. Imports nothing heavy, so the CLI can list the
options without importing jax."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any


def _option(choices: tuple[str, ...], auto: str, fallback: str = "xla") -> Any:
    return dataclasses.field(
        default="auto", metadata={"choices": choices, "auto": auto, "fallback": fallback}
    )


def check_choice(option: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming `option`'s bad `value` and its `choices`."""
    if value not in choices:
        raise ValueError(f"{option}={value!r}; expected one of {choices}")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Which implementation each part of the forward takes; `auto` leaves it to
    `resolve`, which takes djax's kernels only on the GPUs they were built for (see
    `djax.models.kernel_choice`). Every value is checked on construction."""

    # `split_kv`: djax's split-K/V attention kernel (Pallas Mosaic GPU, Hopper).
    attention_impl: str = _option(
        ("auto", "xla", "cudnn", "split_kv"),
        "split_kv on Hopper GPUs in bf16/fp16 (fp8 weights too) where its tiles fit the heads "
        "(head dim a multiple of 64); else cudnn for refreshes on GPUs (bf16/fp16) and xla",
    )
    # `mosaic`: djax's Pallas Mosaic GPU (Hopper) kernels, here and below.
    mlp_impl: str = _option(
        ("auto", "xla", "mosaic"),
        "the SwiGLU gate/up product: mosaic on Hopper GPUs for <= 32 token rows with 16-bit "
        "weights and widths that are multiples of 64, else xla",
    )
    matmul_impl: str = _option(
        ("auto", "xla", "mosaic"),
        "the q/k/v, output and down products: split-K mosaic on Hopper GPUs for <= 32 token "
        "rows with 16-bit weights and widths that are multiples of 64, else xla",
    )
    # `mosaic`: block forwards' dense products in the fp8 x fp8 Pallas Mosaic GPU (Hopper)
    # kernel, XLA's products elsewhere `scaled`, a MoE model's experts by fp8 x fp8 WGMMA in
    # their tiles; the fp8 values held K-major, a layout chosen at load.
    fp8_impl: str = _option(
        ("auto", "dequant", "scaled", "mosaic"),
        "products of fp8 weights (weights='fp8'): mosaic on Hopper GPUs in bf16/fp16 where "
        "every product's contraction is a multiple of 128 and output of 64 (and moe_impl is "
        "not xla); else scaled (fp8 x fp8, rows quantised per row) on GPUs of compute "
        "capability >= 8.9, else dequant (weights converted inside XLA's dot)",
        fallback="dequant",
    )
    # `mosaic`: the norm kernel of whole rows; `fused`: the add in the attention-output
    # product's epilogue; `tiled`: a column-tiled add after the split-K product (the norms
    # neither can move run as `mosaic`).
    norm_impl: str = _option(
        ("auto", "xla", "mosaic", "fused", "tiled"),
        "residual add + RMSNorm: tiled into the next product on Hopper GPUs (16-bit weights, "
        "<= 32 rows), else mosaic there (bf16/fp16, model width a multiple of 512), else xla",
    )
    rope_impl: str = _option(
        ("auto", "xla", "mosaic"),
        "q/k norm, RoPE and K/V writes: mosaic on Hopper GPUs in bf16/fp16 (fp8 weights too) "
        "for block windows (a multiple of 8 rows up to 64) where its tiles fit the heads, "
        "the q/k/v product inside it for <= 32 token rows where the heads make >= 48 CTAs; "
        "else xla",
    )
    moe_impl: str = _option(
        ("auto", "xla", "mosaic"),
        "MoE experts: mosaic (the expert tiles, 16-bit or fp8 weights) on Hopper GPUs where "
        "the model and expert widths are multiples of 64, else xla (grouped up to 64 tokens "
        "per forward, dense above)",
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_choice(field.name, getattr(self, field.name), field.metadata["choices"])

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any]) -> KernelOptions:
        """Options from `load`'s keywords: an unknown name raises a TypeError naming the
        closest valid one and all of them; a value outside its choices a ValueError."""
        check_names(options)
        return cls(**options)

    def replace(self, **options: Any) -> KernelOptions:
        """These options with `options` replaced (checked as `from_keywords` checks them)."""
        check_names(options)
        return dataclasses.replace(self, **options)

    def auto_as_xla(self) -> KernelOptions:
        """These options with every `auto` taken as XLA's plain path (`xla`; `dequant` for
        `fp8_impl`): what a generation falls back to when a kernel `auto` chose does not
        compile."""
        fallback = {f.name: f.metadata["fallback"] for f in dataclasses.fields(self)}
        return dataclasses.replace(
            self, **{name: fallback[name] for name, value in self.items() if value == "auto"}
        )

    def items(self) -> list[tuple[str, str]]:
        return [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]


@dataclasses.dataclass(frozen=True)
class KernelOption:
    """One field of `KernelOptions` as the CLI lists it: `name` (a `djax.load` keyword),
    its `choices` (`auto` first) and `auto`, what `auto` picks."""

    name: str
    choices: tuple[str, ...]
    auto: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KERNEL_OPTIONS: dict[str, KernelOption] = {
    field.name: KernelOption(field.name, field.metadata["choices"], field.metadata["auto"])
    for field in dataclasses.fields(KernelOptions)
}


def check_names(options: Mapping[str, Any]) -> None:
    """Refuse option names that are not `KernelOptions` fields (a TypeError naming the
    closest valid one and all of them)."""
    for name in options:
        if name not in KERNEL_OPTIONS:
            close = difflib.get_close_matches(name, KERNEL_OPTIONS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"unknown kernel option {name!r}; {hint}expected one of {tuple(KERNEL_OPTIONS)}"
            )
