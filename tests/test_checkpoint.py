"""Loading errors: unsafe pickles, missing/unused/misshapen tensors, bad paths."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import djax
from djax.checkpoint import CheckpointError, SafetensorsStore


def _copy(folder, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    return out


def test_store_reads_slices_lazily(dense_folder):
    store = SafetensorsStore(dense_folder[0])
    full = store.view("model.transformer.blocks.0.q_proj.weight")
    assert isinstance(full, np.memmap) and not full.flags["OWNDATA"]  # a view: nothing read yet
    np.testing.assert_array_equal(np.asarray(full[2:5, 1:3]), np.asarray(full)[2:5, 1:3])


def test_pickle_refused_unless_opted_in(dense_folder, tmp_path):
    folder = _copy(dense_folder[0], tmp_path)
    tensors = _tensors(folder)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="Unpickling can run arbitrary code"):
        djax.load(folder)
    model = djax.load(folder, allow_pickle=True)
    assert model.params["embed"].shape == (128, 64)


def test_missing_unused_and_misshapen_tensors(dense_folder, tmp_path):
    folder = _copy(dense_folder[0], tmp_path)
    tensors = _tensors(folder)
    broken = dict(tensors)
    del broken["model.transformer.blocks.1.up_proj.weight"]
    save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match="1 tensors the config needs are missing.*blocks.1.up_proj"
    ):
        djax.load(folder)
    save_file(
        {
            **tensors,
            "model.transformer.blocks.9.q_proj.weight": tensors[
                "model.transformer.blocks.0.q_proj.weight"
            ],
        },
        str(folder / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match="1 tensors are not used.*blocks.9.q_proj"):
        djax.load(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mlp_hidden_size": 80}))
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match="param ff_0/gate_up .* has shape \\(64, 2, 96\\), "
        "config.json implies \\(64, 2, 80\\)",
    ):
        djax.load(folder)


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        djax.load(tmp_path / "nope")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LLaDAModelLM"],
                "d_model": 8,
                "n_layers": 1,
                "n_heads": 2,
                "vocab_size": 16,
                "mlp_hidden_size": 8,
                "eos_token_id": 1,
                "mask_token_id": 2,
            }
        )
    )
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        djax.load(tmp_path)


def test_save_hf_round_trip(dense_folder, dense_model, tmp_path):
    from djax.checkpoint import save_hf

    hf_config = json.loads((dense_folder[0] / "config.json").read_text())
    save_hf(tmp_path, dense_model.config, dense_model.params, hf_config)
    shutil.copy(dense_folder[0] / "tokenizer.json", tmp_path)
    original = SafetensorsStore(dense_folder[0])
    written = SafetensorsStore(tmp_path)
    assert sorted(written.names()) == sorted(original.names())
    for name in original.names():
        np.testing.assert_array_equal(
            np.asarray(written.view(name)), np.asarray(original.view(name))
        )


def test_fingerprints_see_changed_and_moved_values_and_not_the_layout():
    """A param's fingerprint changes with any one value (first sum) and with two values
    swapped (second sum), and is the same whole and split over devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from djax.checkpoint import fingerprints

    x = jax.random.normal(jax.random.key(0), (8, 6), jnp.bfloat16)
    base = fingerprints({"w": x})["w"]
    changed = fingerprints({"w": x.at[3, 2].add(1)})["w"]
    assert changed[0] != base[0]
    swapped = x.at[0, 0].set(x[5, 1]).at[5, 1].set(x[0, 0])
    assert fingerprints({"w": swapped})["w"][0] == base[0]
    assert fingerprints({"w": swapped})["w"][1] != base[1]
    # a value and its negation swapped 2**17 positions apart (sign bit 2**15)
    pair = jnp.zeros((64, 4096), jnp.bfloat16).at[0, 0].set(1.5).at[32, 0].set(-1.5)
    flipped = pair.at[0, 0].set(-1.5).at[32, 0].set(1.5)
    assert fingerprints({"w": pair})["w"] != fingerprints({"w": flipped})["w"]
    fp8 = x.astype(jnp.float8_e4m3fn)
    assert fingerprints({"v": fp8})["v"] != fingerprints({"v": fp8.at[1, 1].set(0)})["v"]
    if jax.device_count() >= 2:
        mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
        split = jax.device_put(x, NamedSharding(mesh, PartitionSpec("x", None)))
        assert fingerprints({"w": split})["w"] == base


