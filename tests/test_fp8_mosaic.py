"""`fp8_impl="mosaic"`: a fp8 model's block forwards through the fp8 x fp8 Mosaic GPU kernel
(`djax.kernels.fp8_matmul_mosaic`, Mosaic GPU's interpreter here) on K-major values: the
kernel choice, the layout moves, the products and a generation against `scaled`, the norms
that quantise the rows for the kernel, and the errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices
from jax.sharding import NamedSharding
from test_kernel_choice import GENERATION, HOPPER, LLADA_8B, LLADA_MOE

import djax
from djax import engine, programs
from djax.config import DENSE, MOE, ModelConfig
from djax.kernel_options import KernelOptions
from djax.kernels import fp8_matmul_mosaic, tma_ring
from djax.kernels.handoff import QuantizedRows, finish
from djax.models import abstract_params, build_module, fp8
from djax.models import layers as layers_module
from djax.models.kernel_choice import (
    Device,
    ForwardKernels,
    Kernels,
    Shapes,
    holds_k_major,
    resolve,
)
from djax.models.layers import GatedMLP, RMSNorm, project
from djax.sharding import make_mesh, param_specs

from torch_reference import make_llada_dense, rel_error

MOSAIC = KernelOptions(fp8_impl="mosaic")


def _choice(config=LLADA_8B, shapes=GENERATION, options=MOSAIC, **kwargs):
    return resolve(options, HOPPER, config, jnp.bfloat16, shapes, weights="fp8", **kwargs)


def test_block_forwards_take_the_kernel_refreshes_scaled():
    choice = _choice()
    assert choice.k_major
    assert choice.explain().endswith("\nweights: fp8, values K-major")
    for forward in (choice.block.layers, choice.block.last):
        # q/k/v inside the RoPE kernel (LLaDA-8B's 96 head slots fill the GPU)
        assert (forward.qkv, forward.out, forward.mlp, forward.down) == (
            "rope", *("fp8_mosaic",) * 3,
        )  # fmt: skip
        assert forward.fp8 == "scaled"  # what XLA's products (none here) would take
        assert forward.norm_into_mlp == "no"
        assert forward.rope == "mosaic" and forward.attention == "split_kv"  # read no weights
    for forward in (choice.refresh.layers, choice.refresh.last):  # last: 32 kept rows
        assert (forward.qkv, forward.out, forward.mlp, forward.down) == ("xla",) * 4
        assert forward.fp8 == "scaled"
    batched = _choice(shapes=Shapes(batch=2, window=32, seq=384, kept=32)).block.layers
    assert (batched.qkv, batched.mlp, batched.fp8) == ("xla", "xla", "scaled")  # 64 rows
    moe = _choice(LLADA_MOE)
    assert moe.block.layers.qkv == "rope" and moe.block.layers.fp8 == "scaled"
    # the experts by fp8 x fp8 WGMMA in every forward (their tiles take any rows)
    for forward in (moe.block.layers, moe.refresh.layers, moe.refresh.last):
        assert forward.moe == "fp8_mosaic"
    assert "moe=fp8_mosaic" in moe.explain()
    asked = _choice(LLADA_MOE, options=KernelOptions(fp8_impl="mosaic", moe_impl="mosaic"))
    assert asked.refresh.layers.moe == "fp8_mosaic"
    # `auto` takes them on Hopper GPUs, as `mosaic` does, and says nothing without fp8
    for config in (LLADA_8B, LLADA_MOE):
        auto = resolve(KernelOptions(), HOPPER, config, jnp.bfloat16, GENERATION, weights="fp8")
        assert auto == _choice(config)
    assert auto.explain().endswith("\nweights: fp8, values K-major")
    plain = resolve(MOSAIC, HOPPER, LLADA_8B, jnp.bfloat16, GENERATION)
    assert not plain.k_major and plain.block.layers.qkv == "rope"


def test_auto_takes_the_fp8_kernels_only_where_they_run_and_fit():
    """`auto` holds the values as stored, with XLA's `scaled` products and the converted
    expert tiles, where djax's kernels do not run (a GPU of another generation, fp32) or
    do not take a product's widths or the experts (`moe_impl="xla"`); `mosaic` raises
    there instead."""
    ada = Device("gpu", (8, 9), 100 * 1024)
    cases = (
        (ada, LLADA_8B, jnp.bfloat16, KernelOptions()),
        (HOPPER, LLADA_8B, jnp.float32, KernelOptions()),
        (HOPPER, LLADA_8B.replace(mlp_hidden=1000), jnp.bfloat16, KernelOptions()),
        (HOPPER, LLADA_MOE, jnp.bfloat16, KernelOptions(moe_impl="xla")),
    )
    for device, config, dtype, options in cases:
        auto = resolve(options, device, config, dtype, GENERATION, weights="fp8")
        assert not auto.k_major and auto.block.layers.qkv == "xla"
        assert auto.block.layers.mlp != "fp8_mosaic" and auto.block.layers.fp8 == "scaled"
        assert not holds_k_major(options, device, config, dtype, "fp8")
    odd = LLADA_MOE.replace(expert_hidden=1088)  # a multiple of 64, not of 128
    odd_auto = resolve(KernelOptions(), HOPPER, odd, jnp.bfloat16, GENERATION, weights="fp8")
    assert not odd_auto.k_major and odd_auto.block.layers.fp8 == "scaled"
    assert odd_auto.block.layers.moe == odd_auto.refresh.layers.moe == "mosaic"  # converted
    assert holds_k_major(KernelOptions(), HOPPER, LLADA_MOE, jnp.bfloat16, "fp8")
    assert not holds_k_major(KernelOptions(), HOPPER, LLADA_MOE, jnp.bfloat16, "dtype")
    with pytest.raises(ValueError, match="fp8_impl='mosaic' takes .* 1000"):
        holds_k_major(MOSAIC, HOPPER, cases[2][1], jnp.bfloat16, "fp8")


def test_params_held_k_major_under_other_options_run_xla_products():
    """A fallback's options (`auto_as_xla`) over params held K-major: XLA's products (which
    read that layout) and XLA's experts as `dense` (ragged_dot reads no K-major experts);
    `mosaic` over params held as stored is refused."""
    for config in (LLADA_8B, LLADA_MOE):
        fallback = KernelOptions().auto_as_xla()
        held = _choice(config, options=fallback, k_major=True)
        assert held.k_major
        for forward in (held.block.layers, held.refresh.layers):
            assert (forward.qkv, forward.out, forward.fp8) == ("xla", "xla", "dequant")
            assert forward.moe == ("dense" if config.is_moe else "none")
    with pytest.raises(ValueError, match="reads K-major fp8 values; these params hold theirs"):
        _choice(k_major=False)


def test_the_norms_quantise_for_the_kernel_in_block_forwards_only():
    """`norm_into_fp8`: the per-row norms hand e4m3 rows to the q/k/v and gate/up products
    where a block forward runs them in the fp8 kernel (LLaDA-MoE's too: its q/k/v), and
    nowhere else: not in refreshes, nor with bf16 weights, `scaled` or `norm_impl="xla"`."""
    choice = _choice()
    assert choice.block.layers.norm_into_fp8 and choice.block.last.norm_into_fp8
    assert "norm=mosaic, norm_into_mlp=no, norm_into_fp8=True," in choice.explain()
    assert _choice(LLADA_MOE).block.layers.norm_into_fp8
    others = (
        resolve(MOSAIC, HOPPER, LLADA_8B, jnp.bfloat16, GENERATION),  # bf16 weights
        _choice(options=KernelOptions(fp8_impl="scaled")),
        _choice(options=KernelOptions(fp8_impl="mosaic", norm_impl="xla")),
    )
    for forward in (choice.refresh, *(other.block for other in others)):
        assert not forward.layers.norm_into_fp8 and not forward.last.norm_into_fp8
    assert others[1].block.layers.norm == "mosaic"  # the norm kernel, rows left in bf16


def _fp8_block_inputs(config: ModelConfig, seed: int) -> tuple:
    """Random params of `config` (bf16, quantised to fp8, K-major) and the rows x [1, 8,
    model] of a block forward."""
    rng = np.random.default_rng(seed)
    shapes = abstract_params(config, jnp.bfloat16)
    params = jax.tree.map(
        lambda a: jnp.asarray(0.05 * rng.standard_normal(a.shape), a.dtype), shapes
    )
    params = fp8.to_layout(fp8.quantize_params(params), True)
    return params, jnp.asarray(rng.standard_normal((1, 8, config.d_model)), jnp.bfloat16)


def _counted_quantisations(monkeypatch) -> list:
    """The shapes of the row sets XLA quantises (`fp8_matmul_mosaic.quantize_rows`) from
    now on, appended as they are traced."""
    quantised = []
    real = fp8_matmul_mosaic.quantize_rows
    monkeypatch.setattr(
        fp8_matmul_mosaic, "quantize_rows", lambda rows: quantised.append(rows.shape) or real(rows)
    )
    return quantised


# One LLaDA dense layer of heads of 128 features (one 128-column slice of the attention
# output product's contraction each).
FP8_HEADS = ModelConfig(DENSE, 256, 256, 1, 2, 1, 128, 256, 5e5, 1e-5, 64, 1, 2, 3)


def test_attention_hands_the_output_product_e4m3_heads(monkeypatch):
    """`attention_into_fp8` (block forwards, `split_kv`, head_dim 128, an `fp8_mosaic`
    output product): the attention's output goes to the output product as e4m3 with a
    scale per row and head, written by the split-K/V kernel (Mosaic GPU's interpreter off
    GPUs), so XLA quantises no attention output; XLA's attention hands the same rows
    (`fp8_matmul_mosaic.quantize_heads`). Not in refreshes, nor for heads of 64 features."""
    options = KernelOptions(fp8_impl="mosaic", attention_impl="split_kv")
    shapes = Shapes(batch=1, window=8, seq=8, kept=8)
    choice = resolve(options, Device("cpu"), FP8_HEADS, jnp.bfloat16, shapes, weights="fp8")
    layers = choice.block.layers
    assert (layers.attention, layers.out, layers.attention_into_fp8) == (
        "split_kv", "fp8_mosaic", True,
    )  # fmt: skip
    assert not choice.refresh.layers.attention_into_fp8
    narrow = resolve(options, Device("cpu"), FP8_NORMED, jnp.bfloat16, shapes, weights="fp8")
    assert not narrow.block.layers.attention_into_fp8  # heads of 64 features
    params, x = _fp8_block_inputs(FP8_HEADS, seed=9)
    positions, valid = jnp.arange(8)[None], jnp.ones((1, 8), bool)
    quantised = _counted_quantisations(monkeypatch)
    variants = {
        "kernel": layers,
        "xla": dataclasses.replace(layers, attention="xla"),
        "per row": dataclasses.replace(layers, attention_into_fp8=False),
    }
    out, calls = {}, {}
    for name, kernels in variants.items():
        quantised.clear()
        forwards = ForwardKernels(kernels, kernels)
        module = build_module(
            FP8_HEADS, jnp.bfloat16, kernels=dataclasses.replace(choice, block=forwards)
        )
        forward = jax.jit(
            lambda p, x, m=module: m.apply({"params": p}, x, positions, valid, block_forward=True)
        )
        out[name] = np.asarray(forward(params, x)[0], np.float32)
        calls[name] = list(quantised)
    # XLA's norms here: the q/k/v and gate/up rows quantised by XLA, the attention's not
    assert calls["kernel"] == calls["xla"] == [(1, 8, 256), (8, 256)]
    assert calls["per row"] == [(1, 8, 256), (1, 8, 256), (8, 256)]
    assert rel_error(out["kernel"], out["xla"]) <= 1e-2
    assert np.isfinite(out["kernel"]).all() and rel_error(out["kernel"], out["per row"]) > 0


def test_quantised_rows_are_refused_elsewhere():
    rows = QuantizedRows(jnp.zeros((2, 128), fp8.FP8), jnp.ones((2,), jnp.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="QuantizedRows\\) need impl 'fp8_mosaic'; got 'xla'"):
        project(rows, jnp.zeros((128, 64), jnp.bfloat16), "xla")
    x = jnp.ones((2, 512), jnp.bfloat16)
    params = {"params": {"scale": x[0]}}
    with pytest.raises(ValueError, match="into_fp8 needs a residual add in impl 'mosaic'"):
        RMSNorm(1e-5, jnp.bfloat16).apply(params, x, x, impl="xla", into_fp8=True)


# A two-layer LLaDA dense whose products the fp8 kernel and whose norms the per-row kernel
# take (model 512: the narrowest row it takes).
FP8_NORMED = ModelConfig(DENSE, 256, 512, 2, 2, 1, 64, 128, 5e5, 1e-5, 64, 1, 2, 3)


# FP8_NORMED's attention and norms over one LLaDA-MoE layer of 4 experts (ffn 128, top 2).
FP8_NORMED_MOE = FP8_NORMED.replace(
    family=MOE, n_layers=1, n_experts=4, experts_per_token=2, expert_hidden=128, moe_layers=(True,)
)


@pytest.mark.parametrize(
    "config, in_xla_rows", [(FP8_NORMED, (3, 6)), (FP8_NORMED_MOE, (2, 3))], ids=["dense", "moe"]
)
def test_norms_hand_the_kernels_quantised_rows(config, in_xla_rows, monkeypatch):
    """A block forward of 8 rows (bf16, K-major fp8 weights; Mosaic GPU's interpreter off
    GPUs) under `fp8_impl="mosaic"` and `norm_impl="mosaic"`: the norms after layer 0's
    attention and feed-forward and after layer 1's attention quantise the rows of the
    products after them (a MoE layer's experts' rows too, the norm keeping its rows for the
    router: `keep_rows`), so XLA quantises only layer 0's q/k/v rows (after the first norm,
    which has no residual add) and each layer's attention outputs: 3 row sets of the two
    dense layers where the same choice with `norm_into_fp8=False` quantises 6, and 2 of the
    MoE layer where it quantises 3 (the experts' token rows); a feed-forward's activation
    its gate/up kernel quantises itself, per row and 128-column slice; the hidden
    states are the same bit for bit (the same arithmetic; on a GPU the compilers' divisions
    may round a value at an e4m3 midpoint apart: to 1%)."""
    choice = resolve(
        KernelOptions(fp8_impl="mosaic", norm_impl="mosaic"),
        Device("cpu"),
        config,
        jnp.bfloat16,
        Shapes(batch=1, window=8, seq=8, kept=8),
        weights="fp8",
    )
    layers = choice.block.layers
    feed_forward = layers.moe if config.is_moe else layers.mlp
    assert (layers.qkv, feed_forward, layers.norm, layers.norm_into_fp8) == (
        "fp8_mosaic", "fp8_mosaic", "mosaic", True,
    )  # fmt: skip
    unfused = dataclasses.replace(layers, norm_into_fp8=False)
    in_xla = dataclasses.replace(choice, block=ForwardKernels(unfused, unfused))
    params, x = _fp8_block_inputs(config, seed=3)
    positions, valid = jnp.arange(8)[None], jnp.ones((1, 8), bool)
    quantised = _counted_quantisations(monkeypatch)
    hidden = []
    for kernels in (choice, in_xla):
        quantised.clear()
        module = build_module(config, jnp.bfloat16, kernels=kernels)
        # jitted: op by op, the interpreter's callbacks and the next ops can deadlock
        forward = jax.jit(
            lambda p, x, m=module: m.apply({"params": p}, x, positions, valid, block_forward=True)
        )
        out, _ = forward(params, x)
        hidden.append((np.asarray(out, np.float32), len(quantised)))
    (fused, fused_calls), (ref, ref_calls) = hidden
    assert (fused_calls, ref_calls) == in_xla_rows
    assert np.isfinite(fused).all() and np.abs(fused).max() > 0
    if jax.default_backend() == "gpu":
        assert rel_error(fused, ref) <= 1e-2
    else:
        np.testing.assert_array_equal(fused, ref)
    if config.is_moe:  # e4m3 rows without their rows kept: the router has nothing to read
        rows = QuantizedRows(jnp.zeros((1, 8, 512), fp8.FP8), jnp.ones((1, 8)), jnp.bfloat16)
        with pytest.raises(ValueError, match="need their rows kept \\(keep_rows\\) and moe"):
            module.apply(
                {"params": params}, x, positions, valid, method=lambda m, *_: m.ffs[0](rows, layers)
            )


def test_attention_takes_the_fp8_qkv_product_inside_the_rope_kernel():
    """An attention layer's block window (16 rows, K-major fp8 weights; Mosaic GPU's
    interpreter off GPUs) with the q/k/v product inside the RoPE kernel (`qkv="rope"`: fp8
    x fp8 WGMMA there), on bf16 rows or on rows the norm quantised (`QuantizedRows`), writes
    the window's K/V and attends as the fp8 product made apart does (`fp8_mosaic`, then the
    RoPE kernel on its partials), to bf16 rounding."""
    config = ModelConfig(DENSE, 64, 128, 1, 2, 1, 64, 128, 1e4, 1e-5, 64, 1, 2, 3)
    plain = layers_module.Attention(config, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 16, 128)), jnp.bfloat16)
    positions = 8 + jnp.arange(16)[None]
    rng = np.random.default_rng(7)
    kv = tuple(jnp.asarray(rng.standard_normal((1, 32, 1, 64)), jnp.bfloat16) for _ in "kv")
    key_valid = jnp.ones((1, 32), bool)
    window = layers_module.Window(8)
    params = plain.init(jax.random.key(9), x, positions, key_valid, kv, window)["params"]
    params = {"params": fp8.to_layout(fp8.quantize_params(params), True)}
    attention = layers_module.Attention(config, jnp.bfloat16, weights="fp8", k_major=True)
    outs = {}
    for qkv in ("rope", "fp8_mosaic"):
        kernels = Kernels(qkv=qkv, rope="mosaic", fp8="scaled")
        for quantised in (False, True):
            rows = QuantizedRows(*fp8_matmul_mosaic.quantize_rows(x), x.dtype) if quantised else x
            # jitted: op by op, the interpreter's callbacks and the next ops can deadlock
            apply = jax.jit(
                lambda p, r, kv, k=kernels: attention.apply(
                    p, r, positions, key_valid, kv, window, None, k
                )
            )
            out, new_kv, _ = apply(params, rows, kv)
            outs[qkv, quantised] = [np.asarray(a, np.float32) for a in (out, *new_kv)]
    for quantised in (False, True):
        for ours, ref in zip(outs["rope", quantised], outs["fp8_mosaic", quantised], strict=True):
            assert rel_error(ours, ref) <= 1e-2
    # the same rows either way: the layer quantises bf16 rows by `quantize_rows`
    for a, b in zip(outs["rope", False], outs["rope", True], strict=True):
        np.testing.assert_array_equal(a, b)
    # rows the norm quantised, for a bf16 weight: refused by name
    rows = QuantizedRows(*fp8_matmul_mosaic.quantize_rows(x), x.dtype)
    params = plain.init(jax.random.key(9), x, positions, key_valid, kv, window)
    with pytest.raises(ValueError, match="need an fp8 q/k/v weight in the RoPE kernel"):
        plain.apply(
            params, rows, positions, key_valid, kv, window, None, Kernels(qkv="rope", rope="mosaic")
        )


def test_kernel_choice_errors():
    with pytest.raises(
        ValueError,
        match="fp8_impl='mosaic' takes .* 128 .* gate/up \\(1000\\) product 4096 -> 1000",
    ):
        _choice(LLADA_8B.replace(mlp_hidden=1000))
    # under a mesh, each device's share: LLaDA-8B's split in two fits, LLaDA-MoE's
    # experts split by their ffn in 16 (64 each) do not
    assert _choice(shards=2, sharded=True).block.layers.out == "fp8_mosaic"
    with pytest.raises(ValueError, match="local expert ffn 64"):
        _choice(LLADA_MOE, shards=16, sharded=True)
    with pytest.raises(
        ValueError,
        match="expert widths that are multiples of 128 .* model 2048, local expert ffn 960",
    ):
        _choice(LLADA_MOE.replace(expert_hidden=960))  # a multiple of 64 only
    with pytest.raises(ValueError, match="moe_impl='xla' does not read; give moe_impl 'auto'"):
        _choice(LLADA_MOE, options=KernelOptions(fp8_impl="mosaic", moe_impl="xla"))
    with pytest.raises(ValueError, match="fp8_impl='fast'; expected one of .*'mosaic'"):
        KernelOptions(fp8_impl="fast")


def _weight(shape, axes, seed):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return fp8.Fp8Weight(*fp8.quantize(jnp.asarray(w), axes))


def _k_major(w: fp8.Fp8Weight, name: str) -> fp8.Fp8Weight:
    order = fp8.k_major_order(name, w.values.ndim)
    return fp8.Fp8Weight(jnp.transpose(w.values, order), w.scale, True)


@pytest.mark.parametrize("subscripts", ["...k,kn->...n", "...m,mcf->...cf"])
@pytest.mark.parametrize("impl", ["dequant", "scaled"])
def test_xla_products_read_k_major_values(subscripts, impl):
    """XLA's products of a K-major weight are its own layout's (to fp32 rounding: the dot
    may add in another order)."""
    shape, name = ((64, 48), "down") if subscripts.startswith("...k") else ((64, 2, 40), "gate_up")
    w = _weight(shape, (0,), seed=1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 64)), jnp.float32)
    ours = fp8.einsum(subscripts, x, _k_major(w, name), impl)
    np.testing.assert_allclose(ours, fp8.einsum(subscripts, x, w, impl), rtol=1e-5, atol=1e-5)


def test_projection_of_several_contraction_axes_matches_scaled():
    """The attention output [kv_heads, group, head_dim, model] (three contraction axes)
    through the kernel, K-major, against `scaled` on the same e4m3 operands. Off GPUs both
    accumulate in fp32 (equal to rounding); Hopper's fp8 WGMMA accumulates in less than fp32,
    which moves single elements near zero by several percent but the whole product by about
    0.1% (0.09-0.17% at LLaDA-8B's products, bench/NOTES.md): a bound of 0.5% of its norm,
    which a wrong product (a swapped axis, a lost scale) exceeds by orders of magnitude."""
    w = _weight((2, 2, 64, 128), (0, 1, 2), seed=3)  # k = 256
    x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 8, 256)), jnp.float32)
    flat = fp8.matrix(_k_major(w, "attn_out"), 256, 128)
    assert flat.values.shape == (128, 256) and flat.shape == (256, 128)
    ours = finish(project(x, flat, "fp8_mosaic"))
    ref = project(x, fp8.matrix(w, 256, 128), "xla", "scaled")
    if jax.default_backend() == "gpu":
        assert rel_error(np.asarray(ours), np.asarray(ref)) <= 5e-3
    else:
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_the_kernel_refuses_weights_in_their_own_layout():
    w = _weight((128, 64), (0,), seed=5)
    with pytest.raises(ValueError, match="take K-major fp8 weights .* in its own layout"):
        project(jnp.ones((2, 128)), w, "fp8_mosaic")
    with pytest.raises(ValueError, match="takes expert weights in their own layout; got a K-major"):
        fp8.ragged_dot(jnp.ones((2, 64)), _k_major(w, "down"), jnp.array([2]), "scaled")


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory):
    """LLaDA dense of one layer whose products the kernel takes (widths 128 and 256)."""
    folder = tmp_path_factory.mktemp("llada_wide")
    make_llada_dense(
        folder, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=128, seed=4
    )
    return folder


def test_generation_is_scaled_token_for_token(wide_folder):
    """Block forwards in the kernel (interpreted) give `scaled`'s tokens; the layout moves
    there and back bit for bit, and loading with the option holds the values K-major."""
    scaled = djax.load(wide_folder, jnp.float32, weights="fp8", fp8_impl="scaled")
    mosaic = scaled.with_options(fp8_impl="mosaic")
    attn, ff = mosaic.params["attn_0"], mosaic.params["ff_0"]
    assert attn["qkv"].shape == (1, 4, 64, 128) and attn["attn_out"].shape == (128, 1, 2, 64)
    assert ff["gate_up"].shape == (2, 128, 128) and ff["down"].shape == (128, 128)
    np.testing.assert_array_equal(
        np.asarray(ff["down"], np.float32), np.asarray(scaled.params["ff_0"]["down"], np.float32).T
    )
    loaded = djax.load(wide_folder, jnp.float32, weights="fp8", fp8_impl="mosaic")
    back = loaded.with_options(fp8_impl="scaled")
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(scaled.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    config = djax.GenerationConfig(gen_length=8, block_length=8, steps=4, cache="dual")
    choice = mosaic.kernel_choice(Shapes(batch=1, window=8, seq=12, kept=8))
    assert choice.block.layers.qkv == "fp8_mosaic" and choice.refresh.layers.qkv == "xla"
    prompts = [[0, 10, 20, 30]]
    ours = djax.generate(mosaic, prompts, config).answer_ids
    reference = djax.generate(scaled, prompts, config).answer_ids
    if jax.default_backend() == "cpu":  # the interpreter: the same tokens
        np.testing.assert_array_equal(ours, reference)
    else:  # the compiled kernel sums in its own order, and the fp8 head quantises each
        # path's last rows on its own: near ties may flip (2 of 8 tokens on an H100 at
        # 2bd7fa9); a wrong layout or scale gives other tokens nearly everywhere
        assert np.mean(ours == reference) >= 0.75


def test_fp8_weights_with_the_kernels_that_read_none(wide_folder):
    """What `auto` picks under fp8 on Hopper GPUs besides XLA's products (djax's attention
    and RoPE kernels, which read no weights; Mosaic GPU's interpreter here) gives the
    all-XLA path's logits, to bf16 rounding."""
    quantised = djax.load(wide_folder, jnp.bfloat16, weights="fp8")
    kernels = quantised.with_options(attention_impl="split_kv", rope_impl="mosaic")
    choice = kernels.kernel_choice(Shapes.whole_sequence(1, 16)).refresh.layers
    assert (choice.attention, choice.rope, choice.qkv) == ("split_kv", "mosaic", "xla")
    ids = np.random.default_rng(5).integers(4, 100, (1, 16))
    ours = np.asarray(djax.forward_logits(kernels, ids), np.float32)
    ref = np.asarray(djax.forward_logits(quantised, ids), np.float32)
    assert rel_error(ours, ref) <= 1e-2


def _stand_ins(monkeypatch):
    """Stand-ins for the fp8 Mosaic GPU kernels with their contracts (fp32 products of the
    e4m3 values, scaled by rows and columns), recording the K-major weights each gets:
    Mosaic GPU's interpreter does not run inside `shard_map` on CPU devices."""
    from djax.kernels import expert_tiles_mosaic
    from djax.kernels.handoff import Partials

    f32, got = jnp.float32, []

    def product(xq, x_scale, w_t, w_scale):  # [..., k] x [..., n, k] -> [..., n]
        if x_scale.shape != xq.shape[:-1]:  # per row and slice: [k / SLICE, rows]
            shape, slice_ = xq.shape, fp8_matmul_mosaic.SLICE
            rows = xq.astype(f32).reshape(-1, shape[-1] // slice_, slice_) * x_scale.T[..., None]
            xq, x_scale = rows.reshape(shape), jnp.ones(shape[:-1], f32)
        y = jnp.einsum("...k,...nk->...n", xq.astype(f32), w_t.astype(f32))
        return y * x_scale[..., None] * w_scale

    def matmul_partials(xq, x_scale, w_t, w_scale, tiles=None, dtype=jnp.bfloat16, **_):
        got.append(("matmul", w_t.shape))
        return Partials(product(xq, x_scale, w_t, w_scale)[None], jnp.dtype(dtype))

    def swiglu_matmul(
        xq, x_scale, w_t, w_scale, tiles=None, dtype=jnp.bfloat16, out_fp8=False, **_
    ):
        got.append(("swiglu", w_t.shape))
        gate, up = (product(xq, x_scale, w_t[i], w_scale[i]) for i in (0, 1))
        if out_fp8:
            values, scale = fp8_matmul_mosaic.quantize_slices(jax.nn.silu(gate) * up)
            return QuantizedRows(values, scale, jnp.dtype(dtype))
        return (jax.nn.silu(gate) * up).astype(dtype)

    def expert_mlp_fp8(x, source_rows, gate_up_t, gate_up_scale, down_t, down_scale, sizes, **_):
        got.append(("experts", gate_up_t.shape, down_t.shape))
        pairs = source_rows.shape[0]
        expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(pairs), side="right")
        expert = jnp.minimum(expert, sizes.shape[0] - 1)  # rows past the pairs: anything

        def each(rows, w_t, w_scale):  # every pair's row by its expert's weight
            y = jnp.einsum("pk,pnk->pn", rows, w_t[expert].astype(f32))
            return y * w_scale[expert]

        xq, x_scale = fp8_matmul_mosaic.quantize_rows(x[source_rows])
        rows = xq.astype(f32) * x_scale[:, None]
        gate, up = (each(rows, gate_up_t[:, i], gate_up_scale[:, i]) for i in (0, 1))
        aq, a_scale = fp8_matmul_mosaic.quantize_slices(jax.nn.silu(gate) * up)
        slices = aq.astype(f32).reshape(pairs, -1, fp8_matmul_mosaic.SLICE) * a_scale.T[..., None]
        return each(slices.reshape(aq.shape), down_t, down_scale).astype(x.dtype)

    def expert_mlp_fp8_every_token(x, counts, gate_up_t, gate_up_scale, down_t, down_scale, **_):
        tokens, experts = x.shape[0], counts.shape[0]
        every_token = jnp.tile(jnp.arange(tokens), experts)  # expert e's rows: all the tokens
        sizes = jnp.full(experts, tokens)
        weights = (gate_up_t, gate_up_scale, down_t, down_scale)
        return expert_mlp_fp8(x, every_token, *weights, sizes).reshape(experts, tokens, -1)

    monkeypatch.setattr(fp8_matmul_mosaic, "matmul_partials", matmul_partials)
    monkeypatch.setattr(fp8_matmul_mosaic, "swiglu_matmul", swiglu_matmul)
    monkeypatch.setattr(expert_tiles_mosaic, "expert_mlp_fp8", expert_mlp_fp8)
    monkeypatch.setattr(
        expert_tiles_mosaic, "expert_mlp_fp8_every_token", expert_mlp_fp8_every_token
    )
    return got


def _check_placed(model, mesh, reference):
    """Every param of `model` lies as `param_specs` (K-major) says and holds `reference`'s
    bits (the same model on one device)."""
    specs = param_specs(model.config, model.dtype, mesh, "fp8", k_major=True)
    for path, a in jax.tree_util.tree_leaves_with_path(model.params):
        spec, b = specs, reference.params
        for key in path:
            spec, b = spec[key.key], b[key.key]
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), path
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(path)
        )


