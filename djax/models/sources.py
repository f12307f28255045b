"""How a djax param is assembled from HF tensors, lazily and slice by slice.

A `ParamSource` says which HF tensors make one djax param: their *raw* arrangement
(views, concatenations and stacks of the stored `[out, in]` tensors, all contiguous
reads) and the axis permutation that turns raw into the djax layout. The loader reads
only the raw slice a device owns, places it, and permutes it on the device, so no full
copy of a large model ever sits on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from djax.config import ModelConfig

Index = tuple[slice, ...]


class TensorStore(Protocol):
    def view(self, name: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One stored tensor, optionally viewed with another `shape` (a free reshape of its
    `stored` shape)."""

    name: str
    shape: tuple[int, ...] | None = None
    stored: tuple[int, ...] | None = None

    def names(self) -> list[str]:
        return [self.name]

    def split(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        """The stored tensor of a raw array (the inverse of `read`)."""
        return {self.name: raw.reshape(self.stored) if self.stored else raw}

    def raw_shape(self, store: TensorStore) -> tuple[int, ...]:
        """The view's shape; ValueError when the stored tensor is not the `stored` shape."""
        actual = tuple(store.view(self.name).shape)
        if self.stored and actual != tuple(self.stored):
            raise ValueError(f"tensor {self.name!r} has shape {actual}; expected {self.stored}")
        return tuple(self.shape) if self.shape else actual

    def read(self, store: TensorStore, index: Index) -> np.ndarray:
        view = store.view(self.name)
        if self.shape:
            view = view.reshape(self.shape)
        return np.asarray(view[index])


@dataclasses.dataclass(frozen=True)
class Joined:
    """Parts concatenated along `axis` (or stacked on a new `axis` when `stack`)."""

    parts: tuple[Tensor | Joined, ...]
    axis: int
    stack: bool = False

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def split(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        if self.stack:
            pieces = [np.take(raw, i, axis=self.axis) for i in range(len(self.parts))]
        else:
            sizes = [
                p.shape[self.axis] if isinstance(p, Tensor) and p.shape else None
                for p in self.parts
            ]
            pieces = np.split(raw, np.cumsum(sizes[:-1]), axis=self.axis)
        out: dict[str, np.ndarray] = {}
        for part, piece in zip(self.parts, pieces, strict=True):
            out.update(part.split(piece))
        return out

    def raw_shape(self, store: TensorStore) -> tuple[int, ...]:
        """ValueError when the parts' shapes differ (off the concatenation axis)."""
        shapes = [p.raw_shape(store) for p in self.parts]
        kept = [s if self.stack else s[: self.axis] + s[self.axis + 1 :] for s in shapes]
        if len(set(kept)) > 1:
            raise ValueError(f"tensors {self.names()} have shapes {shapes} that do not join")
        first = list(shapes[0])
        if self.stack:
            return tuple(first[: self.axis] + [len(shapes)] + first[self.axis :])
        first[self.axis] = sum(s[self.axis] for s in shapes)
        return tuple(first)

    def read(self, store: TensorStore, index: Index) -> np.ndarray:
        want = index[self.axis]
        if self.stack:
            rest = index[: self.axis] + index[self.axis + 1 :]
            chosen = self.parts[want]
            return np.stack([p.read(store, rest) for p in chosen], axis=self.axis)
        pieces, offset = [], 0
        lo, hi, _ = want.indices(self.raw_shape(store)[self.axis])
        for part in self.parts:
            size = part.raw_shape(store)[self.axis]
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                sub = index[: self.axis] + (slice(a - offset, b - offset),) + index[self.axis + 1 :]
                pieces.append(part.read(store, sub))
            offset += size
        return np.concatenate(pieces, axis=self.axis)


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """djax param at `path` = `raw.transpose(perm)` where `raw` is assembled by `raw`."""

    path: tuple[str, ...]
    raw: Tensor | Joined
    perm: tuple[int, ...] | None = None

    def target_shape(self, store: TensorStore) -> tuple[int, ...]:
        shape = self.raw.raw_shape(store)
        return shape if self.perm is None else tuple(shape[p] for p in self.perm)

    def export(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """The stored HF tensors that make up a djax param value (inverse of loading)."""
        raw = value if self.perm is None else np.transpose(value, np.argsort(self.perm))
        return self.raw.split(raw)


def copy(path: Sequence[str], name: str) -> ParamSource:
    return ParamSource(tuple(path), Tensor(name))


def transposed(path: Sequence[str], name: str) -> ParamSource:
    """A torch Linear `[out, in]` stored as `[in, out]` for `x @ w`."""
    return ParamSource(tuple(path), Tensor(name), (1, 0))


def gate_up(path: Sequence[str], gate: str, up: str) -> ParamSource:
    """Gate and up `[ffn, model]` each -> fused `[model, 2, ffn]`."""
    return ParamSource(
        tuple(path), Joined((Tensor(gate), Tensor(up)), axis=0, stack=True), (2, 0, 1)
    )


def attention_sources(
    config: ModelConfig, prefix: str, *, q: str, k: str, v: str, out: str
) -> list[ParamSource]:
    """q/k/v `[heads*head_dim, model]` -> fused `qkv` [model, kv_heads, group + 2, head_dim];
    output `[model, heads*head_dim]` -> `attn_out` [kv_heads, group, head_dim, model]."""
    kv, d, m = config.n_kv_heads, config.head_dim, config.d_model
    group = config.n_heads // kv
    parts = (
        Tensor(q, (kv, group, d, m), (kv * group * d, m)),
        Tensor(k, (kv, 1, d, m), (kv * d, m)),
        Tensor(v, (kv, 1, d, m), (kv * d, m)),
    )
    out_view = Tensor(out, (m, kv, group, d), (m, kv * group * d))
    return [
        ParamSource((prefix, "qkv"), Joined(parts, axis=1), (3, 0, 1, 2)),
        ParamSource((prefix, "attn_out"), out_view, (1, 2, 3, 0)),
    ]
