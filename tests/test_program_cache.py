"""Saved generation programs (`djax.program_cache`): read back instead of traced again, the
same tokens as the program lowered directly, and a new key for anything that changes."""

import os
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices

import djax
from djax import engine, program_cache, programs
from djax.diffusion import run_generation
from djax.sharding import make_mesh

CONFIG = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
ROWS = [[5, 6, 7, 8, 9, 10, 11, 12]]


def _setup(model, rows=ROWS, config=CONFIG):
    plan, _ = engine.make_plan(model, config, len(rows), max(map(len, rows)))
    return plan, programs.row_program(
        model, plan, run_generation, engine.kernel_choice(model, plan)
    )


def _tokens(lowered, model, plan, rows=ROWS, config=CONFIG):
    args = engine.program_args(model, plan, rows, config)  # fresh: the program donates rows
    return np.asarray(lowered.compile()(*args)["tokens"])


def _refuse_export(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the program was exported again")

    monkeypatch.setattr(jax.export, "export", refuse)


def _lower(model, plan, program, folder):
    args = engine.program_args(model, plan, ROWS, CONFIG)
    return program_cache.lower(program, args, ("test", plan), folder, donate_argnums=(1,))


def test_saved_program_is_read_back_with_the_same_tokens(dense_model, tmp_path, monkeypatch):
    plan, program = _setup(dense_model)
    direct = _tokens(
        program.lower(*engine.program_args(dense_model, plan, ROWS, CONFIG)), dense_model, plan
    )
    first = _lower(dense_model, plan, program, str(tmp_path))
    saved = list((tmp_path / program_cache.FOLDER).iterdir())
    assert len(saved) == 1 and saved[0].suffix == ".jax_exported"
    assert saved[0].stat().st_mode & 0o777 == 0o600  # private to the user
    assert saved[0].parent.stat().st_mode & 0o777 == 0o700
    _refuse_export(monkeypatch)
    second = _lower(dense_model, plan, program, str(tmp_path))
    np.testing.assert_array_equal(_tokens(first, dense_model, plan), direct)
    np.testing.assert_array_equal(_tokens(second, dense_model, plan), direct)


@pytest.mark.parametrize("folder", [None, "gs://bucket/xla"])
def test_no_or_remote_folder_lowers_directly(dense_model, monkeypatch, folder):
    plan, program = _setup(dense_model)
    _refuse_export(monkeypatch)
    lowered = _lower(dense_model, plan, program, folder)
    assert _tokens(lowered, dense_model, plan).shape == (1, plan.seq_len)


def test_engine_keys_programs_by_module_options(tmp_path, monkeypatch):
    """Two models differing only in an option never get each other's program: a bf16
    LLaDA-MoE whose experts run XLA's grouped path (saved) or djax's expert tiles (here in
    Mosaic GPU's interpreter, whose host callbacks cannot be exported: lowered directly,
    with a warning), both giving in-vocabulary tokens."""
    from torch_reference import make_llada_moe

    make_llada_moe(tmp_path / "moe", expert_hidden=64, dense_layers=(0,), seed=2)
    moe_model = djax.load(tmp_path / "moe", dtype=jnp.bfloat16)
    monkeypatch.setattr(engine, "programs_folder", lambda: str(tmp_path / "programs"))
    # one block of 2 steps (a refresh, then a block forward): the interpreted expert tiles'
    # runtime is most of this test's
    config = djax.GenerationConfig(
        gen_length=8, block_length=8, steps=2, decoder="low_confidence", cache="dual"
    )
    plan, _ = _setup(moe_model, config=config)
    tokens, texts = [], []
    for impl in ("xla", "mosaic"):
        model = moe_model.with_options(moe_impl=impl)
        args = engine.program_args(model, plan, ROWS, config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the interpreted kernels' export
            lowered = engine.lower(model, plan, args)
        texts.append(lowered.as_text())
        tokens.append(_tokens(lowered, model, plan, config=config))
    assert texts[0] != texts[1]  # the second did not read the first's saved program
    programs_saved = tmp_path / "programs" / program_cache.FOLDER
    assert len(list(programs_saved.glob("*.jax_exported"))) == 1
    for answer in tokens:
        assert answer.shape == tokens[0].shape
        assert ((answer >= 0) & (answer < moe_model.config.vocab_size)).all()


def test_export_failure_lowers_directly_and_warns(dense_model, tmp_path, monkeypatch):
    plan, program = _setup(dense_model)

    def fail(*args, **kwargs):
        raise NotImplementedError("no export for this program")

    monkeypatch.setattr(jax.export, "export", fail)
    with pytest.warns(UserWarning, match="cannot export the generation program"):
        lowered = _lower(dense_model, plan, program, str(tmp_path))
    assert not list((tmp_path / program_cache.FOLDER).glob("*"))
    assert _tokens(lowered, dense_model, plan).shape == (1, plan.seq_len)


def test_key_changes_with_description_and_shapes(dense_model):
    plan, _ = _setup(dense_model)
    args = engine.program_args(dense_model, plan, ROWS, CONFIG)
    key = program_cache.program_key(("test", plan), args)
    assert key == program_cache.program_key(("test", plan), args)
    assert key != program_cache.program_key(("other", plan), args)
    longer, _ = _setup(dense_model, config=djax.GenerationConfig(gen_length=24, block_length=8))
    assert key != program_cache.program_key(
        ("test", plan), engine.program_args(dense_model, longer, ROWS, CONFIG)
    )
    in_bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), dense_model.params)
    assert key != program_cache.program_key(("test", plan), (in_bf16, *args[1:]))


