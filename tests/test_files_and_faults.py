"""Bad files and interrupted writes: every malformed model folder, unsafe `convert` and
interrupt ends in one clear error (or exit status) and changes no user file."""

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import djax
from djax import checkpoint, folders
from djax.checkpoint import CheckpointError, SafetensorsStore
from djax.cli import main
from djax.config import ConfigError
from djax.demo import MODEL_DIR

ROOT = Path(__file__).parents[1]
WEIGHTS = "model.safetensors"
Q_PROJ = "model.transformer.blocks.0.q_proj.weight"


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file and link under `folder` (hidden ones too), by relative path."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The demo model converted once (float32): a pristine copy for the rows to damage."""
    out = tmp_path_factory.mktemp("converted") / "model"
    djax.convert(MODEL_DIR, out, jnp.float32, progress=False)
    return out


def _rewrite(folder: Path, change) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS))


def _header_length(folder: Path) -> int:
    return struct.unpack("<Q", (folder / WEIGHTS).read_bytes()[:8])[0]


# Each setup gets a folder holding `model` (a copy of the demo) and `old` (a converted
# model an `--overwrite` would replace), damages what its row needs, and returns the argv.
def same(root):
    return ["convert", root / "model", root / "model", "--overwrite"]


def parent(root):
    return ["convert", root / "model", root, "--overwrite"]


def inside(root):
    return ["convert", root / "model", root / "model" / "out", "--overwrite"]


def alias(root):
    (root / "alias").symlink_to(root / "model")
    return ["convert", root / "model", root / "alias", "--overwrite"]


def missing_source(root):
    return ["convert", root / "mistyped", root / "old", "--overwrite"]


def not_empty(root):
    return ["convert", root / "model", root / "old"]


def parent_is_a_file(root):
    (root / "file").write_text("")
    return ["convert", root / "model", root / "file" / "out"]


def read_only_destination(root):
    """sysfs takes no new folders, even from root (who writes into 0555 folders)."""
    return ["convert", root / "model", "/sys/djax-converted"]


def generate(root):
    return ["generate", "--model", root / "model", "--prompt", "1+2="]


def empty_file(root):
    (root / "model" / WEIGHTS).write_bytes(b"")
    return generate(root)


def four_bytes(root):
    (root / "model" / WEIGHTS).write_bytes(b"\x10\x00\x00\x00")
    return generate(root)


def random_bytes(root):
    (root / "model" / WEIGHTS).write_bytes(np.random.default_rng(0).bytes(4096))
    return generate(root)


def absurd_header_length(root):
    path = root / "model" / WEIGHTS
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])
    return generate(root)