def test_scans_compiled_ahead_are_the_jitted_scans():
    """`compile_scans`' programs (compiled from the abstract params before the read) give
    the fingerprints and finiteness of `_scan` itself; a param whose key was not compiled
    ahead (another shape) falls back to `_scan`."""
    import jax
    import jax.numpy as jnp

    from djax.checkpoint import _scanned, compile_scans

    key = jax.random.key(1)
    params = {
        "a": jax.random.normal(key, (8, 6), jnp.bfloat16).astype(jnp.float32),  # widened
        "b": {"c": jax.random.normal(key, (4, 128), jnp.bfloat16).astype(jnp.float8_e4m3fn)},
        "d": jnp.ones((3,), jnp.float32).at[1].set(jnp.nan),
    }
    stored = {"a": jnp.dtype(jnp.bfloat16)}
    ahead = {k: v for k, v in params.items() if k != "d"}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ahead
    )
    programs = compile_scans(abstract, stored)
    assert _scanned(params, stored, programs) == _scanned(params, stored)
    found, finite = _scanned(params, stored, programs)
    assert finite == {"a": True, "b/c": True, "d": False}


def test_converted_folder_without_fingerprints_still_loads(dense_folder, tmp_path):
    """A folder converted before fingerprints were recorded loads unchecked; a recorded
    set that does not name the params is refused."""
    import jax.numpy as jnp

    from djax import checkpoint

    out = tmp_path / "converted"
    djax.convert(dense_folder[0], out, jnp.float32, progress=False)
    marker = json.loads((out / checkpoint.MARKER).read_text())
    assert set(marker["fingerprints"]) >= {"embed", "attn_0/qkv"}
    del marker["fingerprints"]
    (out / checkpoint.MARKER).write_text(json.dumps(marker))
    assert djax.load(out, jnp.float32).params["embed"].dtype == jnp.float32
    marker["fingerprints"] = {"embed": [0, 0]}
    (out / checkpoint.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="fingerprints do not name the checkpoint's params"):
        djax.load(out, jnp.float32)


def test_fingerprints_are_checked_through_widening_loads(dense_folder, tmp_path):
    """A bf16 folder loaded as bf16 or fp32 (an exact cast back to bf16) has its recorded
    fingerprints checked; an fp32 folder loaded as bf16 cannot be (the stored bytes are
    not restored) and loads."""
    import jax.numpy as jnp

    from djax import checkpoint

    for stored, checked, unchecked in ((jnp.bfloat16, (jnp.bfloat16, jnp.float32), ()),
                                       (jnp.float32, (jnp.float32,), (jnp.bfloat16,))):  # fmt: skip
        out = tmp_path / jnp.dtype(stored).name
        djax.convert(dense_folder[0], out, stored, progress=False)
        marker = json.loads((out / checkpoint.MARKER).read_text())
        marker["fingerprints"]["embed"][1] ^= 1
        (out / checkpoint.MARKER).write_text(json.dumps(marker))
        for dtype in checked:
            with pytest.raises(CheckpointError, match="param embed holds other bytes"):
                djax.load(out, dtype)
        for dtype in unchecked:
            assert djax.load(out, dtype).params["embed"].dtype == dtype


def test_abstract_params_trace_once_and_hand_out_trees_of_their_own():
    import jax.numpy as jnp

    from bench.common import model_config
    from djax.models import _abstract_params, abstract_params

    config = model_config("dense", tiny=True)
    _abstract_params.cache_clear()
    first = abstract_params(config, jnp.float32)
    first.pop(next(iter(first)))  # a caller's change stays its own
    second = abstract_params(config, "float32")
    assert len(second) == len(first) + 1
    assert _abstract_params.cache_info().hits == 1


