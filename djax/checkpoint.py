"""Weights in and out: HF safetensors folders read lazily and placed shard by shard, and the
orbax checkpoint that `djax convert` writes.

HF tensors are memory-mapped (no read until a slice is asked for); each djax param is
assembled from the raw slice its device owns (`djax.models.sources`), placed, then permuted
and cast on the device. A full unsharded copy of the model never sits on the host, and a
sharded param never exists whole on one device.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from djax.config import ModelConfig
from djax.models import abstract_params, hf_sources
from djax.models.sources import ParamSource

PARAMS_DIR = "djax_params"
MARKER = "djax.json"
FORMAT_VERSION = 1

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
# Buffers some HF exports carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A weights folder is missing, unsafe, or does not match its config."""


class SafetensorsStore:
    """Zero-copy numpy views of every tensor in a folder's `*.safetensors` files.

    Reads `model.safetensors.index.json` when present (sharded checkpoints), otherwise every
    `*.safetensors` file in the folder.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({folder / f for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files found")
        self._entries: dict[str, tuple[np.memmap, str, tuple[int, ...], int, int]] = {}
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {index.name} but missing")
            self._read_header(path)

    def _read_header(self, path: Path) -> None:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {name} has dtype {info['dtype']}; "
                    f"supported: {sorted(_SAFETENSORS_DTYPES)}"
                )
            begin, end = info["data_offsets"]
            self._entries[name] = (
                data,
                info["dtype"],
                tuple(info["shape"]),
                8 + size + begin,
                8 + size + end,
            )

    def names(self) -> list[str]:
        return list(self._entries)

    def view(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint")
        data, dtype, shape, begin, end = self._entries[name]
        return data[begin:end].view(_SAFETENSORS_DTYPES[dtype]).reshape(shape)


class TorchBinStore:
    """Pickled `pytorch_model*.bin` weights, read only after an explicit opt-in."""

    def __init__(self, folder: str | Path):
        import torch

        self._tensors: dict[str, Any] = {}
        for path in sorted(Path(folder).glob("pytorch_model*.bin")):
            self._tensors.update(torch.load(path, map_location="cpu", weights_only=True, mmap=True))

    def names(self) -> list[str]:
        return list(self._tensors)

    def view(self, name: str) -> np.ndarray:
        import torch

        tensor = self._tensors[name]
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()


def open_store(folder: str | Path, allow_pickle: bool = False) -> SafetensorsStore | TorchBinStore:
    folder = Path(folder)
    if any(folder.glob("*.safetensors")):
        return SafetensorsStore(folder)
    if any(folder.glob("pytorch_model*.bin")):
        if not allow_pickle:
            raise CheckpointError(
                f"{folder}: holds only pickled *.bin weights. Unpickling can run arbitrary code, "
                "so djax refuses it by default; convert the folder to safetensors, or pass "
                "allow_pickle=True (CLI: --allow-pickle) if you trust its origin."
            )
        return TorchBinStore(folder)
    raise CheckpointError(f"{folder}: no *.safetensors (or pytorch_model*.bin) weights found")


def _leaf(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set_leaf(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def check_sources(sources: list[ParamSource], store: Any, abstract: dict, folder: Any) -> None:
    """Every param has its tensors, with the right shapes; no stored tensor goes unused."""
    stored = set(store.names())
    wanted = {n for s in sources for n in s.raw.names()}
    missing = sorted(wanted - stored)
    if missing:
        raise CheckpointError(
            f"{folder}: {len(missing)} tensors the config needs are missing, e.g. {missing[:5]}"
        )
    unused = sorted(n for n in stored - wanted if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise CheckpointError(
            f"{folder}: {len(unused)} tensors are not used by the model the "
            f"config describes (wrong config.json?), e.g. {unused[:5]}"
        )
    for src in sources:
        try:
            shape = src.target_shape(store)
        except ValueError as err:
            raise CheckpointError(
                f"{folder}: tensors {src.raw.names()[:3]} do not fit param "
                f"{'/'.join(src.path)}: {err}"
            ) from err
        expected = _leaf(abstract, src.path).shape
        if shape != expected:
            raise CheckpointError(
                f"{folder}: param {'/'.join(src.path)} from "
                f"{src.raw.names()[:2]} has shape {shape}, config.json "
                f"implies {expected}"
            )


def _raw_sharding(target: Sharding, perm: tuple[int, ...] | None) -> Sharding:
    if perm is None or not isinstance(target, NamedSharding):
        return target
    spec = tuple(target.spec) + (None,) * (len(perm) - len(target.spec))
    raw = [None] * len(perm)
    for target_axis, raw_axis in enumerate(perm):
        raw[raw_axis] = spec[target_axis]
    return NamedSharding(target.mesh, PartitionSpec(*raw))


@functools.cache
def _finisher(perm: tuple[int, ...] | None, dtype: Any, sharding: Sharding) -> Callable:
    def finish(raw):
        out = raw if perm is None else jnp.transpose(raw, perm)
        return out.astype(dtype)

    return jax.jit(finish, out_shardings=sharding, donate_argnums=0)


def place_param(src: ParamSource, store: Any, dtype: Any, sharding: Sharding) -> jax.Array:
    """Read the raw slices each device owns, place them, permute and cast on the device."""
    raw_shape = src.raw.raw_shape(store)
    raw = jax.make_array_from_callback(
        raw_shape, _raw_sharding(sharding, src.perm), lambda index: src.raw.read(store, index)
    )
    return _finisher(src.perm, jnp.dtype(dtype), sharding)(raw)


def load_hf_params(
    folder: str | Path,
    config: ModelConfig,
    dtype: Any,
    shardings: dict | None = None,
    allow_pickle: bool = False,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> dict:
    """Params of an HF folder in the djax layout, cast to `dtype`, placed per `shardings`
    (a pytree of `Sharding`s like the params; default: the first local device)."""
    store = open_store(folder, allow_pickle)
    sources = hf_sources(config)
    abstract = abstract_params(config, dtype)
    check_sources(sources, store, abstract, folder)
    default = SingleDeviceSharding(jax.local_devices()[0])
    params: dict = {}
    items = progress(sources) if progress else sources
    for src in items:
        leaf_dtype = _leaf(abstract, src.path).dtype
        sharding = _leaf(shardings, src.path) if shardings else default
        _set_leaf(params, src.path, place_param(src, store, leaf_dtype, sharding))
    return params


def save_hf(
    folder: str | Path, config: ModelConfig, params: dict, hf_config: dict, dtype: Any = None
) -> None:
    """Write params as an HF folder of the model's family: `model.safetensors` with the HF
    names and `[out, in]` layouts, and `hf_config` as `config.json` (tokenizer not included).
    dtype: storage dtype of the tensors (default: the params' own)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for src in hf_sources(config):
        value = np.asarray(jax.device_get(_leaf(params, src.path)))
        if dtype is not None:
            value = value.astype(dtype)
        tensors.update({k: np.ascontiguousarray(v) for k, v in src.export(value).items()})
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))


def save_orbax(folder: str | Path, params: dict, metadata: dict) -> None:
    """Write params as an orbax checkpoint under `folder/djax_params`, plus `djax.json`."""
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    (folder / MARKER).write_text(
        json.dumps({"format_version": FORMAT_VERSION, **metadata}, indent=2)
    )


def is_converted(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def restore_orbax(
    folder: str | Path, config: ModelConfig, dtype: Any, shardings: dict | None = None
) -> dict:
    """Restore params straight into their target dtype and shardings."""
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    marker = json.loads((folder / MARKER).read_text())
    if marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{folder / MARKER}: format_version="
            f"{marker.get('format_version')}; this djax reads "
            f"{FORMAT_VERSION}"
        )
    abstract = abstract_params(config, dtype)
    default = SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        shardings if shardings else jax.tree.map(lambda _: default, abstract),
    )
    return ocp.StandardCheckpointer().restore(folder / PARAMS_DIR, target)
