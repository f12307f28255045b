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
