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
import math
import os
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from djax.config import ModelConfig
from djax.models import abstract_params, fp8, hf_sources
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
# The safetensors format's own limit on the JSON header.
_MAX_HEADER_BYTES = 100_000_000
# Buffers some HF exports carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A weights folder is missing, unsafe, or does not match its config."""


class SafetensorsStore:
    """Zero-copy numpy views of every tensor in a folder's `*.safetensors` files.

    Reads `model.safetensors.index.json` when present (sharded checkpoints), otherwise every
    `*.safetensors` file in the folder. Each file's header is checked against the file
    before anything is mapped: its length, its JSON, and every tensor's dtype, shape and
    byte range (inside the data, of the size its shape and dtype imply). A file that breaks
    any rule raises `CheckpointError` naming the file, the tensor and what was expected.
    """

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        weight_map = _read_index(index, folder) if index.is_file() else None
        if weight_map is not None:
            files = sorted({folder / f for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files found")
        self._entries: dict[str, tuple[np.memmap, str, tuple[int, ...], int, int]] = {}
        self._files: dict[str, Path] = {}  # the file each tensor is read from
        owners = {name: folder / file for name, file in (weight_map or {}).items()}
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {index.name} but missing")
            self._read_header(path, owners)
        for name, file in (weight_map or {}).items():
            if name not in self._entries:
                raise CheckpointError(
                    f"{index}: tensor {name!r} is listed in {file} but that file does not hold it"
                )

    def _read_header(self, path: Path, owners: dict[str, Path]) -> None:
        """Take `path`'s tensors: those the index places in another file (`owners`: tensor
        name -> its file) are skipped; a tensor another file already gave (neither placed
        by the index) is a CheckpointError naming both files, never silently replaced."""
        file_size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: {file_size} bytes, too short for a safetensors file (expected an "
                    "8-byte header length, a JSON header, then the tensor data)"
                )
            (size,) = struct.unpack("<Q", prefix)
            if size > min(file_size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path}: header length {size} bytes; expected at most "
                    f"{min(file_size - 8, _MAX_HEADER_BYTES)} (the file holds {file_size} "
                    "bytes): not a safetensors file, or a truncated one"
                )
            raw = fh.read(size)
        try:
            header = json.loads(raw.decode("utf-8"))
        except ValueError as err:  # UnicodeDecodeError and JSONDecodeError
            raise CheckpointError(f"{path}: header is not valid UTF-8 JSON ({err})") from err
        if not isinstance(header, dict):
            raise CheckpointError(
                f"{path}: header is a JSON {type(header).__name__}; expected an object "
                "mapping tensor names to {dtype, shape, data_offsets}"
            )
        data_size = file_size - 8 - size
        entries = {
            name: _check_entry(path, name, info, data_size)
            for name, info in header.items()
            if name != "__metadata__"
        }
        _check_apart(path, entries)
        data = np.memmap(path, dtype=np.uint8, mode="r") if entries else None
        for name, (dtype, shape, begin, end) in entries.items():
            if owners.get(name, path) != path:
                continue
            if name in self._files:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is also in {self._files[name]}; expected each "
                    "tensor in one file (or an index naming the file that holds it)"
                )
            self._files[name] = path
            self._entries[name] = (data, dtype, shape, 8 + size + begin, 8 + size + end)

    def names(self) -> list[str]:
        return list(self._entries)

    def view(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint")
        data, dtype, shape, begin, end = self._entries[name]
        return data[begin:end].view(_SAFETENSORS_DTYPES[dtype]).reshape(shape)


def _read_index(index: Path, folder: Path) -> dict[str, str]:
    """`weight_map` of a sharded checkpoint's index: tensor name -> a file in `folder`."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{index}: not a JSON object with a 'weight_map' ({err})") from err
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: 'weight_map' is {type(weight_map).__name__}; expected an object "
            "mapping tensor names to file names"
        )
    for file in set(weight_map.values()):
        if Path(file).name != file or file in ("", ".", ".."):
            raise CheckpointError(
                f"{index}: weight_map names the file {file!r}; expected a file name in {folder}"
            )
    return weight_map


def _check_entry(
    path: Path, name: str, info: Any, data_size: int
) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of a header entry, each checked against the data size."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is {info!r}; expected an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{where} has dtype {dtype!r}; supported: {sorted(_SAFETENSORS_DTYPES)}"
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where} has shape {shape!r}; expected a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(
            f"{where} has data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end"
        )
    begin, end = offsets
    if end > data_size:
        raise CheckpointError(
            f"{where} ends at byte {end} of the data, but the file holds {data_size} data "
            "bytes (truncated?)"
        )
    nbytes = math.prod(shape) * np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize
    if end - begin != nbytes:
        raise CheckpointError(
            f"{where} spans {end - begin} bytes; its shape {shape} in {dtype} needs {nbytes}"
        )
    return dtype, tuple(shape), begin, end


def _check_apart(path: Path, entries: dict[str, tuple]) -> None:
    """A CheckpointError naming two tensors whose bytes overlap (the safetensors library
    refuses such a file too; read as it is, one tensor would take the other's bytes)."""
    spans = sorted(
        (begin, end, name) for name, (_, _, begin, end) in entries.items() if end > begin
    )
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CheckpointError(
                f"{path}: tensors {first!r} and {second!r} share bytes of the data; expected "
                "each tensor's data_offsets apart from every other's"
            )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TorchBinStore:
    """Pickled `pytorch_model*.bin` weights, read only after an explicit opt-in."""

    def __init__(self, folder: str | Path):
        import torch

        self._tensors: dict[str, Any] = {}
        self._files: dict[str, Path] = {}
        for path in sorted(Path(folder).glob("pytorch_model*.bin")):
            try:
                tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # torch reports damaged archives in many ways
                raise CheckpointError(
                    f"{path}: not a readable torch weights file ({_first_line(err)})"
                ) from err
            if not isinstance(tensors, dict):
                raise CheckpointError(
                    f"{path}: holds a {type(tensors).__name__}; expected a dict of tensors"
                )
            for name, tensor in tensors.items():
                if name in self._files:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} is also in {self._files[name]}; expected "
                        "each tensor in one file"
                    )
                self._files[name] = path
                self._tensors[name] = tensor

    def names(self) -> list[str]:
        return list(self._tensors)

    def view(self, name: str) -> np.ndarray:
        import torch

        tensor = self._tensors[name]
        readable = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in readable:
            what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(
                f"{self._files[name]}: {name!r} is a {what}; expected a float tensor "
                "(float32, float16, bfloat16 or float64)"
            )
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
    """Every param has its tensors, floating-point and of the right shapes; no stored tensor
    goes unused."""
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
    for name in sorted(wanted):
        dtype = store.view(name).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise CheckpointError(
                f"{folder}: tensor {name!r} has dtype {dtype}; expected floating-point weights"
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


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def first_nonfinite(arrays: Iterable[jax.Array]) -> int | None:
    """Index of the first array holding NaN or inf, or None: one device reduction per
    array and one transfer of all the flags."""
    flags = jax.device_get([_all_finite(a) for a in arrays])
    return next((i for i, ok in enumerate(flags) if not ok), None)


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 whose every output bit
    depends on every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fingerprint(x: jax.Array) -> jax.Array:
    """[2] uint32: the sum of x's values' bit patterns (unsigned integers of their width),
    and the sum of `_mix(bits ^ _mix(position))` over its row-major positions, both
    modulo 2**32."""
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    position, stride = jnp.uint32(0), 1
    for axis in reversed(range(x.ndim)):  # no reshape: a sharded x stays where it is
        step = jnp.uint32(stride % 2**32)
        position = position + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * step
        stride *= x.shape[axis]
    mixed = _mix(bits ^ _mix(position))
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])