def test_unreadable_file_is_exported_again(dense_model, tmp_path):
    plan, program = _setup(dense_model)
    args = engine.program_args(dense_model, plan, ROWS, CONFIG)
    path = tmp_path / program_cache.FOLDER / f"{program_cache.program_key(('test', plan), args)}"
    path = path.with_suffix(".jax_exported")
    path.parent.mkdir()
    path.write_bytes(b"not an exported program")
    with pytest.warns(UserWarning, match="unreadable saved program"):
        lowered = _lower(dense_model, plan, program, str(tmp_path))
    assert jax.export.deserialize(bytearray(path.read_bytes())).in_avals
    direct = program.lower(*engine.program_args(dense_model, plan, ROWS, CONFIG))
    np.testing.assert_array_equal(
        _tokens(lowered, dense_model, plan), _tokens(direct, dense_model, plan)
    )


def test_unwritable_folder_warns_and_still_lowers(dense_model, tmp_path):
    plan, program = _setup(dense_model)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.warns(UserWarning, match="could not save the lowered program"):
        lowered = _lower(dense_model, plan, program, str(not_a_folder))
    assert not_a_folder.is_file()
    assert _tokens(lowered, dense_model, plan).shape == (1, plan.seq_len)


@needs_devices
def test_tensor_parallel_program_round_trips(dense_folder, dense_model, tmp_path, monkeypatch):
    sharded = djax.load(dense_folder[0], dtype=jnp.float32, mesh=make_mesh(tensor_parallel=2))
    plan, program = _setup(sharded)
    _lower(sharded, plan, program, str(tmp_path))
    _refuse_export(monkeypatch)
    read_back = _lower(sharded, plan, program, str(tmp_path))
    single = djax.generate(dense_model, ROWS, CONFIG)
    np.testing.assert_array_equal(
        _tokens(read_back, sharded, plan)[:, plan.prompt_len :], single.answer_ids
    )


def test_least_recently_used_programs_are_evicted(dense_model, tmp_path, monkeypatch):
    folder = tmp_path / program_cache.FOLDER
    folder.mkdir()
    for age, name in enumerate(["used", "unused"]):  # "unused" is the older by mtime
        path = folder / f"{name}{program_cache.SUFFIX}"
        path.write_bytes(bytes(1000))
        os.utime(path, ns=(0, 10**18 - age * 10**12))
    monkeypatch.setenv(program_cache.MAX_SIZE_VARIABLE, "1000000")
    plan, program = _setup(dense_model)
    _lower(dense_model, plan, program, str(tmp_path))
    (saved,) = (p for p in folder.iterdir() if p.stem not in ("used", "unused"))
    os.utime(saved, ns=(0, 1))  # the oldest, until it is read
    monkeypatch.setenv(program_cache.MAX_SIZE_VARIABLE, str(saved.stat().st_size + 1000))
    _lower(dense_model, plan, program, str(tmp_path))  # a read: `saved` is now the newest
    program_cache.evict(folder, program_cache.max_bytes())
    assert sorted(p.stem for p in folder.iterdir()) == sorted(["used", saved.stem])