@needs_devices
def test_k_major_values_under_tensor_parallel(tmp_path, monkeypatch):
    """Under a mesh `fp8_impl="mosaic"` holds each device's share of the values K-major
    (loaded so, or moved by `with_options`): the q/k/v and gate/up values split by their
    outputs, now their first axes, the attention-output and down values by their
    contractions, now their last. Each device's block forwards hand the fp8 kernels
    (stand-ins, `_stand_ins`) its own K-major slices, and give the tokens of the sharded
    `scaled` model, whose XLA products quantise the same rows."""
    got = _stand_ins(monkeypatch)
    make_llada_dense(
        tmp_path, d_model=256, n_heads=4, n_kv_heads=2, mlp_hidden=256, head_scale=6.0, seed=5
    )
    mesh = make_mesh(tensor_parallel=2)
    axis = mesh.axis_names[1]
    scaled = djax.load(tmp_path, jnp.float32, mesh=mesh, weights="fp8", fp8_impl="scaled")
    mosaic = djax.load(tmp_path, jnp.float32, mesh=mesh, weights="fp8", fp8_impl="mosaic")
    one_device = djax.load(tmp_path, jnp.float32, weights="fp8", fp8_impl="mosaic")
    specs = param_specs(mosaic.config, jnp.float32, mesh, "fp8", k_major=True)
    assert tuple(specs["attn_0"]["qkv"]) == (axis, None, None, None)  # [kv, g + 2, d, model]
    assert tuple(specs["attn_0"]["attn_out"]) == (None, axis, None, None)  # [model, kv, g, d]
    assert tuple(specs["ff_0"]["gate_up"]) == (None, axis, None)  # [2, hidden, model]
    assert tuple(specs["ff_0"]["down"]) == (None, axis)  # [model, hidden]
    _check_placed(mosaic, mesh, one_device)
    _check_placed(scaled.with_options(fp8_impl="mosaic"), mesh, one_device)
    back = mosaic.with_options(fp8_impl="scaled")
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(scaled.params), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    prompts = [[5, 6, 7], [9, 10, 11]]
    np.testing.assert_array_equal(
        djax.generate(mosaic, prompts, config).answer_ids,
        djax.generate(scaled, prompts, config).answer_ids,
    )
    head_dim = 256 // 4
    assert set(got) == {
        ("matmul", (4 * head_dim, 256)),  # q/k/v of 1 kv head a device: 2 queries, k, v
        ("matmul", (256, 2 * head_dim)),  # attention output and down, contracting 128
        ("swiglu", (2, 128, 256)),  # gate/up: 128 of the 256 hidden a device
    }