@functools.partial(jax.jit, static_argnames="stored")
def _scan(x: jax.Array, stored: Any = None) -> tuple[jax.Array, jax.Array]:
    """The `_fingerprint` of x as stored in dtype `stored` (x's own: None) and whether x
    is all finite, in one program (per shape and dtypes); the cast to `stored` is fused
    into the sums, never made whole."""
    return _fingerprint(x if stored is None else x.astype(stored)), jnp.isfinite(x).all()


def fingerprints(params: dict) -> dict[str, list[int]]:
    """Each param's fingerprint by name (`_param_name`): two sums over its values' bits,
    modulo 2**32 (`_fingerprint`). Integer sums give the same result in any order, so a
    param split over devices has the fingerprint it has whole. Any changed value changes
    the first sum; values moved or changed so that it cancels change the second, but
    for a collision of odds about 2**-32."""
    return _scanned(params, {})[0]


def _scan_key(a: Any, stored: Any) -> tuple:
    return a.shape, jnp.dtype(a.dtype), a.sharding, stored


def compile_scans(abstract: dict, stored: dict[str, Any]) -> Callable[[Any], dict]:
    """Start compiling `_scan` for every distinct (shape, dtype, sharding, stored dtype) of
    the params `abstract` describes (`jax.ShapeDtypeStruct`s with shardings): each lowered
    here, then compiled on a thread (XLA's compile runs outside the GIL, a lowering does
    not: lowered on threads, they would hold up the read they are to overlap). Returns a
    function of a key (`_scan_key`) that waits for its program (None for a key not
    compiled here)."""
    keys = {
        _scan_key(a, stored.get(_param_name(path)))
        for path, a in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }

    def lowered(key: tuple) -> Any:
        shape, dtype, sharding, as_stored = key
        spec = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return _scan.lower(spec, stored=as_stored)

    programs = {key: lowered(key) for key in keys}
    pool = ThreadPoolExecutor(max_workers=min(len(keys), os.cpu_count() or 1) or 1)
    futures = {key: pool.submit(program.compile) for key, program in programs.items()}
    pool.shutdown(wait=False)
    return lambda key: futures[key].result() if key in futures else None


