"""fp8 weights (`djax.models.fp8`): e4m3 round trips, the kernel choice under fp8, fp8
generation against the model's own dtype (demo model, tiny LLaDA-MoE), convert -> load,
sharded layouts, and the errors a user can cause."""

import dataclasses
import json
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import needs_devices
from jax.sharding import NamedSharding
from test_kernel_choice import GENERATION, HOPPER, LLADA_8B, LLADA_MOE

import djax
from djax import checkpoint
from djax import model as model_lib
from djax.checkpoint import CheckpointError
from djax.cli import build_parser, main
from djax.config import ConfigError
from djax.demo import default_model_path, task
from djax.kernel_options import KernelOptions
from djax.kernels import fp8_matmul_mosaic
from djax.models import fp8
from djax.models.kernel_choice import Device, resolve
from djax.models.llada_moe import experts_dense, experts_grouped, ragged_mlp
from djax.sharding import make_mesh, param_specs

from llada2_reference import make_llada2
from torch_reference import rel_error

# e4m3's relative rounding error: half a unit of its 3-bit mantissa (normal values), and the
# absolute one of its subnormals (below 2^-6), both in units of the channel's scale.
E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10
# Measured on the CPU (fp32 compute), relative L2 error of the logits against the fp32
# weights' and the share of equal argmaxes: the demo model on 16 held-out prompts with a
# masked answer, 2.0% and 98% of the masked positions (dequant), 3.0% and 97% (scaled); the
# tiny random LLaDA-MoE (3 layers, 8 experts top-2) on random ids, 8.4% and 94% (dequant),
# 10.3% and 90% (scaled): its routing flips where expert scores nearly tie. The bounds
# leave ~1.5x; the agreement bounds a few points.
DEMO_LOGITS_BOUND = {"dequant": 0.03, "scaled": 0.045}
MOE_BOUNDS = {"dequant": (0.12, 0.9), "scaled": (0.15, 0.85)}
FP8_NAMES = {"qkv", "attn_out", "gate_up", "down", "lm_head"}


def _weights(shape, axes, seed=0):
    """Weights whose channels span many magnitudes, one channel all zero."""
    rng = np.random.default_rng(seed)
    out_shape = [n for i, n in enumerate(shape) if i not in axes]
    magnitude = 10.0 ** rng.uniform(-6, 3, out_shape)
    w = rng.standard_normal(shape) * np.expand_dims(magnitude, axes)
    index = (slice(None),) * min(a for a in range(len(shape)) if a not in axes) + (0,)
    w[index] = 0  # the first output channel
    return w.astype(np.float32)


@pytest.mark.parametrize(
    "shape, axes",
    [((64, 3, 4, 8), (0,)), ((3, 4, 8, 64), (0, 1, 2)), ((5, 64, 2, 16), (1,)), ((64, 24), (0,))],
)
def test_round_trip_is_within_e4m3_precision(shape, axes):
    w = _weights(shape, axes)
    values, scale = fp8.quantize(jnp.asarray(w), axes)
    assert values.dtype == jnp.float8_e4m3fn and values.shape == w.shape
    assert scale.dtype == jnp.float32 and scale.shape == tuple(
        n for i, n in enumerate(shape) if i not in axes
    )
    back = np.asarray(fp8.dequantize(values, scale, axes, jnp.float32))
    s = np.expand_dims(np.asarray(scale), axes)
    bound = np.maximum(E4M3_RELATIVE * np.abs(w), E4M3_SUBNORMAL_ABS * s)
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
    # Each channel's largest value lands on e4m3's largest, 448; a zero channel stays zero.
    peak = np.max(np.abs(np.asarray(values, np.float32)), axis=axes)
    zero = np.max(np.abs(w), axis=axes) == 0
    np.testing.assert_array_equal(peak[~zero], 448.0)
    assert np.all(back[np.broadcast_to(np.expand_dims(zero, axes), w.shape)] == 0)