def _one_layer_moe(folder):
    """A one-layer LLaDA-MoE (4 experts of ffn 256, model 256) whose widths split in two
    still fit the fp8 kernels."""
    from torch_reference import make_llada_moe

    make_llada_moe(
        folder, d_model=256, n_layers=1, n_heads=2, n_kv_heads=2, n_experts=4,
        expert_hidden=256, head_scale=6.0, seed=7,
    )  # fmt: skip


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["tensor", "expert"])
def test_k_major_experts_under_a_mesh(tmp_path, monkeypatch, mesh_kind):
    """A one-layer LLaDA-MoE under tensor or expert parallelism with `fp8_impl="mosaic"`:
    each device holds its experts (or their ffn halves) K-major and hands them to the fp8
    expert kernel (a stand-in) in every forward. Under tensor parallelism a device's
    activation is one 128-column slice, so the kernel's scales per slice are `scaled`'s per
    row: the logits and tokens are the sharded `scaled` model's. Under expert parallelism
    each expert's activation is two slices, each with its own scales where `scaled` takes
    one a row: 3.4% of the logits' norm here (bound 5%; a lost scale or a wrong expert
    moves them by about their norm), and the logits and tokens are those of the kernel's
    path under tensor parallelism (the same scales). (One layer: with two under tensor
    parallelism, fp32 sums in another order before the second layer quantises its rows
    flip an e4m3 rounding for some inputs, moving one position's logits of 24, whatever the
    experts' path.)"""
    got = _stand_ins(monkeypatch)
    _one_layer_moe(tmp_path)
    mesh = make_mesh(**{f"{mesh_kind}_parallel": 2})
    scaled = djax.load(tmp_path, jnp.float32, mesh=mesh, weights="fp8", fp8_impl="scaled")
    mosaic = scaled.with_options(fp8_impl="mosaic")
    _check_placed(mosaic, mesh, djax.load(tmp_path, jnp.float32, weights="fp8", fp8_impl="mosaic"))
    ids = np.random.default_rng(8).integers(4, 100, (2, 12))
    ours = np.asarray(djax.forward_logits(mosaic, ids))
    # the shapes this model's forward handed the kernel (before another model's traces)
    experts = {item[1:] for item in got if item[0] == "experts"}
    bound = 1e-5 if mesh_kind == "tensor" else 5e-2
    assert rel_error(ours, np.asarray(djax.forward_logits(scaled, ids))) <= bound
    reference = scaled
    if mesh_kind == "expert":
        tp = make_mesh(tensor_parallel=2)
        reference = djax.load(tmp_path, jnp.float32, mesh=tp, weights="fp8", fp8_impl="mosaic")
        assert rel_error(ours, np.asarray(djax.forward_logits(reference, ids))) <= 1e-5
    if mesh_kind == "tensor":  # every expert, 128 of its 256 ffn a device
        assert experts == {((4, 2, 128, 256), (4, 256, 128))}
    else:  # 2 of the 4 experts a device
        assert experts == {((2, 2, 256, 256), (2, 256, 256))}
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    np.testing.assert_array_equal(
        djax.generate(mosaic, [[5, 6, 7]], config).answer_ids,
        djax.generate(reference, [[5, 6, 7]], config).answer_ids,
    )