def file_cut_in_header(root):
    path = root / "model" / WEIGHTS
    path.write_bytes(path.read_bytes()[: 8 + _header_length(root / "model") // 2])
    return generate(root)


def json_cut(root):
    path = root / "model" / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", _header_length(root / "model") // 2) + data[8:])
    return generate(root)


def truncated_shard(root):
    path = root / "model" / WEIGHTS
    path.write_bytes(path.read_bytes()[:-1000])
    return generate(root)


def bad_offsets(root):
    path = root / "model" / WEIGHTS
    data = path.read_bytes()
    size = _header_length(root / "model")
    header = json.loads(data[8 : 8 + size])
    header[Q_PROJ]["data_offsets"][1] -= 2
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    path.write_bytes(data[:8] + text + data[8 + size :])
    return generate(root)


def missing_tensor(root):
    _rewrite(root / "model", lambda t: t.pop(Q_PROJ))
    return generate(root)


def wrong_shape(root):
    _rewrite(root / "model", lambda t: t.update({Q_PROJ: t[Q_PROJ][:, :-1].copy()}))
    return generate(root)


def wrong_dtype(root):
    _rewrite(root / "model", lambda t: t.update({Q_PROJ: t[Q_PROJ].astype(np.int32)}))
    return generate(root)


def nan_weights(root):
    def poison(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].astype(np.float32)
        tensors[Q_PROJ][3, 4] = np.nan

    _rewrite(root / "model", poison)
    return generate(root)


def bad_index(root):
    (root / "model" / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    return generate(root)


def index_leaves_folder(root):
    index = {"weight_map": {Q_PROJ: "../model/model.safetensors"}}
    (root / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    return generate(root)


def truncated_orbax(root):
    largest = max((root / "old").rglob("*"), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    return ["generate", "--model", root / "old", "--prompt", "1+2="]


def _forget_file_sizes(folder: Path) -> None:
    """What a folder converted before djax recorded its files' sizes looks like."""
    marker = json.loads((folder / checkpoint.MARKER).read_text())
    del marker["files"]
    (folder / checkpoint.MARKER).write_text(json.dumps(marker))


def integer_marker_dtype(root):
    """djax.json edited by hand to a dtype no params are stored in."""
    marker = json.loads((root / "old" / checkpoint.MARKER).read_text())
    marker["dtype"] = "int8"
    (root / "old" / checkpoint.MARKER).write_text(json.dumps(marker))
    return ["generate", "--model", root / "old", "--prompt", "1+2="]


def damaged_orbax(root):
    """Same sizes, other bytes: found only by reading."""
    _forget_file_sizes(root / "old")
    largest = max((root / "old").rglob("*"), key=lambda p: p.stat().st_size)
    largest.write_bytes(bytes(largest.stat().st_size))
    return ["generate", "--model", root / "old", "--prompt", "1+2="]


def zeroed_manifest(root):
    """Same size, zero bytes: the OCDBT manifest every array of the checkpoint opens."""
    manifest = root / "old" / checkpoint.PARAMS_DIR / "manifest.ocdbt"
    manifest.write_bytes(bytes(manifest.stat().st_size))
    return ["generate", "--model", root / "old", "--prompt", "hi"]


def zeroed_array_metadatas(root):
    """Same size, zero bytes: the arrays' metadata orbax reads only as it restores them."""
    (part,) = (root / "old" / checkpoint.PARAMS_DIR / "array_metadatas").iterdir()
    part.write_bytes(bytes(part.stat().st_size))
    return ["generate", "--model", root / "old", "--prompt", "hi"]


def orbax_without_metadata(root):
    _forget_file_sizes(root / "old")
    shutil.rmtree(root / "old" / checkpoint.PARAMS_DIR / "ocdbt.process_0")
    for name in ("_METADATA", "manifest.ocdbt"):
        (root / "old" / checkpoint.PARAMS_DIR / name).unlink(missing_ok=True)
    return ["generate", "--model", root / "old", "--prompt", "1+2="]


def leftover_staging(root):
    """What a convert killed by SIGKILL leaves: weights written, no djax.json yet."""
    leftover = root / ".old.djax-staging-0badc0de"
    shutil.copytree(root / "old", leftover)
    (leftover / checkpoint.MARKER).unlink()
    return ["generate", "--model", leftover, "--prompt", "1+2="]


def leftover_orbax_tmp(root):
    (root / "old" / checkpoint.MARKER).unlink()
    (root / "old" / checkpoint.PARAMS_DIR).rename(
        root / "old" / f"{checkpoint.PARAMS_DIR}.orbax-checkpoint-tmp-1234"
    )
    return ["generate", "--model", root / "old", "--prompt", "1+2="]


def bad_generation_config(root):
    (root / "model" / "generation_config.json").write_text('{"gen_length": -4}')
    return generate(root)


def bad_generation_config_converted(root):
    (root / "model" / "generation_config.json").write_text('{"gen_length": -4}')
    return ["convert", root / "model", root / "new"]


def damaged_tokenizer(root):
    (root / "model" / "tokenizer.json").write_text("{}")
    return generate(root)


def bad_demo_record(root):
    (root / "model" / "demo.json").write_text("{")
    return generate(root)


ROWS = [
    (same, ValueError, "is the source folder"),
    (parent, ValueError, "holds the source folder"),
    (inside, ValueError, "lies inside the source folder"),
    (alias, ValueError, "is the source folder"),
    (missing_source, FileNotFoundError, "mistyped' is not a folder"),
    (not_empty, FileExistsError, "is not empty"),
    (parent_is_a_file, PermissionError, "cannot write beside"),
    (read_only_destination, PermissionError, "djax-converted': Operation not permitted in '/sys'"),
    (empty_file, CheckpointError, "model.safetensors: 0 bytes, too short"),
    (four_bytes, CheckpointError, "model.safetensors: 4 bytes, too short"),
    (random_bytes, CheckpointError, "model.safetensors: header length"),
    (absurd_header_length, CheckpointError, "header length 4611686018427387904 bytes"),
    (file_cut_in_header, CheckpointError, "model.safetensors: header length .* truncated"),
    (json_cut, CheckpointError, "model.safetensors: header is not valid UTF-8 JSON"),
    (truncated_shard, CheckpointError, "ends at byte .* data bytes \\(truncated"),
    (bad_offsets, CheckpointError, "q_proj.weight' spans 51198 bytes; .* needs 51200"),
    (missing_tensor, CheckpointError, "missing, e.g. \\['model.transformer.blocks.0.q_proj"),
    (
        wrong_shape,
        CheckpointError,
        "q_proj.weight. has shape \\(160, 159\\); expected \\(160, 160\\)",
    ),
    (wrong_dtype, CheckpointError, "q_proj.weight' has dtype int32; expected floating"),
    (nan_weights, CheckpointError, "tensor '.*q_proj.weight' holds NaN or inf values"),
    (bad_index, CheckpointError, "index.json: not a JSON object with a 'weight_map'"),
    (index_leaves_folder, CheckpointError, "names the file '../model/model.safetensors'"),
    (truncated_orbax, CheckpointError, "djax_params/.*: \\d+ bytes; djax.json records \\d+"),
    (damaged_orbax, CheckpointError, "djax_params: param .* holds other bytes"),
    (integer_marker_dtype, CheckpointError, "djax.json: dtype='int8'; expected the floating"),
    (orbax_without_metadata, CheckpointError, "djax_params: not a readable orbax checkpoint"),
    (zeroed_manifest, CheckpointError, "djax_params: not a readable orbax .*manifest.ocdbt"),
    (
        zeroed_array_metadatas,
        CheckpointError,
        "djax_params: not a readable orbax .*process_0 in array_metadatas",
    ),
    (leftover_staging, CheckpointError, "unfinished `djax convert` output"),
    (leftover_orbax_tmp, CheckpointError, "unfinished `djax convert` output"),
    (bad_generation_config, ConfigError, "generation_config.json: gen_length=-4"),
    (bad_demo_record, ConfigError, "demo.json: not valid JSON"),
    (bad_generation_config_converted, ConfigError, "generation_config.json: gen_length=-4"),
    (damaged_tokenizer, ConfigError, "its tokenizer files .* cannot be read: KeyError"),
]


@pytest.fixture
def root(tmp_path, converted):
    shutil.copytree(MODEL_DIR, tmp_path / "model")
    shutil.copytree(converted, tmp_path / "old")
    return tmp_path


def _call(argv):
    """The API call a CLI row stands for."""
    if argv[0] == "convert":
        return djax.convert(argv[1], argv[2], overwrite="--overwrite" in argv, progress=False)
    djax.demo.describe(argv[2])
    djax.load(argv[2])
    return djax.generation.generation_defaults(argv[2])


@pytest.mark.parametrize("setup, error, message", ROWS, ids=[r[0].__name__ for r in ROWS])
def test_bad_input_via_api(root, setup, error, message):
    argv = setup(root)
    before = tree_digest(root)
    with pytest.raises(error, match=message):
        _call(argv)
    assert tree_digest(root) == before


@pytest.mark.parametrize("setup, error, message", ROWS, ids=[r[0].__name__ for r in ROWS])
def test_bad_input_via_cli(root, setup, error, message, capsys):
    argv = [str(a) for a in setup(root)]
    before = tree_digest(root)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("djax: error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert tree_digest(root) == before


def _run_cli(argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "djax.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


def test_cli_errors_print_no_traceback(root):
    """One row through a real process: what a user sees on the terminal."""
    run = _run_cli(truncated_shard(root))
    assert run.returncode == 2
    assert run.stderr.startswith("djax: error: ") and "Traceback" not in run.stderr


@pytest.mark.parametrize("damage", [zeroed_manifest, zeroed_array_metadatas])
def test_a_damaged_orbax_database_prints_only_the_error(root, damage):
    """Through a real process, up to its exit: no thread of orbax or tensorstore reports
    the failed read after djax has reported it."""
    run = _run_cli(damage(root))
    assert run.returncode == 2
    assert run.stderr.startswith("djax: error: ") and len(run.stderr.splitlines()) == 1, run.stderr
    assert "not a readable orbax checkpoint" in run.stderr
    assert "convert the model again" in run.stderr
    assert "Traceback" not in run.stderr and "Event loop is closed" not in run.stderr


def test_unwritable_destination_is_refused_before_loading(root, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the destination was checked")

    monkeypatch.setattr(djax.model, "load", no_loading)
    (root / "file").write_text("")
    with pytest.raises(PermissionError, match="cannot write beside"):
        djax.convert(root / "model", root / "file" / "out")
    if os.geteuid() != 0:  # root writes into read-only folders
        (root / "locked").mkdir(mode=0o555)
        with pytest.raises(PermissionError, match="Permission denied"):
            djax.convert(root / "model", root / "locked" / "out")


def test_convert_names_what_a_killed_convert_left(root, caplog):
    (root / ".new.djax-staging-0a1b2c3d").mkdir()
    djax.convert(root / "model", root / "new", jnp.float32, progress=False)
    assert ".new.djax-staging-0a1b2c3d; delete them" in caplog.text
    assert (root / ".new.djax-staging-0a1b2c3d").is_dir()  # named, never deleted


def test_overwrite_replaces_only_a_folder_convert_wrote(root):
    """--overwrite onto a folder of the user's own (no djax.json) is refused, untouched."""
    mine = root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    before = tree_digest(root)
    with pytest.raises(FileExistsError, match="is not a folder djax convert wrote"):
        djax.convert(root / "model", mine, overwrite=True, progress=False)
    assert main(["convert", str(root / "model"), str(mine), "--overwrite", "-q"]) == 2
    assert tree_digest(root) == before


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "djax.json").write_text('{"my": "settings"}'),  # a marker of its own
        lambda d: (d / "train.py").write_text("precious"),  # beside what convert wrote
    ],
)
def test_overwrite_needs_what_convert_wrote_and_nothing_else(root, change):
    """A folder merely holding a file named djax.json, or a converted folder holding a file
    of the user's own, is refused under --overwrite, untouched."""
    change(root / "old")
    before = tree_digest(root)
    with pytest.raises(FileExistsError, match="is not a folder djax convert wrote"):
        djax.convert(root / "model", root / "old", overwrite=True, progress=False)
    assert tree_digest(root) == before


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_what_appears_during_a_convert_is_never_deleted(root, monkeypatch, overwrite, kind):
    """The destination is checked before the load; a folder (or a file) of the user's own
    that appears there meanwhile (or a second convert's) is refused at the rename,
    untouched, and the staging folder is removed."""
    dst = root / "new"
    save = checkpoint.save_orbax

    def appearing(folder, params, metadata):
        if kind == "folder":
            dst.mkdir()
            (dst / "notes.txt").write_text("precious")
        else:
            dst.write_text("precious")
        return save(folder, params, metadata)

    monkeypatch.setattr(checkpoint, "save_orbax", appearing)
    with pytest.raises(FileExistsError, match="left as it is"):
        djax.convert(root / "model", dst, jnp.float32, overwrite=overwrite, progress=False)
    kept = dst / "notes.txt" if kind == "folder" else dst
    assert kept.read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == ["model", "new", "old"]  # no staging


@pytest.mark.parametrize("name", ["runs[1]", "a*b", "q?"])
def test_a_destination_path_orbax_would_read_as_a_pattern_is_refused(root, name, monkeypatch):
    """orbax's save globs its folder: '[', ']', '*' or '?' in the destination's path made it
    fail after the whole load; refused first, naming the characters."""

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the destination was checked")

    monkeypatch.setattr(djax.model, "load", no_loading)
    with pytest.raises(ValueError, match="reads as a file pattern"):
        djax.convert(root / "model", root / name / "demo", progress=False)
    assert not (root / name).exists()


def test_overwrite_replaces_only_after_the_new_folder_is_complete(root, monkeypatch):
    before = tree_digest(root / "old")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "check_orbax", fail)
    with pytest.raises(OSError, match="disk full"):
        djax.convert(root / "model", root / "old", overwrite=True, progress=False)
    assert tree_digest(root / "old") == before
    assert sorted(p.name for p in root.iterdir()) == ["model", "old"]  # no staging left
    monkeypatch.undo()
    djax.convert(root / "model", root / "old", jnp.float32, overwrite=True, progress=False)
    assert sorted(p.name for p in root.iterdir()) == ["model", "old"]  # no old copy left
    assert json.loads((root / "old" / "djax.json").read_text())["dtype"] == "float32"


def test_converted_demo_keeps_its_generation_defaults(converted):
    assert (converted / "generation_config.json").is_file()
    assert djax.generation.generation_defaults(converted) == {"gen_length": 32, "block_length": 8}
    assert djax.demo.generation_defaults(converted) == djax.demo.generation_defaults()
    assert djax.demo.describe(converted) == djax.demo.describe()


def test_converted_demo_answers_like_the_original(converted, capsys):
    outputs = []
    for folder in (MODEL_DIR, converted):
        assert main(["generate", "--model", str(folder), "--json", "--dtype", "float32"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["texts"] == outputs[1]["texts"]
    assert outputs[0]["texts"][0] == "3305"


def test_nan_in_a_converted_checkpoint_is_named(converted, tmp_path):
    model = djax.load(converted, jnp.float32)
    params = dict(model.params)
    params["embed"] = params["embed"].at[5, 7].set(jnp.inf)
    folder = tmp_path / "poisoned"
    shutil.copytree(converted, folder, ignore=shutil.ignore_patterns(checkpoint.PARAMS_DIR))
    (folder / checkpoint.MARKER).unlink()
    checkpoint.save_orbax(folder, params, {})
    with pytest.raises(CheckpointError, match="param embed holds NaN or inf values"):
        djax.load(folder)


# SIGTERM; SIGINT goes through the same handler in test_cli's stopped generate.
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143)])
def test_interrupted_convert_leaves_the_destination_as_it_was(root, signum, status):
    before = tree_digest(root)
    convert = subprocess.Popen(
        [sys.executable, "-m", "djax.cli", "convert", "model", "old", "--overwrite"],
        cwd=root,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 60
    while not list(root.glob(".old.djax-staging-*")) and convert.poll() is None:
        assert time.monotonic() < deadline, "convert never started writing"
        time.sleep(0.002)
    convert.send_signal(signum)
    start = time.monotonic()
    _, err = convert.communicate(timeout=60)
    assert time.monotonic() - start < 10
    assert convert.returncode == status, err
    assert "Traceback" not in err and "Error" not in err
    assert tree_digest(root) == before  # no staging folder left, `old` untouched


@pytest.mark.parametrize(
    "signum, raised", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)]
)
def test_a_stop_whose_exception_was_lost_still_stops_the_replace(tmp_path, signum, raised):
    """Python drops an exception a signal handler raises inside a garbage-collector
    callback (as jax's runs): the stop is noted all the same, and `folders.replace` raises
    it instead of replacing the destination."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old").write_text("kept")
    with pytest.raises(raised), folders.staged(dst) as staging:
        (staging / "new").write_text("half")
        with contextlib.suppress(BaseException):  # as a callback that swallows it runs it
            signal.getsignal(signum)(signum, None)
        folders.replace(staging, dst)
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]  # no staging folder left
    assert (dst / "old").read_text() == "kept" and not (dst / "new").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers put back


# Property tests: whatever bytes a file holds, loading ends in a clear error.
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(st.binary(max_size=512))
def test_random_config_json_is_a_config_error(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("fuzz_config")
    shutil.copy(MODEL_DIR / WEIGHTS, folder / WEIGHTS)
    (folder / "config.json").write_bytes(data)
    with pytest.raises(ConfigError, match="config.json"):
        djax.load(folder)


DEMO_CONFIG = json.loads((MODEL_DIR / "config.json").read_text())


def test_random_config_values_are_config_errors():
    """Every key of the demo's config.json set to values of the wrong type or range."""
    values = [None, "x", -1, 0, 1.5, True, [], {}, [[1]], 10**30]
    for key in DEMO_CONFIG:
        for value in values:
            try:
                djax.config.from_hf_dict(DEMO_CONFIG | {key: value})
            except ConfigError as err:
                assert "config.json" in str(err)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_theta": -1.0}, "rope_theta=-1.0; expected a finite number > 0"),
        ({"rms_norm_eps": -5.0}, "rms_norm_eps=-5.0; expected a finite number > 0"),
        ({"mask_token_id": True}, "'mask_token_id'=True should be an integer id"),
    ],
)
def test_config_values_a_model_cannot_run_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        djax.config.from_hf_dict(DEMO_CONFIG | change)