def test_channels_of_tiny_weights_quantise_without_nan():
    """A channel whose largest |w| is far below fp32's normal range over 448 (a scale that
    would be subnormal, which XLA flushes to 0) takes the least normal scale: no NaN or inf
    values, and its weights come back within e4m3's precision of that scale."""
    w = jnp.asarray(np.array([[1e-36, 0.0, -3e-37], [0.5, -1.0, 0.25]], np.float32).T)
    values, scale = fp8.quantize(w, (0,))
    assert np.asarray(scale)[0] == fp8_matmul_mosaic.MIN_SCALE
    assert np.isfinite(np.asarray(values, np.float32)).all()
    back = np.asarray(fp8.dequantize(values, scale, (0,), jnp.float32))
    assert back[1, 0] == 0.0
    np.testing.assert_allclose(back[:, 0], np.asarray(w)[:, 0], rtol=0.07)
    np.testing.assert_allclose(back[:, 1], np.asarray(w)[:, 1], rtol=0.07)


def test_quantize_params_keeps_embeddings_norms_and_router(moe_model):
    params = fp8.quantize_params(moe_model.params)
    flat = {
        jax.tree_util.keystr(k, simple=True, separator="/"): a
        for k, a in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    quantised = {name for name, a in flat.items() if a.dtype == jnp.float8_e4m3fn}
    assert quantised and {name.rsplit("/", 1)[-1] for name in quantised} == FP8_NAMES
    for name in quantised:
        assert flat[name + "_scale"].dtype == jnp.float32
    # the head: a scale per vocabulary entry
    assert flat["lm_head_scale"].shape == (moe_model.config.vocab_size,)
    for kept in ("embed", "final_norm/scale", "ff_1/router", "attn_0/q_norm/scale"):
        assert flat[kept].dtype == jnp.float32


def test_kernel_choice_takes_xla_products_under_fp8():
    """Under `fp8_impl="scaled"` (and `auto` where the fp8 kernels do not run,
    `test_fp8_mosaic`) the dense products are XLA's, the kernels that read no weights
    djax's, the experts the converted tiles."""
    options = KernelOptions(fp8_impl="scaled")
    choice = resolve(options, HOPPER, LLADA_8B, jnp.bfloat16, GENERATION, weights="fp8")
    assert choice.weights == "fp8"
    for forward in (choice.block.layers, choice.block.last, choice.refresh.last):
        assert (forward.qkv, forward.out, forward.mlp, forward.down) == ("xla",) * 4
        assert forward.norm_into_mlp == "no"
    block = choice.block.layers  # the kernels that read no weights: still djax's
    assert (block.attention, block.rope, block.norm) == ("split_kv", "mosaic", "mosaic")
    assert (choice.block.layers.fp8, choice.refresh.layers.fp8) == ("scaled", "scaled")
    moe = resolve(options, HOPPER, LLADA_MOE, jnp.bfloat16, GENERATION, weights="fp8")
    assert moe.block.layers.moe == "mosaic"  # the expert kernel that converts e4m3 tiles
    cpu = resolve(KernelOptions(), Device("cpu"), LLADA_8B, jnp.float32, GENERATION, weights="fp8")
    assert cpu.refresh.layers.fp8 == "dequant"
    forced = resolve(options, Device("cpu"), LLADA_8B, jnp.float32, GENERATION, weights="fp8")
    assert forced.block.layers.fp8 == forced.refresh.layers.fp8 == "scaled"
    plain = resolve(KernelOptions(), HOPPER, LLADA_8B, jnp.bfloat16, GENERATION)
    assert plain.weights == "dtype" and plain.block.layers.fp8 == "no"
    assert plain.block.layers.mlp == "mosaic"
    for option, kernel in (("matmul_impl", "mosaic"), ("mlp_impl", "mosaic")):
        with pytest.raises(ValueError, match=f"{option}='{kernel}' takes 16-bit weights"):
            resolve(
                KernelOptions(**{option: kernel}),
                HOPPER,
                LLADA_MOE,
                jnp.bfloat16,
                GENERATION,
                weights="fp8",
            )


@pytest.fixture(scope="module")
def demo():
    return djax.load(default_model_path()), djax.load(default_model_path(), weights="fp8")


def _ids(vocab, shape=(3, 24), seed=0):
    return np.random.default_rng(seed).integers(4, vocab, shape)


def test_demo_fp8_logits_close_and_greedy_tokens_agree(demo):
    """On held-out demo prompts followed by a masked answer (what decoding sees)."""
    full, quantised = demo
    assert quantised.weights == "fp8" and full.weights == "dtype"
    assert quantised.params["attn_0"]["qkv"].dtype == jnp.float8_e4m3fn
    rows = [full.tokenizer.encode(prompt) for prompt, _ in task.make_problems(16, "test", 1)]
    width, mask = max(map(len, rows)), full.config.mask_token_id
    ids = np.array([[0] * (width - len(r)) + r + [mask] * 16 for r in rows])
    valid = np.array([[0] * (width - len(r)) + [1] * (len(r) + 16) for r in rows], bool)
    masked = ids == mask
    ref = np.asarray(djax.forward_logits(full, ids, valid))
    for impl, bound in DEMO_LOGITS_BOUND.items():
        model = quantised.with_options(fp8_impl=impl)
        ours = np.asarray(djax.forward_logits(model, ids, valid))
        assert rel_error(ours[valid], ref[valid]) <= bound, impl
        agree = np.mean(ours.argmax(-1)[masked] == ref.argmax(-1)[masked])
        assert agree >= 0.95, (impl, agree)


def test_demo_fp8_generation_is_deterministic_and_answers_like_fp32(demo):
    full, quantised = demo
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    a = djax.generate(quantised, prompts, config)
    b = djax.generate(quantised, prompts, config)
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    ref = djax.generate(full, prompts, config)
    assert np.mean(a.answer_ids == ref.answer_ids) >= 0.9


def _dequantised(params: dict) -> dict:
    """fp8 params as params of the model's dtype: every weight `values * scale`."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = _dequantised(value)
        elif value.dtype == jnp.float8_e4m3fn:
            axes = fp8.contraction_axes(key, value.ndim)
            out[key] = fp8.dequantize(value, params[key + "_scale"], axes, jnp.float32)
        elif fp8.values_name(key) is None:
            out[key] = value
    return out


def test_fp8_forward_is_the_dequantised_models(moe_folder, tmp_path):
    """The dequant path computes exactly the model whose weights are the fp8 ones read back
    (dense, LLaDA-MoE and LLaDA2; in fp32 on every platform, as the weights are read back):
    what remains of the error against the dtype model is quantisation."""
    make_llada2(tmp_path, seed=4)
    dequant = dict(weights="fp8", fp8_impl="dequant")  # `auto` may scale rows on a GPU
    for quantised in (
        djax.load(default_model_path(), jnp.float32, **dequant),
        djax.load(moe_folder[0], jnp.float32, **dequant),
        djax.load(tmp_path, jnp.float32, **dequant),
    ):
        reference = dataclasses.replace(
            quantised, params=_dequantised(quantised.params), weights="dtype"
        )
        ids = _ids(quantised.config.vocab_size, (2, 16))
        ours = np.asarray(djax.forward_logits(quantised, ids))
        assert rel_error(ours, np.asarray(djax.forward_logits(reference, ids))) <= 1e-5


def test_moe_fp8_logits_close(moe_model, moe_folder):
    quantised = djax.load(moe_folder[0], jnp.float32, weights="fp8")
    ids = _ids(moe_model.config.vocab_size)
    ref = np.asarray(djax.forward_logits(moe_model, ids))
    for impl, (bound, agreement) in MOE_BOUNDS.items():
        ours = np.asarray(djax.forward_logits(quantised.with_options(fp8_impl=impl), ids))
        assert rel_error(ours, ref) <= bound, impl
        assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= agreement, impl
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, threshold=0.5)
    runs = [djax.generate(quantised, [[5, 6, 7]], config).answer_ids for _ in range(2)]
    np.testing.assert_array_equal(*runs)


@pytest.mark.parametrize("tokens", [40, 80])  # grouped experts, then dense ones (> 64)
def test_bf16_moe_fp8_forward(moe_folder, tokens):
    """bf16 rows through fp8 weights (the GPU setting) on both expert paths."""
    full = djax.load(moe_folder[0], jnp.bfloat16)
    quantised = djax.load(moe_folder[0], jnp.bfloat16, weights="fp8")
    ids = _ids(full.config.vocab_size, (1, tokens))
    ref = np.asarray(djax.forward_logits(full, ids))
    for impl, (bound, _) in MOE_BOUNDS.items():
        ours = np.asarray(djax.forward_logits(quantised.with_options(fp8_impl=impl), ids))
        assert rel_error(ours, ref) <= bound, impl


@pytest.mark.parametrize("impl", ["dequant", "scaled"])
def test_fp8_expert_paths_agree(moe_model, impl):
    """The dense and grouped expert paths compute the same function on fp8 experts."""
    layer = next(k for k, v in moe_model.params.items() if isinstance(v, dict) and "router" in v)
    ff = fp8.quantize_params(moe_model.params)[layer]
    gate_up = fp8.Fp8Weight(ff["gate_up"], ff["gate_up_scale"])
    down = fp8.Fp8Weight(ff["down"], ff["down_scale"])
    rng = np.random.default_rng(1)
    n, top_k, e = 12, 2, gate_up.shape[0]
    x = jnp.asarray(rng.standard_normal((n, gate_up.shape[1])), jnp.float32)
    experts = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :top_k], jnp.int32)
    weights = jnp.asarray(rng.random((n, top_k)), jnp.float32)
    dense = experts_dense(x, weights, experts, gate_up, down, 0, fp8_impl=impl)
    grouped = experts_grouped(
        x, weights, experts, gate_up, down, 0, mlp=partial(ragged_mlp, fp8_impl=impl)
    )
    # the same products summed in other orders; under `scaled` on a Hopper GPU, e4m3
    # products whose tensor-core accumulator keeps fewer bits than fp32 (3.7e-5 measured)
    bound = 1e-4 if impl == "scaled" else 1e-5
    assert rel_error(np.asarray(grouped), np.asarray(dense)) <= bound
    # and both are the dequantised experts' products, within the rows' own rounding (e4m3
    # rows in both products under `scaled`: 5.5% measured)
    full = experts_dense(
        x,
        weights,
        experts,
        fp8.dequantize(gate_up.values, gate_up.scale, (1,), jnp.float32),
        fp8.dequantize(down.values, down.scale, (1,), jnp.float32),
        0,
    )
    assert rel_error(np.asarray(dense), np.asarray(full)) <= (0.08 if impl == "scaled" else 1e-5)


def test_fp8_folder_from_before_the_fp8_head_is_refused(dense_folder, tmp_path, monkeypatch):
    """A folder converted while the head stayed in the model's dtype holds no lm_head_scale:
    loading it says to convert again."""
    from djax import models

    axes, param = fp8.contraction_axes, fp8.param

    def old_param(module, name, init, shape, dtype, *args, **kwargs):
        if name == "lm_head":
            return module.param(name, init, shape, dtype)
        return param(module, name, init, shape, dtype, *args, **kwargs)

    monkeypatch.setattr(
        fp8, "contraction_axes", lambda name, ndim: None if name == "lm_head" else axes(name, ndim)
    )
    monkeypatch.setattr(fp8, "param", old_param)
    models._abstract_params.cache_clear()
    djax.convert(dense_folder[0], tmp_path / "old", jnp.float32, progress=False, weights="fp8")
    monkeypatch.undo()
    models._abstract_params.cache_clear()
    message = "converted before djax stored lm_head in fp8 .it holds no lm_head_scale"
    with pytest.raises(CheckpointError, match=message):
        djax.load(tmp_path / "old", jnp.float32)


def test_convert_round_trip_is_bit_exact_and_recorded(dense_folder, tmp_path):
    out = tmp_path / "fp8"
    djax.convert(dense_folder[0], out, jnp.float32, progress=False, weights="fp8")
    marker = json.loads((out / checkpoint.MARKER).read_text())
    assert marker["weights"] == "fp8"
    default = djax.load(out)  # the platform's default dtype: fp32 on the CPU, bf16 elsewhere
    assert default.weights == "fp8"
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert default.params["embed"].dtype == dtype
    # quantised from fp32 weights, as `convert` quantised them (loading in bf16 first
    # would round each weight twice)
    loaded = djax.load(out, jnp.float32)
    direct = djax.load(dense_folder[0], jnp.float32, weights="fp8")
    flat = jax.tree_util.tree_leaves_with_path(direct.params)
    assert len(flat) == len(jax.tree_util.tree_leaves(loaded.params))
    for path, a in flat:
        b = loaded.params
        for key in path:
            b = b[key.key]
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(path)
        )
    ids = _ids(direct.config.vocab_size, (2, 10))
    logits = [np.asarray(djax.forward_logits(m, ids)) for m in (loaded, direct)]
    np.testing.assert_array_equal(*logits)
    with pytest.raises(CheckpointError, match="holds 'fp8' weights.*weights='dtype' contradicts"):
        djax.load(out, weights="dtype")
    # another compute dtype: the fp8 values and scales as stored, the rest cast
    half = djax.load(out, jnp.bfloat16)
    assert half.params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(half.params["attn_0"]["qkv"]).view(np.uint8),
        np.asarray(direct.params["attn_0"]["qkv"]).view(np.uint8),
    )
    marker["weights"] = "int4"
    (out / checkpoint.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"weights='int4'; expected one of \('dtype', 'fp8'"):
        djax.load(out)


def test_fp8_folder_is_smaller(dense_folder, tmp_path):
    sizes = {}
    for weights in ("dtype", "fp8"):
        out = tmp_path / weights
        djax.convert(dense_folder[0], out, jnp.bfloat16, progress=False, weights=weights)
        sizes[weights] = sum(json.loads((out / checkpoint.MARKER).read_text())["files"].values())
    assert sizes["fp8"] < sizes["dtype"]
    with pytest.raises(CheckpointError, match="holds 'dtype' weights.*weights='fp8'"):
        djax.load(tmp_path / "dtype", weights="fp8")


def test_failed_fp8_convert_leaves_the_destination_as_it_was(dense_folder, tmp_path, monkeypatch):
    out = tmp_path / "out"
    djax.convert(dense_folder[0], out, jnp.float32, progress=False)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "check_orbax", fail)  # after the fp8 params are saved
    with pytest.raises(RuntimeError, match="disk full"):
        djax.convert(
            dense_folder[0], out, jnp.float32, overwrite=True, progress=False, weights="fp8"
        )
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_bad_weights_values_are_named(dense_folder, tmp_path):
    for bad in ("bf16", "int8", None):
        with pytest.raises(ValueError, match=r"weights=.*; expected one of \('dtype', 'fp8'\)"):
            djax.convert(dense_folder[0], tmp_path / "x", weights=bad)
    with pytest.raises(ValueError, match=r"weights='e5m2'; expected one of \('dtype', 'fp8'\)"):
        djax.load(tmp_path / "missing", weights="e5m2")  # before the path is looked at
    assert not (tmp_path / "x").exists()


def test_prequantised_checkpoint_is_refused(dense_folder, tmp_path):
    folder = tmp_path / "quantised"
    shutil.copytree(dense_folder[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method='fp8'.*does not load pre-quantised"):
        djax.load(folder)
    with pytest.raises(ConfigError, match="quantization_config"):
        djax.convert(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    config["quantization_config"] = None  # null: no quantised weights declared
    (folder / "config.json").write_text(json.dumps(config))
    assert djax.load(folder).config == djax.load(dense_folder[0]).config


def test_cli_weights_flags(dense_folder, tmp_path, capsys):
    for command in (["generate"], ["serve"]):
        assert build_parser().parse_args([*command, "--weights", "fp8"]).weights == "fp8"
        assert build_parser().parse_args(command).weights is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--weights", "bf16"])
    assert "invalid choice: 'bf16'" in capsys.readouterr().err
    out = tmp_path / "fp8"
    args = ["convert", str(dense_folder[0]), str(out), "--dtype", "float32", "--weights", "fp8"]
    assert main(args) == 0
    assert checkpoint.stored_weights(out) == "fp8"
    assert model_lib.load(out).params["attn_0"]["qkv"].dtype == jnp.float8_e4m3fn


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["tensor", "expert"])
def test_sharded_fp8_matches_one_device(moe_folder, mesh_kind):
    """Values and scales are split as param_specs says, quantised from the same numbers as
    on one device (bit-exact), and the sharded forward gives one device's logits; under
    tensor parallelism also its generated tokens (the block forwards take the same sharded
    fp8 products as the logits' forward, so the expert mesh's logits cover its layers)."""
    mesh = make_mesh(**{f"{mesh_kind}_parallel": 2})
    single = djax.load(moe_folder[0], jnp.float32, weights="fp8")
    sharded = djax.load(moe_folder[0], jnp.float32, mesh=mesh, weights="fp8")
    specs = param_specs(single.config, jnp.float32, mesh, "fp8")
    layer = next(k for k, v in single.params.items() if isinstance(v, dict) and "router" in v)
    axis = mesh.axis_names[1]
    if mesh_kind == "expert":
        assert tuple(specs[layer]["gate_up_scale"]) == (axis, None, None)
        assert tuple(specs[layer]["down_scale"]) == (axis, None)
    else:
        assert tuple(specs[layer]["gate_up_scale"]) == (None, None, axis)
        assert tuple(specs[layer]["down_scale"]) == (None, None)
    assert tuple(specs["attn_0"]["qkv_scale"]) == (axis, None, None)
    assert tuple(specs["attn_0"]["attn_out_scale"]) == (None,)  # replicated
    for path, a in jax.tree_util.tree_leaves_with_path(sharded.params):
        b = single.params
        for key in path:
            b = b[key.key]
        spec = specs
        for key in path:
            spec = spec[key.key]
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), path
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(path)
        )
    ids = _ids(single.config.vocab_size, (2, 12))
    err = rel_error(djax.forward_logits(sharded, ids), djax.forward_logits(single, ids))
    assert err <= 1e-5, err
    if mesh_kind == "expert":
        return
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    np.testing.assert_array_equal(
        djax.generate(sharded, [[5, 6, 7]], config).answer_ids,
        djax.generate(single, [[5, 6, 7]], config).answer_ids,
    )


def test_random_fp8_params_are_quantised_random_params(dense_model):
    from djax.models import abstract_params, init_params

    config = dense_model.config
    params = init_params(config, jnp.float32, seed=3, weights="fp8")
    abstract = abstract_params(config, jnp.float32, "fp8")
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
        lambda a: (a.shape, a.dtype), abstract
    )
    full = init_params(config, jnp.float32, seed=3)
    w = np.asarray(full["attn_0"]["qkv"])
    back = fp8.dequantize(params["attn_0"]["qkv"], params["attn_0"]["qkv_scale"], (0,), jnp.float32)
    assert np.max(np.abs(np.asarray(back) - w)) <= E4M3_RELATIVE * np.max(np.abs(w))
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == fp8.E4M3_MAX


class _CountedProgram:
    """A jitted program that counts its calls (`lower` passes through untouched)."""

    def __init__(self, program):
        self.program, self.calls = program, 0

    def __call__(self, *args):
        self.calls += 1
        return self.program(*args)

    def lower(self, *args):
        return self.program.lower(*args)


def _counted(layout: fp8.Layout) -> fp8.Layout:
    return dataclasses.replace(layout, program=_CountedProgram(layout.program))


def test_layout_compiled_ahead_moves_what_it_was_compiled_for():
    """`Layout.compile_ahead` compiles the move for the abstract params; params that match
    run that program (the jitted one never called), others the jitted one; either way each
    moved value is its K-major transpose, bit for bit, and every other param the same
    array."""
    rng = np.random.default_rng(3)
    params = fp8.quantize_params(
        {
            "attn_0": {"qkv": jnp.asarray(rng.standard_normal((64, 3, 2, 32)), jnp.float32)},
            "ff_0": {"down": jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)},
            "embed": jnp.ones((8, 64), jnp.float32),
        }
    )
    avals = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
    )
    layout = _counted(fp8.Layout.of(avals, True)).compile_ahead(avals)
    assert layout.paths == (("attn_0", "qkv"), ("ff_0", "down"))
    moved = layout(params)
    assert layout.program.calls == 0
    np.testing.assert_array_equal(
        np.asarray(moved["attn_0"]["qkv"]).view(np.uint8),
        np.asarray(params["attn_0"]["qkv"]).view(np.uint8).transpose(1, 2, 3, 0),
    )
    np.testing.assert_array_equal(
        np.asarray(moved["ff_0"]["down"]).view(np.uint8),
        np.asarray(params["ff_0"]["down"]).view(np.uint8).T,
    )
    assert moved["embed"] is params["embed"]
    assert moved["ff_0"]["down_scale"] is params["ff_0"]["down_scale"]
    assert params["ff_0"]["down"].shape == (128, 64)  # the input tree is left as it was
    other = fp8.quantize_params({"ff_0": {"down": jnp.ones((256, 64), jnp.float32)}})
    avals = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), other
    )
    mismatched = _counted(fp8.Layout.of(other, True)).compile_ahead(
        {
            "ff_0": {
                "down": jax.ShapeDtypeStruct((128, 64), fp8.FP8),
                "down_scale": avals["ff_0"]["down_scale"],
            }
        }
    )
    assert mismatched(other)["ff_0"]["down"].shape == (64, 256)
    assert mismatched.program.calls == 1


def test_load_held_k_major_moves_the_values_compiled_while_reading(
    moe_folder, tmp_path, monkeypatch
):
    """Where a converted fp8 model is held K-major (`holds_k_major`, forced here: on the CPU
    it never is), `djax.load` moves its values with the program it compiled while the
    params were read: the same params as `to_layout` of the plain load, and the same
    logits."""
    out = tmp_path / "fp8"
    djax.convert(moe_folder[0], out, jnp.float32, progress=False, weights="fp8")
    plain = djax.load(out, jnp.float32)
    made = []

    def of(*args, **kwargs):
        made.append(_counted(of.original(*args, **kwargs)))
        return made[-1]

    of.original = fp8.Layout.of
    monkeypatch.setattr(fp8.Layout, "of", of)
    monkeypatch.setattr(djax.programs, "holds_k_major", lambda *args: True)
    held = djax.load(out, jnp.float32)
    assert held.k_major and len(made) == 1 and made[0].program.calls == 0
    expected = fp8.to_layout(plain.params, True)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(held.params), jax.tree.leaves(expected), strict=True
    ):
        assert a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    ids = _ids(plain.config.vocab_size, (2, 10))
    np.testing.assert_allclose(
        djax.forward_logits(held, ids), djax.forward_logits(plain, ids), rtol=1e-5, atol=1e-5
    )