def _scanned(
    params: dict, stored: dict[str, Any], programs: Callable[[Any], Any] | None = None
) -> tuple[dict[str, list[int]], dict[str, bool]]:
    """Every param's fingerprint as stored in `stored[name]` (its own dtype where absent)
    and its finiteness, by name: one device program per param (`programs`' compiled ones,
    from `compile_scans`, where given) and one transfer of all the results."""
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [_param_name(path) for path, _ in named]

    def scan(name: str, a: jax.Array) -> Any:
        program = programs and programs(_scan_key(a, stored.get(name)))
        return program(a) if program is not None else _scan(a, stored.get(name))

    scans = jax.device_get([scan(name, a) for name, (_, a) in zip(names, named, strict=True)])
    sums = {name: [int(v) for v in scan[0]] for name, scan in zip(names, scans, strict=True)}
    return sums, {name: bool(scan[1]) for name, scan in zip(names, scans, strict=True)}


def _nonfinite_error(folder: Any, src: ParamSource, store: Any, dtype: Any) -> CheckpointError:
    for name in src.raw.names():
        if not np.isfinite(np.asarray(store.view(name), np.float32)).all():
            return CheckpointError(
                f"{folder}: tensor {name!r} holds NaN or inf values; expected finite weights"
            )
    return CheckpointError(
        f"{folder}: param {'/'.join(src.path)} (tensors {src.raw.names()}) overflows "
        f"{jnp.dtype(dtype).name}; load it in a wider dtype"
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


def open_checked(
    folder: str | Path, config: ModelConfig, dtype: Any, allow_pickle: bool = False
) -> tuple[Any, list[ParamSource], dict]:
    """The folder's tensor store, the param sources and the abstract params, with every
    tensor the config needs present, floating-point and of the right shape (nothing read
    but the files' headers)."""
    check_complete(folder)
    store = open_store(folder, allow_pickle)
    sources = hf_sources(config)
    abstract = abstract_params(config, dtype)
    check_sources(sources, store, abstract, folder)
    return store, sources, abstract


def load_hf_params(
    folder: str | Path,
    config: ModelConfig,
    dtype: Any,
    shardings: dict | None = None,
    allow_pickle: bool = False,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> dict:
    """Params of an HF folder in the djax layout, cast to `dtype`, placed per `shardings`
    (a pytree of `Sharding`s like the params; default: the first local device). A tensor
    with NaN or inf values raises `CheckpointError` naming it."""
    store, sources, abstract = open_checked(folder, config, dtype, allow_pickle)
    default = SingleDeviceSharding(jax.local_devices()[0])
    params: dict = {}
    items = progress(sources) if progress else sources
    for src in items:
        leaf_dtype = _leaf(abstract, src.path).dtype
        sharding = _leaf(shardings, src.path) if shardings else default
        _set_leaf(params, src.path, place_param(src, store, leaf_dtype, sharding))
    bad = first_nonfinite(_leaf(params, src.path) for src in sources)
    if bad is not None:
        raise _nonfinite_error(folder, sources[bad], store, dtype)
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


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def save_orbax(folder: str | Path, params: dict, metadata: dict) -> None:
    """Write params as an orbax checkpoint under `folder/djax_params`, then `djax.json`
    (last: a folder without it is an unfinished one) with `metadata`, the size of every
    file of the checkpoint, by which a truncated or missing file is found before reading,
    and every param's `fingerprints`, by which `restore_orbax` finds changed bytes.

    The arrays are stored uncompressed (orbax compresses with zstd by default): loading is
    then a copy from the files, with no decompression on the host, and an fp8 checkpoint
    holds half the bytes of a bf16 one (e4m3 values compress less than bf16 ones). The
    reader takes either form: each array's metadata records its compression."""
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as writer:
        writer.save(folder / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    marker = {
        "format_version": FORMAT_VERSION,
        **metadata,
        "files": _file_sizes(folder),
        "fingerprints": fingerprints(params),
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2))


def _file_sizes(folder: Path) -> dict[str, int]:
    return {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted((folder / PARAMS_DIR).rglob("*"))
        if path.is_file()
    }


def _check_file_sizes(folder: Path, recorded: Any) -> None:
    """Every file `djax.json` records is there, of its recorded size (folders converted
    before djax recorded them pass)."""
    if recorded is None:
        return
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{folder / MARKER}: 'files' is {recorded!r}; expected an object")
    for name, size in recorded.items():
        path = folder / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(
                f"{path}: {found}; {MARKER} records {size} bytes: the checkpoint is damaged "
                "or truncated, convert the model again"
            )


def is_converted(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def convert_wrote(folder: str | Path, kept: Iterable[str] = ()) -> bool:
    """Whether `folder` is what `djax convert` writes, so `--overwrite` may replace it: a
    marker that is a JSON object with a `format_version`, the params folder, and no entry
    beside them but `kept` (the model files convert copies along). A folder that merely
    holds a file named like the marker is not."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or "format_version" not in marker:
        return False
    allowed = {MARKER, PARAMS_DIR, *kept}
    entries = {p.name for p in folder.iterdir()}
    return (folder / PARAMS_DIR).is_dir() and entries <= allowed


def check_complete(folder: str | Path) -> None:
    """Refuse a folder an interrupted `djax convert` (or orbax save) left behind."""
    folder = Path(folder)
    if is_converted(folder):
        return
    if (folder / PARAMS_DIR).exists() or any(folder.glob("*.orbax-checkpoint-tmp*")):
        raise CheckpointError(
            f"{folder}: an unfinished `djax convert` output ({PARAMS_DIR}/ without "
            f"{MARKER}); delete it and convert again"
        )


def _first_line(err: BaseException) -> str:
    line = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {line[:300]}"


def _check_database(path: Path) -> None:
    """Read the OCDBT database of the checkpoint at `path` (its manifest, its b-tree and
    each array's zarr metadata) through tensorstore futures, each waited on in this
    thread, so that a damaged database raises here and not inside orbax: orbax opens the
    arrays concurrently in an asyncio loop that it closes at the first failure, and the
    opens still under way then complete into the closed loop from tensorstore's threads,
    each printing a `RuntimeError: Event loop is closed` traceback. The arrays' metadata
    files (`array_metadatas/`, JSON that orbax reads only as it restores, in that loop) are
    parsed here too."""
    for part in sorted((path / "array_metadatas").glob("*")):
        try:
            json.loads(part.read_bytes())
        except ValueError as err:
            raise ValueError(f"{part.name} in array_metadatas: {err}") from err
    if not (path / "manifest.ocdbt").is_file():
        return  # no OCDBT database: orbax reports the checkpoint without opening one
    import tensorstore as ts

    base = {"driver": "file", "path": f"{path}/"}
    database = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    keys = [k for k in database.list().result() if k.endswith((b"/.zarray", b"/zarr.json"))]
    for read in [database.read(k) for k in keys]:
        json.loads(read.result().value)


def check_orbax(folder: str | Path, abstract: dict) -> None:
    """The checkpoint under `folder/djax_params` holds exactly the params `abstract`
    describes: the same names and shapes (read from its metadata; no array is read)."""
    path = Path(folder).absolute() / PARAMS_DIR
    try:
        _check_database(path)
        with _checkpointer() as reader:  # closed: no orbax thread outlives the call
            tree = reader.metadata(path).item_metadata.tree
        stored = {
            _param_name(k): tuple(m.shape) for k, m in jax.tree_util.tree_flatten_with_path(tree)[0]
        }
    except Exception as err:  # orbax and tensorstore raise many kinds
        raise CheckpointError(
            f"{path}: not a readable orbax checkpoint ({_first_line(err)}); convert the model again"
        ) from err
    expected = {
        _param_name(k): tuple(a.shape) for k, a in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    if stored != expected:
        diff = sorted(set(stored.items()) ^ set(expected.items()))
        # only scales missing: converted when djax kept those weights in the model's dtype
        missing = [name for name, _ in diff if name not in stored]
        if len(missing) == len(diff) and all(fp8.values_name(n) for n in missing):
            weights = ", ".join(fp8.values_name(n) for n in missing)
            raise CheckpointError(
                f"{path}: an fp8 folder converted before djax stored {weights} in fp8 (it "
                f"holds no {', '.join(missing)}); convert the model again"
            )
        raise CheckpointError(
            f"{path}: holds params that differ from what config.json describes, e.g. "
            f"{diff[:3]} (name, shape); convert the model again"
        )


def stored_weights(folder: str | Path) -> str:
    """The weight format a converted folder holds (its `djax.json`'s `weights`; `"dtype"`
    for folders converted before djax recorded it)."""
    path = Path(folder) / MARKER
    try:
        weights = json.loads(path.read_text()).get("weights", "dtype")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a JSON object ({err})") from err
    if weights not in fp8.WEIGHTS:
        raise CheckpointError(f"{path}: weights={weights!r}; expected one of {fp8.WEIGHTS}")
    return weights


def restore_orbax(
    folder: str | Path,
    config: ModelConfig,
    dtype: Any,
    shardings: dict | None = None,
    weights: str = "dtype",
) -> dict:
    """Restore params of the format `weights` straight into their target dtype and
    shardings (fp8 values and their scales as stored). A damaged checkpoint (a file's
    size, a param's fingerprint where `djax.json` records them: each param checked as
    stored, through an exact cast back where the load widened it; not where it narrowed)
    or NaN/inf values raise `CheckpointError`."""
    import orbax.checkpoint as ocp

    folder = Path(folder).absolute()
    try:
        marker = json.loads((folder / MARKER).read_text())
        version = marker.get("format_version")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{folder / MARKER}: not a JSON object ({err})") from err
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{folder / MARKER}: format_version={version!r}; this djax reads {FORMAT_VERSION}"
        )
    _check_file_sizes(folder, marker.get("files"))
    target = restored_avals(config, dtype, shardings, weights)
    check_orbax(folder, target)
    as_stored = abstract_params(config, _stored_dtype(folder, marker, dtype), weights)
    stored = _stored_dtypes(target, as_stored)
    programs = compile_scans(target, stored)  # compiled while the params are read
    try:
        with _checkpointer() as reader:
            params = reader.restore(folder / PARAMS_DIR, args=ocp.args.StandardRestore(target))
    except Exception as err:  # tensorstore reports a damaged file in many ways
        raise CheckpointError(
            f"{folder / PARAMS_DIR}: cannot be read ({type(err).__name__}); the checkpoint is "
            "damaged: convert the model again"
        ) from err
    found, finite = _scanned(params, stored, programs)
    _check_fingerprints(folder, marker.get("fingerprints"), found, stored)
    bad = next((name for name, ok in finite.items() if not ok), None)
    if bad is not None:
        raise CheckpointError(
            f"{folder / PARAMS_DIR}: param {bad} holds NaN or inf values; expected finite weights"
        )
    return params


def restored_avals(
    config: ModelConfig, dtype: Any, shardings: dict | None = None, weights: str = "dtype"
) -> dict:
    """The params `restore_orbax` returns, as `jax.ShapeDtypeStruct`s with their shardings
    (`shardings`, or the first local device's)."""
    abstract = abstract_params(config, dtype, weights)
    default = SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        shardings if shardings else jax.tree.map(lambda _: default, abstract),
    )


def _stored_dtype(folder: Path, marker: dict, default: Any) -> Any:
    """The dtype `djax convert` stored the params in (`djax.json`'s `dtype`; `default`
    where a folder does not say): a floating dtype, else a CheckpointError naming it."""
    name = marker.get("dtype", jnp.dtype(default).name)
    try:
        dtype = jnp.dtype(name)
    except TypeError as err:
        raise CheckpointError(
            f"{folder / MARKER}: dtype={name!r} is not a dtype; convert the model again"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise CheckpointError(
            f"{folder / MARKER}: dtype={name!r}; expected the floating dtype the params are "
            "stored in (as djax convert writes it); convert the model again"
        )
    return dtype


def _stored_dtypes(params: dict, stored: dict) -> dict[str, Any]:
    """By name, the stored dtype of each param restored in another one (`stored`: the
    params' abstract tree as stored): the dtype its fingerprint is taken in, through a
    cast back that is exact where the restore widened (bf16 -> fp32); None where it
    narrowed (fp32 -> bf16: the stored bytes are gone, nothing to check)."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, a), s in zip(leaves, jax.tree.leaves(stored), strict=True):
        if a.dtype != s.dtype:
            widened = jnp.finfo(a.dtype).bits > jnp.finfo(s.dtype).bits
            out[_param_name(path)] = s.dtype if widened else None
    return out


def _check_fingerprints(
    folder: Path, expected: Any, found: dict[str, list[int]], stored: dict[str, Any]
) -> None:
    """The params' fingerprints `found` as `djax.json` records them (`expected`; None:
    nothing to check), else a CheckpointError naming the first that differs. Params
    restored narrower than stored (`stored[name]` None) are not compared."""
    if expected is None:
        return
    if not isinstance(expected, dict) or set(expected) != set(found):
        raise CheckpointError(
            f"{folder / MARKER}: its fingerprints do not name the checkpoint's params; "
            "convert the model again"
        )
    narrowed = {name for name, as_stored in stored.items() if as_stored is None}
    changed = next(
        (name for name in found if name not in narrowed and expected[name] != found[name]), None
    )
    if changed is not None:
        raise CheckpointError(
            f"{folder / PARAMS_DIR}: param {changed} holds other bytes than `djax convert` "
            "wrote (its fingerprint differs); the checkpoint is damaged: convert the model again"
        )


def _param_name(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")