def test_a_mask_id_that_is_the_eos_id_is_refused(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder)
    eos = djax.load(MODEL_DIR).config.eos_token_id
    (folder / "config.json").write_text(json.dumps(DEMO_CONFIG | {"mask_token_id": eos}))
    with pytest.raises(ConfigError, match=f"mask_token_id={eos} is also the EOS or padding id"):
        djax.load(folder)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "I8", "F99", 3, ["F32"]]),
        "shape": st.lists(st.integers(-2, 6), max_size=3) | JSON,
        "data_offsets": st.lists(st.integers(-4, 300), min_size=0, max_size=3) | JSON,
    }
)
HEADER = st.dictionaries(st.text(max_size=6), ENTRY | JSON, max_size=4).map(
    lambda h: json.dumps(h).encode()
)


@FUZZ
@given(st.binary(max_size=256) | HEADER, st.integers(0, 256), st.booleans())
def test_random_safetensors_header_is_a_checkpoint_error_or_valid(
    tmp_path_factory, header, data_size, honest_length
):
    folder = tmp_path_factory.mktemp("fuzz_header")
    length = len(header) if honest_length else int.from_bytes(header[:8].ljust(8, b"\0"), "little")
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", length) + header + bytes(data_size))
    try:
        store = SafetensorsStore(folder)
    except CheckpointError as err:
        assert str(folder / WEIGHTS) in str(err)
        return
    for name in store.names():  # what was accepted lies inside the file, as declared
        view = store.view(name)
        assert view.nbytes == math.prod(view.shape) * view.dtype.itemsize
        np.asarray(view).sum()


def test_damaged_pickle_is_a_checkpoint_error(tmp_path):
    shutil.copy(MODEL_DIR / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip archive")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: not a readable torch"):
        djax.load(tmp_path, allow_pickle=True)


def test_bf16_tensors_are_read_as_stored():
    store = SafetensorsStore(MODEL_DIR)
    view = store.view(Q_PROJ)
    assert view.dtype == ml_dtypes.bfloat16 and view.shape == (160, 160)
    assert isinstance(view, np.memmap)
