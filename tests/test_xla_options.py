"""The engine's XLA compiler options and the DJAX_XLA_OPTIONS override."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax import xla_options

CONFIG = djax.GenerationConfig(gen_length=8, block_length=8, decoder="low_confidence")


def test_parse_types_values():
    parsed = xla_options.parse("xla_a=true xla_b=False xla_c=4 xla_d=X,Y xla_e=")
    assert parsed == {"xla_a": True, "xla_b": False, "xla_c": 4, "xla_d": "X,Y", "xla_e": ""}
    assert xla_options.parse("") == {}


@pytest.mark.parametrize("text", ["xla_gpu_thing", "gpu_thing=1", "=1"])
def test_parse_errors_name_the_item(text):
    with pytest.raises(ValueError, match=f"DJAX_XLA_OPTIONS: {text!r} is not name=value"):
        xla_options.parse(text)


def test_environment_overrides_the_defaults(monkeypatch):
    defaults = xla_options.compiler_options("gpu")
    assert defaults == xla_options.DEFAULTS["gpu"]
    monkeypatch.setenv(xla_options.ENV, "xla_gpu_graph_min_graph_size=7 xla_gpu_new=true")
    merged = xla_options.compiler_options("gpu")
    assert merged["xla_gpu_graph_min_graph_size"] == 7
    assert merged["xla_gpu_new"] is True
    assert merged["xla_gpu_enable_command_buffer"] == defaults["xla_gpu_enable_command_buffer"]


@pytest.mark.parametrize("platform", sorted(xla_options.DEFAULTS))
def test_defaults_are_options_this_jax_knows(platform):
    """XLA's debug options are shared by all backends: a CPU compile rejects a misspelt name
    or enum value that a GPU compile would."""
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    out = lowered.compile(xla_options.DEFAULTS[platform])(jnp.ones(3))
    np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])
    with pytest.raises(Exception, match="NOT_A_COMMAND"):
        lowered.compile({"xla_gpu_enable_command_buffer": "FUSION,NOT_A_COMMAND"})


def test_engine_compiles_with_the_options(dense_model, monkeypatch):
    prompt = [[5, 6, 7]]
    plain = djax.generate(dense_model, prompt, CONFIG)
    monkeypatch.setenv(xla_options.ENV, "xla_gpu_graph_min_graph_size=3")
    tuned = djax.generate(dense_model, prompt, CONFIG)
    assert tuned.stats.compile_seconds > 0  # a new option set is a new program
    np.testing.assert_array_equal(tuned.answer_ids, plain.answer_ids)
    monkeypatch.setenv(xla_options.ENV, "xla_no_such_option=1")
    with pytest.raises(Exception, match="xla_no_such_option"):
        djax.generate(dense_model, prompt, CONFIG)
