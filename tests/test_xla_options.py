"""The engine's XLA compiler options and the DJAX_XLA_OPTIONS override."""

import dataclasses

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


def test_scaled_fp8_products_without_experts_compile_without_triton_gemms(monkeypatch):
    """On GPUs a program whose fp8 products XLA runs as fp8 x fp8 (`scaled`), in a model
    without experts, compiles with XLA's Triton GEMM fusions off; `dequant` (whose
    conversion only a Triton fusion folds into the product), bf16, MoE models and other
    platforms keep the defaults; programs without loops take no loop defaults;
    DJAX_XLA_OPTIONS still has the last word."""
    monkeypatch.delenv(xla_options.ENV, raising=False)
    gpu = xla_options.DEFAULTS["gpu"]
    scaled = xla_options.compiler_options("gpu", "scaled", experts=False)
    assert scaled == {**gpu, "xla_gpu_enable_triton_gemm": False}
    assert xla_options.compiler_options("gpu", "scaled", experts=True) == gpu
    assert xla_options.compiler_options("gpu", "dequant", experts=False) == gpu
    assert xla_options.compiler_options("gpu", "no", experts=False) == gpu
    assert xla_options.compiler_options("cpu", "scaled", experts=False) == {}
    one_forward = xla_options.compiler_options("gpu", "scaled", experts=False, loops=False)
    assert one_forward == {"xla_gpu_enable_triton_gemm": False}  # no loop graphs
    assert xla_options.compiler_options("gpu", loops=False) == {}
    monkeypatch.setenv(xla_options.ENV, "xla_gpu_enable_triton_gemm=true")
    assert xla_options.compiler_options("gpu", "scaled")["xla_gpu_enable_triton_gemm"] is True
    assert xla_options.compiler_options("gpu", loops=False) == {"xla_gpu_enable_triton_gemm": True}


def test_engine_options_follow_the_kernel_choice(dense_model, moe_model):
    """`engine.compiler_options` takes the fp8 path from the program's kernel choice and
    whether the model has expert layers (not only an expert count) from its config."""
    from djax import engine
    from djax.models.kernel_choice import ForwardKernels, KernelChoice, Kernels

    scaled = Kernels(fp8="scaled")
    scaled = KernelChoice(ForwardKernels(scaled, scaled), ForwardKernels(scaled, scaled), "fp8")
    assert scaled.xla_fp8 == "scaled" and KernelChoice.xla("fp8").xla_fp8 == "dequant"
    options = engine.compiler_options(dense_model, scaled, "gpu")
    assert options["xla_gpu_enable_triton_gemm"] is False
    for model, kernels in [
        (moe_model, scaled),  # expert layers
        (dense_model, KernelChoice.xla("fp8")),  # dequant
        (dense_model, KernelChoice()),  # bf16
    ]:
        assert "xla_gpu_enable_triton_gemm" not in engine.compiler_options(model, kernels, "gpu")
    no_expert_layers = dataclasses.replace(
        moe_model.config, moe_layers=(False,) * moe_model.config.n_layers
    )
    assert no_expert_layers.is_moe  # an expert count, no expert layer
    model = dataclasses.replace(moe_model, config=no_expert_layers)
    assert engine.compiler_options(model, scaled, "gpu")["xla_gpu_enable_triton_gemm"] is False


@pytest.mark.parametrize("platform", sorted(xla_options.DEFAULTS))
def test_defaults_are_options_this_jax_knows(platform):
    """XLA's debug options are shared by all backends: a CPU compile rejects a misspelt name
    or enum value that a GPU compile would."""
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    for options in (xla_options.DEFAULTS, xla_options.FP8_WITHOUT_EXPERTS):
        out = lowered.compile(options.get(platform, {}))(jnp.ones(3))
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


def test_phase_programs_compile_with_the_options(dense_model, monkeypatch):
    """The phase scheduler's programs take DJAX_XLA_OPTIONS as every other program does: an
    option XLA does not know fails its warm-up, named."""
    from djax.serving.engine import ServeConfig, make_engine
    from djax.serving.metrics import ServerMetrics

    config = ServeConfig(generation=CONFIG, scheduler="phase", max_batch=2, max_seq_len=32)
    engine = make_engine(dense_model, config, ServerMetrics())
    monkeypatch.setenv(xla_options.ENV, "xla_no_such_option=1")
    with pytest.raises(ValueError, match="DJAX_XLA_OPTIONS: .*xla_no_such_option"):
        engine._warm_up()


def test_program_key_holds_the_option_tables(dense_model, monkeypatch):
    """The in-process program key changes with djax's option tables (a bench swapping the
    fp8 rule) and with DJAX_XLA_OPTIONS, so no program compiled under other options is
    reused."""
    from djax import engine

    plan, _ = engine.make_plan(dense_model, CONFIG, 1, 3)
    args = engine.program_args(dense_model, plan, [[5, 6, 7]], CONFIG)
    key = engine.executable_key(dense_model, plan, args, engine.run_generation)
    platform = jax.default_backend()
    monkeypatch.setitem(xla_options.FP8_WITHOUT_EXPERTS, platform, {"xla_gpu_x": True})
    swapped = engine.executable_key(dense_model, plan, args, engine.run_generation)
    monkeypatch.setenv(xla_options.ENV, "xla_gpu_graph_min_graph_size=3")
    by_user = engine.executable_key(dense_model, plan, args, engine.run_generation)
    assert len({key, swapped, by_user}) == 3