@pytest.mark.parametrize("name", ["dense", "moe", "llada2_mini"])
@pytest.mark.parametrize("weights", ["dtype", "fp8"])
def test_abstract_params_from_one_layer_of_each_kind_are_the_whole_model_s(name, weights):
    """Repeating one traced layer of each kind gives the tree the whole model's init
    traces, names, shapes and dtypes, at the full-size shapes (LLaDA2.0-mini: a dense
    first layer, then MoE layers)."""
    import jax
    import jax.numpy as jnp

    from bench.common import model_config
    from djax.models import _init, abstract_params

    config = model_config(name)
    got = abstract_params(config, jnp.bfloat16, weights)
    full = jax.eval_shape(lambda: _init(config, jnp.bfloat16, jax.random.key(0), weights))
    assert sorted(got) == sorted(full) and len(got) > 4 * config.n_layers
    described = jax.tree.map(lambda a: (a.shape, a.dtype), got)
    assert described == jax.tree.map(lambda a: (a.shape, a.dtype), full)


def test_a_tensor_in_two_files_is_refused_unless_an_index_places_it(tmp_path):
    """Two safetensors files holding one tensor name (a stale copy beside a checkpoint) are
    refused, naming both; with an index, the file it names is read and the other's copy
    left alone."""
    save_file(
        {"a": np.ones((2,), np.float32), "b": np.zeros((3,), np.float32)},
        tmp_path / "m.safetensors",
    )
    save_file({"a": np.full((2,), 7, np.float32)}, tmp_path / "stale.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'a' is also in .*m\.safetensors"):
        SafetensorsStore(tmp_path)
    index = {"weight_map": {"a": "m.safetensors", "b": "m.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    store = SafetensorsStore(tmp_path)
    np.testing.assert_array_equal(store.view("a"), np.ones((2,), np.float32))
    index["weight_map"]["a"] = "stale.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_array_equal(SafetensorsStore(tmp_path).view("a"), np.full((2,), 7))


# --- from a review of HF loading: files whose bytes or tensors djax read wrongly -----------

Q0 = "model.transformer.blocks.0.q_proj.weight"


@pytest.fixture(scope="module")
def dense_hf(tmp_path_factory):
    from torch_reference import make_llada_dense

    folder = tmp_path_factory.mktemp("dense_hf")
    make_llada_dense(folder, n_kv_heads=2, seed=1)
    return folder


def _as_bin(src, dst):
    """`src` copied to `dst` without its safetensors file; its tensors, for .bin files."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    return {k: torch.from_numpy(v) for k, v in tensors.items()}


def test_overlapping_safetensors_offsets_are_refused(dense_hf, tmp_path):
    """Two header entries over the same bytes (the safetensors library refuses the file):
    refused naming both, where ff_norm loaded attn_norm's bytes."""
    import struct

    folder = tmp_path / "m"
    shutil.copytree(dense_hf, folder)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    same = header["model.transformer.blocks.0.attn_norm.weight"]["data_offsets"]
    header["model.transformer.blocks.0.ff_norm.weight"]["data_offsets"] = same
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(CheckpointError, match="ff_norm.*share bytes|share bytes"):
        djax.load(folder)


def test_a_tensor_in_two_bin_files_is_refused(dense_hf, tmp_path):
    """A stale pytorch_model.bin beside the shards: refused naming the tensor and both
    files, as the safetensors reader does, where the file sorting last won silently."""
    folder = tmp_path / "m"
    tensors = _as_bin(dense_hf, folder)
    torch.save(tensors, folder / "pytorch_model-00001-of-00001.bin")
    torch.save({**tensors, Q0: torch.zeros_like(tensors[Q0])}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: tensor .* is also in"):
        djax.load(folder, allow_pickle=True)


@pytest.mark.parametrize("value", ["int", "fp8"])
def test_bin_values_djax_cannot_read_are_checkpoint_errors(dense_hf, tmp_path, value):
    """A .bin value that is not a float tensor is a CheckpointError naming the file and the
    tensor, where it was an AttributeError or torch's TypeError."""
    folder = tmp_path / "m"
    tensors = _as_bin(dense_hf, folder)
    bad = 3 if value == "int" else tensors[Q0].to(torch.float8_e4m3fn)
    torch.save({**tensors, Q0: bad}, folder / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match="pytorch_model.bin: 'model.transformer.blocks.0.q_proj"
    ):
        djax.load(folder, allow_pickle=True)
