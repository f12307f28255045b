"""The kernel options `djax.load` takes (`attention_impl=...`, ...): their names, allowed
values and what `auto` picks, in one table that `load`, the models and the CLI's `choices`
all read. Imports nothing heavy, so the CLI can list them without importing jax."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class KernelOption:
    """A module option: `name` (a `djax.load` keyword), its `choices` (`auto` first) and
    `auto`, what `auto` picks (the rules themselves are in `djax.models.impls`)."""

    name: str
    choices: tuple[str, ...]
    auto: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


KERNEL_OPTIONS: dict[str, KernelOption] = {
    option.name: option
    for option in (
        KernelOption(
            "attention_impl",
            ("auto", "xla", "cudnn", "split_kv"),
            "split_kv on GPUs (cudnn where its tiles do not fit), xla elsewhere and for fp32",
        ),
        KernelOption(
            "mlp_impl",
            ("auto", "xla", "pallas"),
            "pallas on GPUs for <= 32 token rows with 16-bit weights, else xla",
        ),
        KernelOption(
            "matmul_impl",
            ("auto", "xla", "pallas"),
            "the q/k/v, output and down products: split-K pallas on GPUs for <= 32 token rows "
            "with 16-bit weights, else xla",
        ),
        KernelOption(
            "norm_impl",
            ("auto", "xla", "pallas", "fused", "tiled"),
            "residual add + RMSNorm: fused on H100s, tiled on other GPUs (16-bit weights), "
            "else xla",
        ),
        KernelOption(
            "rope_impl",
            ("auto", "xla", "pallas"),
            "q/k norm, RoPE and K/V writes: pallas on GPUs with 16-bit weights, else xla",
        ),
        KernelOption(
            "moe_impl",
            ("auto", "grouped", "dense", "hopper", "pallas"),
            "MoE experts: pallas on GPUs, hopper on Hopper GPUs where pallas does not fit, "
            "else grouped up to 64 tokens per forward and dense above",
        ),
    )
}


def check_choice(option: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming `option`'s bad `value` and its `choices`."""
    if value not in choices:
        raise ValueError(f"{option}={value!r}; expected one of {choices}")


def check_kernel_options(options: Mapping[str, Any]) -> None:
    """Refuse unknown option names (TypeError naming the closest valid one and all of them)
    and values outside an option's choices (ValueError naming its choices)."""
    for name, value in options.items():
        if name not in KERNEL_OPTIONS:
            close = difflib.get_close_matches(name, KERNEL_OPTIONS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"unknown kernel option {name!r}; {hint}expected one of {tuple(KERNEL_OPTIONS)}"
            )
        check_choice(name, value, KERNEL_OPTIONS[name].choices)