@pytest.mark.parametrize(
    "value, size",
    [("", 2 * 1024**3), ("4096", 4096), ("512M", 512 * 1024**2), ("1.5GiB", 3 * 1024**3 // 2)],
)
def test_max_size_variable(monkeypatch, value, size):
    monkeypatch.setenv(program_cache.MAX_SIZE_VARIABLE, value)
    assert program_cache.max_bytes() == size


@pytest.mark.parametrize("value", ["lots", "-1G", "G", "inf", "nanM"])
def test_bad_max_size_is_refused(monkeypatch, value):
    monkeypatch.setenv(program_cache.MAX_SIZE_VARIABLE, value)
    with pytest.raises(ValueError, match=f"DJAX_COMPILE_CACHE_MAX_SIZE={value!r}; expected"):
        program_cache.max_bytes()


def test_undeserializable_program_is_deleted(dense_model, tmp_path, monkeypatch):
    plan, program = _setup(dense_model)
    _lower(dense_model, plan, program, str(tmp_path))
    (path,) = (tmp_path / program_cache.FOLDER).iterdir()
    path.write_bytes(path.read_bytes()[:100])

    def fail(*args, **kwargs):
        raise NotImplementedError("no export for this program")

    monkeypatch.setattr(jax.export, "export", fail)
    with pytest.warns(UserWarning) as caught:  # the program is lowered again, not saved
        _lower(dense_model, plan, program, str(tmp_path))
    messages = [str(w.message) for w in caught]
    assert any(re.search("unreadable saved program.*deleting it", m) for m in messages)
    assert any(m.startswith("cannot export the generation program") for m in messages)
    assert not path.exists()


def test_compile_cache_folder_is_private_and_capped(tmp_path, monkeypatch):
    monkeypatch.setenv(program_cache.MAX_SIZE_VARIABLE, "1M")
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size
    folder = tmp_path / "cache" / "xla"
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        engine.enable_compile_cache(str(folder))
        assert jax.config.jax_compilation_cache_dir == str(folder)
        assert jax.config.jax_compilation_cache_max_size == 1024**2
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_compilation_cache_max_size", previous[1])
    assert folder.stat().st_mode & 0o777 == 0o700


def test_a_test_may_turn_the_compile_cache_on(tmp_path):
    """An in-process bench run turns JAX's persistent compilation cache on for its
    process; the suite's fixture (`_no_compile_cache_left_behind`) turns it off after the
    test, which the next test checks."""
    assert jax.config.jax_compilation_cache_dir is None
    engine.enable_compile_cache(str(tmp_path / "xla"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")


def test_the_next_test_finds_the_compile_cache_off():
    assert jax.config.jax_compilation_cache_dir is None


def test_a_read_only_cache_is_read_and_an_undeletable_program_is_left(
    dense_model, tmp_path, monkeypatch
):
    """A saved program is read back where its use cannot be recorded (a read-only folder:
    `os.utime` refused), with no warning and no export; a damaged one that cannot be
    deleted is left with a warning, and the program is exported again, not failed."""
    plan, program = _setup(dense_model)
    _lower(dense_model, plan, program, str(tmp_path))
    (path,) = (tmp_path / program_cache.FOLDER).iterdir()

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    with monkeypatch.context() as refusing, warnings.catch_warnings():
        warnings.simplefilter("error")
        _refuse_export(refusing)
        _lower(dense_model, plan, program, str(tmp_path))
    path.write_bytes(path.read_bytes()[:100])
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: read_only())
    with pytest.warns(UserWarning) as caught:
        lowered = _lower(dense_model, plan, program, str(tmp_path))
    assert any("cannot delete the saved program" in str(w.message) for w in caught)
    assert _tokens(lowered, dense_model, plan).shape == (1, plan.seq_len)


def test_the_in_process_key_follows_jax_config(dense_model):
    """A `jax.config` value a traced program may depend on (here the PRNG's partitioning,
    which changes sampled tokens) is part of the in-process executable's key, as of the
    saved program's."""
    plan, _ = _setup(dense_model)
    args = engine.program_args(dense_model, plan, ROWS, CONFIG)
    before = engine.executable_key(dense_model, plan, args, run_generation)
    flag = jax.config.jax_threefry_partitionable
    try:
        jax.config.update("jax_threefry_partitionable", not flag)
        after = engine.executable_key(dense_model, plan, args, run_generation)
    finally:
        jax.config.update("jax_threefry_partitionable", flag)
    assert before != after
    assert engine.executable_key(dense_model, plan, args, run_generation) == before