def test_block_layer_lowers_for_hopper(monkeypatch):
    """LLaDA-8B's q/k/v and attention-output projections and SwiGLU MLP of a block forward
    (32 rows, bf16, K-major fp8 weights) lower to Mosaic GPU's custom calls for CUDA, the
    kernels compiled rather than interpreted (no GPU needed to lower)."""
    monkeypatch.setattr(tma_ring, "interpret_params", lambda interpret: None)
    fp8_type, f32 = jnp.float8_e4m3fn, jnp.float32
    spec = jax.ShapeDtypeStruct
    x = spec((1, 32, 4096), jnp.bfloat16)
    qkv = fp8.Fp8Weight(spec((32, 3, 128, 4096), fp8_type), spec((32, 3, 128), f32), True)
    out = fp8.Fp8Weight(spec((4096, 32, 1, 128), fp8_type), spec((4096,), f32), True)

    def projected(x, w):  # the layers' form: the weight as a matrix [k, n], then projected
        return project(x, fp8.matrix(w, 4096, w.values.size // 4096), "fp8_mosaic").parts

    for w in (qkv, out):
        traced = jax.jit(projected)
        assert "mosaic_gpu" in traced.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    mlp = GatedMLP(12288, jnp.bfloat16, weights="fp8", k_major=True)
    params = {
        "gate_up": spec((2, 12288, 4096), fp8_type),
        "gate_up_scale": spec((2, 12288), f32),
        "down": spec((4096, 12288), fp8_type),
        "down_scale": spec((4096,), f32),
    }
    kernels = Kernels(mlp="fp8_mosaic", down="fp8_mosaic", fp8="scaled")
    ff = jax.jit(lambda p, x: mlp.apply({"params": p}, x, kernels).parts).trace(params, x)
    assert ff.lower(lowering_platforms=("cuda",)).as_text().count("mosaic_gpu") >= 2


def test_the_dense_mlp_hands_its_activation_in_slices():
    """A dense MLP under `fp8_mosaic` (Mosaic GPU's interpreter off GPUs) of two 128-column
    slices of activation: the gate/up kernel quantises its fp32 activation per row and
    slice and the down kernel scales each slice's product by its own rows' scales, as the
    contract computed here in fp32 does; a scale applied to the wrong slice, or the rows'
    per-row quantisation, gives another output."""
    mlp = GatedMLP(256, jnp.float32, weights="fp8", k_major=True)
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((1, 8, 128)), jnp.float32)
    w = {
        "gate_up": jnp.asarray(0.1 * rng.standard_normal((128, 2, 256)), jnp.float32),
        "down": jnp.asarray(0.1 * rng.standard_normal((256, 128)), jnp.float32),
    }
    # the first slice's activation ~1e-5 of the second's, and as much of the output: a
    # scale per row would leave it a few e4m3 steps above zero
    w["gate_up"] = w["gate_up"].at[:, :, :128].multiply(0.003)
    w["down"] = w["down"].at[:128].multiply(1e5)
    params = fp8.to_layout(fp8.quantize_params({"ff": w}), True)["ff"]
    kernels = Kernels(mlp="fp8_mosaic", down="fp8_mosaic", fp8="scaled")
    ours = np.asarray(jax.jit(lambda p, x: finish(mlp.apply({"params": p}, x, kernels)))(params, x))

    f32 = jnp.float32
    xq, x_scale = fp8_matmul_mosaic.quantize_rows(x.reshape(8, 128))
    rows = xq.astype(f32) * x_scale[:, None]
    gate_up = params["gate_up"].astype(f32) * params["gate_up_scale"][..., None]  # [2, n, k]
    gate, up = (rows @ gate_up[i].T for i in (0, 1))
    act = jax.nn.silu(gate) * up
    down = params["down"].astype(f32) * params["down_scale"][:, None]  # [model, hidden]

    def down_of(values, scale):  # scale [hidden / 128, rows]
        slices = values.astype(f32).reshape(8, 2, 128) * scale.T[..., None]
        return np.asarray(slices.reshape(8, 256) @ down.T).reshape(1, 8, 128)

    reference = down_of(*fp8_matmul_mosaic.quantize_slices(act))
    per_row_q, per_row_scale = fp8_matmul_mosaic.quantize_rows(act)
    per_row = down_of(per_row_q, jnp.stack([per_row_scale] * 2))
    # on a GPU: Hopper's fp8 WGMMA accumulates with fewer bits than fp32, and a value at an
    # e4m3 midpoint may round apart
    tolerance = 1e-5 if jax.default_backend() == "cpu" else 1e-2
    assert rel_error(ours, reference) <= tolerance
    assert rel_error(per_row, reference) > 0.1  # the case tells the two apart


def test_expert_values_move_k_major_and_back():
    """`to_layout` moves the experts' values [e, model, 2, ffn] -> [e, 2, ffn, model] and
    [e, ffn, model] -> [e, model, ffn] (scales and other params as they are), and back bit
    for bit; the K-major weights read as their own layout (`shape`, einsum operands)."""
    rng = np.random.default_rng(6)
    params = {
        "ff_0": {
            "gate_up": jnp.asarray(rng.standard_normal((3, 128, 2, 64)), jnp.float32),
            "down": jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32),
            "router": jnp.asarray(rng.standard_normal((128, 3)), jnp.float32),
        }
    }
    stored = fp8.quantize_params(params)
    moved = fp8.to_layout(stored, True)["ff_0"]
    ff = stored["ff_0"]

    def bits(a):
        return np.asarray(a).view(np.uint8)

    np.testing.assert_array_equal(bits(moved["gate_up"]), bits(ff["gate_up"]).transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(bits(moved["down"]), bits(ff["down"]).transpose(0, 2, 1))
    for name in ("gate_up_scale", "down_scale", "router"):
        np.testing.assert_array_equal(moved[name], ff[name])
    back = fp8.to_layout({"ff_0": moved}, False)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(stored), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    gate_up = fp8.Fp8Weight(moved["gate_up"], moved["gate_up_scale"], True, leading=1)
    down = fp8.Fp8Weight(moved["down"], moved["down_scale"], True, leading=1)
    assert gate_up.shape == (3, 128, 2, 64) and down.shape == (3, 64, 128)
    assert gate_up.operand("emcf") == "ecfm" and down.operand("efm") == "emf"


def test_moe_model_runs_its_experts_in_the_fp8_kernels(tmp_path):
    """A one-layer LLaDA-MoE (4 experts top-2, model and expert ffn 128) loaded with
    `fp8_impl="mosaic"`: its experts held K-major and run by fp8 x fp8 WGMMA (Mosaic GPU's
    interpreter) in a whole-sequence forward. Its logits are `dequant`'s within the rows'
    e4m3 quantisation (XLA's `scaled` path, which quantises the same rows, is 7% of the
    norm from `dequant` here: a bound of 10%) and `scaled`'s within 6% (the kernels round
    the activation once from fp32 before quantising it, `scaled` in bf16, a GPU's products
    sum in another order than the interpreter's, and the fp8 head quantises each path's
    last rows on its own: 2.6% on a CPU, 4.8% on an H100); a lost scale or wrong expert
    moves them by about their norm."""

    from torch_reference import make_llada_moe

    make_llada_moe(
        tmp_path, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=4,
        expert_hidden=128, seed=7,
    )  # fmt: skip
    dequant = djax.load(tmp_path, jnp.bfloat16, weights="fp8", fp8_impl="dequant")
    mosaic = dequant.with_options(fp8_impl="mosaic")
    assert mosaic.params["ff_0"]["gate_up"].shape == (4, 2, 128, 128)
    assert mosaic.params["ff_0"]["down"].shape == (4, 128, 128)
    assert mosaic.kernel_choice(Shapes.whole_sequence(1, 16)).refresh.layers.moe == "fp8_mosaic"
    ids = np.random.default_rng(8).integers(4, 100, (1, 16))
    ours = np.asarray(djax.forward_logits(mosaic, ids), np.float32)
    ref = np.asarray(djax.forward_logits(dequant, ids), np.float32)
    scaled = djax.forward_logits(dequant.with_options(fp8_impl="scaled"), ids)
    assert np.isfinite(ours).all() and rel_error(ours, ref) <= 1e-1
    assert rel_error(ours, np.asarray(scaled, np.float32)) <= 6e-2
    # the K-major params under a fallback's options (`auto_as_xla`: `dequant`, XLA's
    # experts, `dense` over that layout) give the stored layout's `dequant` logits
    fallback = dataclasses.replace(mosaic, options=KernelOptions().auto_as_xla())
    assert fallback.kernel_choice(Shapes.whole_sequence(1, 16)).refresh.layers.moe == "dense"
    held = np.asarray(djax.forward_logits(fallback, ids), np.float32)
    np.testing.assert_allclose(held, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "family, mesh_kind", [("dense", "tensor"), ("moe", "tensor"), ("moe", "expert")]
)
def test_the_kernels_under_a_mesh_of_gpus(tmp_path, family, mesh_kind):
    """The compiled fp8 kernels under a mesh of 2 GPUs (the CPU tests above run stand-ins):
    with `fp8_impl="mosaic"` a one-layer model's logits (LLaDA-MoE's experts run in the
    kernels there) and its tokens (every block forward's products run in them) are the
    mesh's `scaled` ones within rounding, the bounds of the one-GPU tests. The reference is
    `scaled` on the same mesh, not one GPU: where a product's contraction is split, each
    device quantises its share of a row with a scale of its own (on a CPU, 7% of these
    one-layer logits' norm between the mesh and one device, in `scaled` as in `mosaic`).
    Under expert parallelism the experts' activation is two 128-column slices with scales
    of their own where `scaled` takes one a row (3.4% of the logits' norm on a CPU): there
    the tokens are compared with the kernels' under tensor parallelism on the same GPUs,
    whose devices each quantise one slice. A device handed another device's slice, or a
    lost scale, moves them by about their norm."""
    if family == "dense":
        make_llada_dense(
            tmp_path, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden=256,
            head_scale=6.0, seed=5,
        )  # fmt: skip
    else:
        _one_layer_moe(tmp_path)
    mesh = make_mesh(**{f"{mesh_kind}_parallel": 2})
    mosaic = djax.load(tmp_path, jnp.float32, mesh=mesh, weights="fp8", fp8_impl="mosaic")
    scaled = mosaic.with_options(fp8_impl="scaled")
    ids = np.random.default_rng(8).integers(4, 100, (2, 16))
    ours = np.asarray(djax.forward_logits(mosaic, ids), np.float32)
    assert np.isfinite(ours).all()
    assert rel_error(ours, np.asarray(djax.forward_logits(scaled, ids), np.float32)) <= 6e-2
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    prompts = [[5, 6, 7], [9, 10, 11]]
    reference = scaled
    if mesh_kind == "expert":
        tp = make_mesh(tensor_parallel=2)
        reference = djax.load(tmp_path, jnp.float32, mesh=tp, weights="fp8", fp8_impl="mosaic")
    tokens = djax.generate(mosaic, prompts, config).answer_ids
    assert np.mean(tokens == djax.generate(reference, prompts, config).answer_ids) >= 0.75


def test_convert_to_fp8_on_hopper_stores_the_checkpoint_layout(tmp_path, monkeypatch):
    """`convert --weights fp8` on a Hopper GPU (pretended), where `auto` would hold the
    values K-major, stores them in the checkpoints' layout."""
    src = tmp_path / "src"
    make_llada_dense(src, d_model=256, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden=256)
    monkeypatch.setattr(programs, "device_of", lambda mesh: HOPPER)
    out = djax.convert(src, tmp_path / "out", jnp.bfloat16, progress=False, weights="fp8")
    loaded = djax.load(out, jnp.bfloat16, fp8_impl="dequant")
    assert not loaded.k_major
    expected = abstract_params(loaded.config, jnp.bfloat16, "fp8")
    assert loaded.params["attn_0"]["qkv"].shape == expected["attn_0"]["qkv"].shape


def test_the_executable_cache_tells_the_layouts_apart(tmp_path, monkeypatch):
    """Two models of the same options, one holding its values as stored, one K-major (a
    fallback's state), each run a program of their own layout (`executable_key` reads no
    params: it names `k_major`)."""
    make_llada_dense(tmp_path, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=256)
    stored = djax.load(tmp_path, jnp.float32, weights="fp8", fp8_impl="dequant")
    held = dataclasses.replace(stored.with_options(fp8_impl="mosaic"), options=stored.options)
    assert held.k_major and not stored.k_major and held.options == stored.options
    monkeypatch.setattr(engine, "_EXECUTABLES", {})
    config = djax.GenerationConfig(gen_length=8, block_length=8, steps=8, cache="dual")
    a = djax.generate(stored, [[5, 6, 7, 8]], config).answer_ids
    b = djax.generate(held, [[5, 6, 7, 8]], config).answer_ids
    np.testing.assert_array_equal(a, b)
