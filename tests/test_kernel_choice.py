"""`KernelOptions` (validated at `load`), `resolve` on fake device descriptions, the
compile-failure fallback to XLA, and `djax generate --explain`."""

import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax import engine
from djax.config import DENSE, LLADA2, MOE, ModelConfig
from djax.kernel_options import KERNEL_OPTIONS, KernelOptions
from djax.kernels import flash_attention_mosaic
from djax.models import kernel_choice
from djax.models.kernel_choice import Device, Kernels, Shapes, describe, resolve

ROOT = Path(__file__).resolve().parents[1]
HOPPER = Device("gpu", (9, 0), 227 * 1024)
AMPERE = Device("gpu", (8, 0), 163 * 1024)
CPU = Device("cpu")
BF16 = jnp.bfloat16
# LLaDA-8B's shape, and LLaDA-MoE's (7B-A1B)
LLADA_8B = ModelConfig(DENSE, 126464, 4096, 32, 32, 32, 128, 12288, 5e5, 1e-5, 4096, 1, 2, 3)
LLADA_MOE = ModelConfig(
    MOE, 157184, 2048, 16, 16, 16, 128, 8192, 5e4, 1e-6, 8192, 1, 2, 3, qk_norm=True,
    n_experts=64, experts_per_token=8, expert_hidden=1024, moe_layers=(True,) * 16,
)  # fmt: skip
# batch 1, prompt 128 + gen 256, blocks of 32, dual cache
GENERATION = Shapes(batch=1, window=32, seq=384, kept=32)


def _choice(options=None, device=HOPPER, config=LLADA_8B, dtype=BF16, **kwargs):
    options = options or KernelOptions()
    return resolve(options, device, config, dtype, kwargs.pop("shapes", GENERATION), **kwargs)


def test_options_refuse_unknown_names_and_values():
    with pytest.raises(TypeError, match="did you mean 'attention_impl'.*expected one of"):
        KernelOptions.from_keywords({"atention_impl": "xla"})
    with pytest.raises(ValueError, match=r"moe_impl='hopper'; expected one of \('auto'"):
        KernelOptions(moe_impl="hopper")  # removed: it never won
    options = KernelOptions(mlp_impl="xla")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.mlp_impl = "mosaic"
    assert options.replace(rope_impl="mosaic").items()[-2:] == [
        ("rope_impl", "mosaic"),
        ("moe_impl", "auto"),
    ]
    assert dict(KernelOptions(norm_impl="tiled").auto_as_xla().items()) == {
        **{name: "xla" for name in KERNEL_OPTIONS},
        "norm_impl": "tiled",
        "fp8_impl": "dequant",
    }


def test_cli_choices_come_from_the_dataclass():
    fields = {f.name: f.metadata["choices"] for f in dataclasses.fields(KernelOptions)}
    assert {name: o.choices for name, o in KERNEL_OPTIONS.items()} == fields
    assert KERNEL_OPTIONS["attention_impl"].flag == "--attention-impl"


def test_load_refuses_a_typo_before_reading(tmp_path):
    with pytest.raises(TypeError, match="unknown kernel option 'atention_impl'; did you mean"):
        djax.load(tmp_path / "missing", atention_impl="xla")  # before the path is looked at


def test_describe_reads_capability_and_shared_memory():
    @dataclasses.dataclass
    class FakeGpu:
        platform: str = "gpu"
        compute_capability: str = "9.0"
        shared_memory_per_block_optin: int = 232448

    assert describe(FakeGpu()) == Device("gpu", (9, 0), 232448)
    assert describe(FakeGpu(compute_capability="8.6")).compute_capability == (8, 6)
    assert describe(jax.devices("cpu")[0]) == CPU
    assert HOPPER.runs_kernels
    assert not AMPERE.runs_kernels  # too little shared memory and an older capability
    assert not Device("gpu", (9, 0), 100 * 1024).runs_kernels
    assert not Device("gpu", (10, 0), 227 * 1024).runs_kernels  # no WGMMA
    assert not CPU.runs_kernels


def test_auto_on_a_hopper_gpu():
    """Blocks take every kernel (the q/k/v product inside the RoPE kernel, the norm before
    the feed-forward tiled into the products); refreshes of 384 rows keep XLA's products
    and RoPE (their windows are longer than the RoPE kernel's 64 rows)."""
    choice = _choice()
    block = choice.block.layers
    assert block == Kernels(
        attention="split_kv",
        qkv="rope",
        rope="mosaic",
        out="mosaic",
        mlp="mosaic",
        down="mosaic",
        norm="mosaic",
        norm_into_mlp="tiled",
        moe="none",
    )
    assert choice.block.last == block  # a dual-cache block keeps every row
    refresh = choice.refresh.layers
    assert (refresh.attention, refresh.rope, refresh.norm) == ("split_kv", "xla", "mosaic")
    assert (refresh.qkv, refresh.out, refresh.mlp, refresh.down) == ("xla",) * 4
    assert refresh.norm_into_mlp == "no"
    assert choice.refresh.last.out == choice.refresh.last.mlp == "mosaic"  # the kept block
    assert choice.refresh.last.norm_into_mlp == "tiled"


def test_auto_elsewhere_is_xla():
    blackwell = Device("gpu", (10, 0), 227 * 1024)  # no WGMMA
    for device, dtype in ((AMPERE, BF16), (CPU, BF16), (blackwell, BF16), (HOPPER, jnp.float32)):
        choice = _choice(device=device, dtype=dtype)
        assert choice.block.layers == Kernels(moe="none"), (device, dtype)
        cudnn = device.platform == "gpu" and dtype == BF16
        assert choice.refresh.layers.attention == ("cudnn" if cudnn else "xla")


def test_auto_rows_and_shapes():
    batch8 = _choice(shapes=Shapes(8, 32, 384, 32)).block.layers  # 256 rows
    assert (batch8.qkv, batch8.mlp, batch8.norm_into_mlp) == ("xla", "xla", "no")
    assert batch8.rope == "mosaic" and batch8.attention == "split_kv"  # on XLA's product
    prefix = _choice(shapes=Shapes(1, 256, 384, 32)).block  # a prefix-cache window
    assert (prefix.layers.qkv, prefix.layers.rope) == ("xla", "xla")  # 256-row windows
    assert prefix.last.mlp == "mosaic"
    tp4 = _choice(shards=4, sharded=True).block.layers  # 8 kv heads x 3: 24 CTAs a row tile
    assert (tp4.qkv, tp4.rope) == ("mosaic", "mosaic")  # the RoPE kernel after the product
    assert tp4.norm_into_mlp == "no"  # summed before any norm
    odd = _choice(config=LLADA_8B.replace(head_dim=96, d_model=3072)).block.layers
    assert (odd.attention, odd.rope) == ("xla", "xla")  # no 64-wide tiles of 96
    assert (odd.qkv, odd.out, odd.mlp) == ("mosaic",) * 3  # its products are multiples of 64
    narrow = _choice(config=LLADA_8B.replace(mlp_hidden=1000)).block.layers
    assert (narrow.mlp, narrow.down, narrow.out, narrow.norm_into_mlp) == (
        "xla",
        "xla",
        "mosaic",
        "no",
    )


def test_kernels_only_where_their_shapes_fit():
    """Attention heads whose smallest program overflows shared memory take XLA; block
    diffusion's whole-sequence choice (run on windows of a block, two, the prompt) keeps
    XLA's RoPE even where its sequence would fit the kernel; a model without a dense MLP
    names none."""
    assert flash_attention_mosaic.fits(320) and not flash_attention_mosaic.fits(384)
    for head_dim in (64, 128, 256, 320):  # every tiling `tiles_for` gives fits
        for t, s, heads in ((384, 384, 32), (32, 1280, 32)):
            tiles = flash_attention_mosaic.tiles_for(t, s, heads, head_dim)
            assert tiles.shared_bytes(head_dim, 2, tiles.splits > 1) <= 224 * 1024
    wide = LLADA_8B.replace(head_dim=384, n_heads=8, n_kv_heads=8)
    assert _choice(config=wide).block.layers.attention == "xla"
    short = Shapes(batch=1, window=8, seq=48, kept=8)
    block_diffusion = LLADA_8B.replace(family=LLADA2)
    assert _choice(config=block_diffusion, shapes=short).refresh.layers.rope == "xla"
    assert _choice(config=LLADA_8B, shapes=short).refresh.layers.rope == "mosaic"
    assert _choice(config=LLADA_MOE).block.layers.mlp == "xla"  # experts in every layer
    fp8 = _choice(KernelOptions(fp8_impl="mosaic"), config=LLADA_MOE, weights="fp8").block
    assert (fp8.layers.qkv, fp8.layers.mlp, fp8.layers.down) == ("rope", "xla", "xla")


def test_moe_choice():
    """The expert tiles (`mosaic`) run every forward's experts, 16-bit or fp8 weights
    (fp8 ones where the fp8 x fp8 tiles do not run), on Hopper under `auto` and wherever
    asked; other devices take XLA's grouped path (dense above 64 tokens); 16-bit
    activations and widths of 64s only."""
    scaled = KernelOptions(fp8_impl="scaled")
    for weights in ("dtype", "fp8"):
        choice = _choice(scaled, config=LLADA_MOE, weights=weights)
        assert choice.block.layers.moe == choice.refresh.layers.moe == "mosaic"
        # a block's 32 tokens fit one row tile: every token through each routed expert
        assert (choice.block.layers.expert_rows, choice.refresh.layers.expert_rows) == (
            "tokens",
            "pairs",
        )
    fp8_mosaic = _choice(config=LLADA_MOE, weights="fp8")  # `auto`, as `mosaic`
    assert fp8_mosaic.block.layers.moe == "fp8_mosaic"
    assert fp8_mosaic.block.layers.expert_rows == "tokens"
    assert fp8_mosaic.refresh.layers.expert_rows == "pairs"
    assert _choice(config=LLADA_MOE).block.layers.qkv == "rope"  # 16 kv heads x 3 CTAs
    blackwell = Device("gpu", (10, 0), 227 * 1024)  # no WGMMA
    for device in (AMPERE, CPU, blackwell):
        choice = _choice(config=LLADA_MOE, device=device)
        assert (choice.block.layers.moe, choice.refresh.layers.moe) == ("grouped", "dense")
        assert choice.block.layers.expert_rows == "pairs"  # a layout of the tiles only
    narrow = _choice(config=LLADA_MOE.replace(expert_hidden=48)).block.layers
    assert narrow.moe == "grouped"
    mosaic = KernelOptions(moe_impl="mosaic")
    for weights in ("dtype", "fp8"):
        choice = _choice(mosaic, CPU, LLADA_MOE, weights=weights)
        assert choice.block.layers.moe == choice.refresh.layers.moe == "mosaic"
    with pytest.raises(ValueError, match="moe_impl='mosaic' takes .* model dtype; got float32"):
        _choice(mosaic, CPU, LLADA_MOE, dtype=jnp.float32)
    _choice(mosaic, CPU, LLADA_8B, dtype=jnp.float32)  # no experts: moe_impl does not apply
    with pytest.raises(ValueError, match="moe_impl='mosaic' takes .* 64; got model 2048, local"):
        _choice(mosaic, CPU, LLADA_MOE.replace(expert_hidden=48))


def test_explicit_options():
    """An explicit kernel runs wherever it fits, off GPUs included; the products and the norm
    moved into them keep their row limits; cuDNN runs only refreshes."""
    mosaic = KernelOptions(mlp_impl="mosaic", matmul_impl="mosaic", norm_impl="fused")
    choice = _choice(mosaic, CPU)
    assert choice.refresh.layers.mlp == choice.refresh.layers.out == "xla"  # 384 rows
    assert choice.refresh.layers.norm_into_mlp == "no"
    block = choice.block.layers
    assert (block.qkv, block.out, block.mlp, block.down) == ("mosaic",) * 4
    assert (block.norm_into_mlp, block.norm, block.rope) == ("fused", "mosaic", "xla")
    cudnn = _choice(KernelOptions(attention_impl="cudnn"))
    assert (cudnn.block.layers.attention, cudnn.refresh.layers.attention) == ("xla", "cudnn")
    with pytest.raises(ValueError, match="'cudnn' takes bf16 or fp16 inputs; got float32"):
        _choice(KernelOptions(attention_impl="cudnn"), dtype=jnp.float32)
    split_kv = _choice(KernelOptions(attention_impl="split_kv"), CPU)
    assert split_kv.block.layers.attention == split_kv.refresh.layers.attention == "split_kv"
    with pytest.raises(ValueError, match="'split_kv' takes bf16 or fp16 inputs; got float32"):
        _choice(KernelOptions(attention_impl="split_kv"), dtype=jnp.float32)
    with pytest.raises(ValueError, match="'split_kv' takes a head dim .* 64; got 96"):
        _choice(KernelOptions(attention_impl="split_kv"), config=LLADA_8B.replace(head_dim=96))
    for option in ("matmul_impl", "mlp_impl", "rope_impl", "norm_impl"):
        for value in ("mosaic", "fused", "tiled") if option == "norm_impl" else ("mosaic",):
            with pytest.raises(ValueError, match=f"{option}='{value}' takes bfloat16 or float16"):
                _choice(KernelOptions(**{option: value}), CPU, dtype=jnp.float32)
    with pytest.raises(
        ValueError,
        match="mlp_impl='mosaic' takes .* 64; got model and hidden widths 4096 -> \\[1008",
    ):
        _choice(KernelOptions(mlp_impl="mosaic"), config=LLADA_8B.replace(mlp_hidden=1008))
    with pytest.raises(
        ValueError, match="matmul_impl='mosaic' takes .* 64; got a product 1008 -> 4096"
    ):
        _choice(KernelOptions(matmul_impl="mosaic"), config=LLADA_8B.replace(mlp_hidden=1008))
    with pytest.raises(ValueError, match="mlp_impl='mosaic' takes 16-bit weights; with weights"):
        _choice(KernelOptions(mlp_impl="mosaic"), weights="fp8")


def test_mosaic_rope():
    """`rope_impl="mosaic"` runs the q/k/v product with RoPE in its epilogue where the
    product runs djax's kernel (LLaDA-8B's and LLaDA-MoE's block forwards), RoPE on the
    product made apart elsewhere in block windows (XLA's product, `scaled` fp8), XLA's product
    and RoPE in refreshes (384-row windows)."""
    for config in (LLADA_8B, LLADA_MOE):
        choice = _choice(KernelOptions(rope_impl="mosaic"), CPU, config=config)
        assert (choice.block.layers.rope, choice.block.layers.qkv) == ("mosaic", "xla")
        choice = _choice(KernelOptions(rope_impl="mosaic", matmul_impl="mosaic"), config=config)
        assert (choice.block.layers.rope, choice.block.layers.qkv) == ("mosaic", "rope")
        assert (choice.block.last.rope, choice.block.last.qkv) == ("mosaic", "rope")
        assert (choice.refresh.layers.rope, choice.refresh.layers.qkv) == ("xla", "xla")
    fp8 = _choice(KernelOptions(rope_impl="mosaic", fp8_impl="scaled"), weights="fp8")
    assert (fp8.block.layers.rope, fp8.block.layers.qkv) == ("mosaic", "xla")
    with pytest.raises(ValueError, match="rope_impl='mosaic' takes head_dim in .*got head_dim=96"):
        _choice(KernelOptions(rope_impl="mosaic"), config=LLADA_8B.replace(head_dim=96))
    odd = _choice(shapes=Shapes(1, 12, 384, 12)).block.layers  # 12 rows: not a multiple of 8
    assert (odd.rope, odd.qkv) == ("xla", "mosaic")
    even = _choice(shapes=Shapes(1, 16, 384, 16)).block.layers
    assert (even.rope, even.qkv) == ("mosaic", "rope")


def test_explain_lists_each_forward():
    text = _choice().explain()
    assert text.splitlines()[0].startswith("block forward: attention=split_kv, qkv=rope,")
    assert "refresh: attention=split_kv, qkv=xla," in text
    assert "  last layer, kept rows: out=mosaic, mlp=mosaic, down=mosaic," in text


def test_fallback_to_xla_when_a_kernel_does_not_compile(dense_model, monkeypatch):
    """Kernels `auto` chose (on a GPU the test pretends to run on) that fail to compile
    are replaced by XLA's paths, with a warning; the tokens are XLA's."""
    params = jax.tree.map(lambda a: a.astype(BF16), dense_model.params)
    model = dataclasses.replace(dense_model, params=params, dtype=BF16)  # `auto` needs 16 bits
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    xla = model.with_options(**dict(KernelOptions().auto_as_xla().items()))
    ref = djax.generate(xla, [[0, 10, 20, 30]], config)
    compiled = []
    real_compile = engine._compile

    def compile_xla_only(model, plan, args, run, kernels):
        if kernels.block.layers.out == "mosaic":  # 64 -> 64: the split-K product
            raise RuntimeError("mosaic_gpu: no kernel image for this GPU")
        compiled.append(kernels)
        return real_compile(model, plan, args, run, kernels)

    monkeypatch.setattr(engine.programs, "device_of", lambda mesh: HOPPER)
    monkeypatch.setattr(engine, "_compile", compile_xla_only)
    monkeypatch.setattr(engine, "_EXECUTABLES", {})
    plan = engine.make_plan(model, config, 1, 4)[0]
    assert engine.kernel_choice(model, plan).block.layers.out == "mosaic"
    with pytest.warns(UserWarning, match=r"kernels do not compile on gpu 9\.0.*no kernel image"):
        ours = djax.generate(model, [[0, 10, 20, 30]], config)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
    assert compiled == [engine.kernel_choice(xla, plan)]


def test_explicit_kernels_that_fail_are_not_replaced(dense_model, monkeypatch):
    params = jax.tree.map(lambda a: a.astype(BF16), dense_model.params)
    model = dataclasses.replace(dense_model, params=params, dtype=BF16)  # mosaic takes 16 bits
    wider = model.config.replace(mlp_hidden=128)  # every product's widths multiples of 64
    model = dataclasses.replace(model, config=wider)  # (the params are never read: no compile)

    def failing(model, plan, args, run, kernels):
        raise RuntimeError("mosaic_gpu: no kernel image")

    monkeypatch.setattr(engine, "_compile", failing)
    monkeypatch.setattr(engine, "_EXECUTABLES", {})
    config = djax.GenerationConfig(gen_length=16, block_length=8, steps=8, cache="dual")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match="no kernel image"):
            # every other option XLA's, so that no `auto` kernel could be replaced either
            # (on a Hopper GPU `auto` takes djax's kernels, whose fallback would warn)
            explicit = dict(matmul_impl="mosaic", mlp_impl="xla", attention_impl="xla")
            explicit |= dict(norm_impl="xla", rope_impl="xla")
            djax.generate(model.with_options(**explicit), [[0, 10]], config)


def test_cli_explain(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "DJAX_COMPILE_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]  # conftest.py's quick CPU compile
    out = subprocess.run(
        [sys.executable, "-m", "djax.cli", "generate", "--explain", "--prompt", "1+2=",
         "--gen-length", "16", "--block-length", "8", "--mlp-impl", "xla"],
        capture_output=True, text=True, env=env, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert "device: cpu" in out
    assert "kernel options: attention_impl=auto, mlp_impl=xla," in out
    assert re.search(r"batch 1, prompt \d+, gen 16, block 8, cache dual", out)
    assert "block forward: attention=xla, qkv=xla, rope=xla," in out
    assert out.index("block forward:") < out.index("> 1+2=")  # before the answers


def test_norm_options():
    """`norm_impl`: `auto` moves the norm before the feed-forward into the products where
    djax's kernels run (`AUTO_NORM`); the norms no product takes run the per-row kernel
    (`mosaic`) under every form but `xla`, where the model width fits it (4160-wide rows do
    not: XLA's, or a ValueError where `mosaic` was asked for)."""
    assert kernel_choice.AUTO_NORM in KERNEL_OPTIONS["norm_impl"].choices
    for norm_impl in ("auto", "mosaic", "fused", "tiled"):
        choice = _choice(KernelOptions(norm_impl=norm_impl))
        assert choice.block.layers.norm == choice.refresh.layers.norm == "mosaic", norm_impl
        into = {"auto": kernel_choice.AUTO_NORM, "mosaic": "no"}.get(norm_impl, norm_impl)
        assert choice.block.layers.norm_into_mlp == into, norm_impl
    xla = _choice(KernelOptions(norm_impl="xla")).block.layers
    assert (xla.norm, xla.norm_into_mlp) == ("xla", "no")
    assert _choice(KernelOptions(matmul_impl="xla")).block.layers.norm_into_mlp == "no"
    odd = LLADA_8B.replace(d_model=4096 + 64)  # Mosaic GPU products, not whole 512-blocks
    assert _choice(KernelOptions(norm_impl="tiled"), config=odd).block.layers.norm == "xla"
    with pytest.raises(ValueError, match="norm_impl='mosaic' takes a model width .*; got 4160"):
        _choice(KernelOptions(norm_impl="mosaic"), config=odd)


def test_auto_mosaic_experts():
    """`auto` takes the Mosaic GPU expert tiles, fp8 experts as 16-bit ones, only where
    their widths are multiples of 64 (XLA's grouped path otherwise)."""
    narrow = _choice(config=LLADA_MOE.replace(expert_hidden=48), weights="fp8").block.layers
    assert narrow.moe == "grouped"


def test_readme_documents_every_option_value_and_kernel_module():
    """The README's options table has one row per option naming each of its values, and its
    code layout names every kernel module, as does `djax.kernels`' docstring; `load`'s
    docstring names every value."""
    import djax.kernels

    for name, option in KERNEL_OPTIONS.items():
        assert name in djax.load.__doc__, name
        for value in option.choices:
            assert f'"{value}"' in djax.load.__doc__, (name, value)

    readme = (ROOT / "README.md").read_text()
    cli = readme.split("\n## The CLI\n", 1)[1].split("\n## ", 1)[0]
    api = next(line for line in readme.splitlines() if line.startswith("| `djax.load(path"))
    for name, option in KERNEL_OPTIONS.items():
        assert f"`{option.flag}`" in cli and f"`{name}`" in api, name
        rows = [line for line in readme.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, name
        for value in option.choices[1:]:
            assert f"`{value}`" in rows[0], (name, value)
    layout = next(line for line in readme.splitlines() if line.startswith("| `djax/kernels/` |"))
    for module in sorted((ROOT / "djax" / "kernels").glob("[a-z]*.py")):
        assert f"`{module.stem}`" in layout, module.stem
        assert f"`{module.stem}`" in djax.kernels.__doc__, module.stem


@pytest.mark.parametrize("batch", [1, 8])
def test_auto_block_forward_lowers_for_hopper(monkeypatch, batch):
    """A LLaDA-8B layer's block forward (32 rows a sequence against a 384-position buffer,
    bf16) under `auto`'s Hopper choice lowers for CUDA with its parts in their Mosaic GPU
    kernels, compiled rather than interpreted (no GPU needed to lower). Batch 1: the q/k/v
    product with RoPE, attention, the output product and tiled add, the SwiGLU product, the
    down product and the per-row norm after it; batch 8 (256 rows: XLA's products): RoPE on
    XLA's q/k/v product, attention and the two per-row norms."""
    from djax.kernels import tma_ring
    from djax.models.layers import Window
    from djax.programs import local_module

    monkeypatch.setattr(tma_ring, "interpret_params", lambda interpret: None)
    config = LLADA_8B.replace(n_layers=1)
    choice = _choice(config=config, shapes=Shapes(batch, 32, 384, 32))
    layers = choice.block.layers
    assert (layers.qkv, layers.norm_into_mlp) == (
        ("rope", "tiled") if batch == 1 else ("xla", "no")
    )
    module = local_module(config, BF16, choice, None)
    spec = jax.ShapeDtypeStruct
    buffer = spec((batch, 384, 32, 128), BF16)
    args = (
        spec((batch, 32, 4096), BF16),  # the window's embeddings
        spec((batch, 32), jnp.int32),  # positions
        spec((batch, 384), jnp.bool_),  # key_valid
        ((buffer, buffer),),
        Window(spec((), jnp.int32)),
    )

    def forward(params, *args):
        return module.apply(params, *args, block_forward=True)

    params = jax.eval_shape(
        lambda *a: module.init(jax.random.key(0), *a, block_forward=True), *args
    )
    text = jax.jit(forward).trace(params, *args).lower(lowering_platforms=("cuda",)).as_text()
    # q/k/v + RoPE, attention, output, tiled add, SwiGLU, down, norm
    kernels = re.findall(r"custom_call @mosaic_gpu\w*", text)
    assert len(kernels) == (7 if batch == 1 else 4), kernels


@pytest.mark.skipif(
    jax.default_backend() == "gpu",
    reason="token for token only against the interpreter: compiled, XLA's fp16 fusions "
    "round elsewhere (tests/kernels checks the compiled kernels against references)",
)
def test_generation_with_every_mosaic_kernel_is_xlas(tmp_path):
    """A ragged two-row fp16 generation with the dual cache (block windows at each row's own
    positions, the last layer's kept rows) with every Mosaic GPU kernel asked for (Mosaic
    GPU's interpreter here) gives XLA's tokens and forward counts. In bf16 the kernels'
    other rounding may flip a near tie of this random model and the tokens after it."""
    from torch_reference import make_llada_dense

    make_llada_dense(
        tmp_path, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=128, seed=4
    )
    xla = djax.load(tmp_path, jnp.float16)
    mosaic = xla.with_options(
        attention_impl="split_kv",
        matmul_impl="mosaic",
        mlp_impl="mosaic",
        rope_impl="mosaic",
        norm_impl="tiled",
    )
    # two blocks of 2 steps (a fixed-steps decoder: `threshold`, the default, would take a
    # step a token here): the interpreted kernels' runtime is most of this test's
    config = djax.GenerationConfig(
        gen_length=16, block_length=8, steps=4, decoder="low_confidence", cache="dual"
    )
    prompts = [[0, 10, 20, 30, 40, 50], [0, 11, 12]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the interpreted kernels' export
        ours = djax.generate(mosaic, prompts, config)
    ref = djax.generate(xla, prompts, config)
    np.testing.assert_array_equal(ours.answer_ids, ref.answer_ids)
    assert (ours.stats.forwards, ours.stats.refreshes) == (ref.stats.forwards, ref.stats.refreshes)


def test_moe_shared_expert_follows_the_product_kernels(tmp_path, monkeypatch):
    """A LLaDA-MoE layout with a shared expert (random weights, fp16), a 16-row forward
    with the Mosaic GPU products and expert tiles asked for (Mosaic GPU's interpreter here):
    the shared expert's down product (64 -> 64) runs the split-K kernel as the dense layer's
    (128 -> 64) does, and the logits are XLA's to fp16 rounding."""
    from djax.kernels import split_k_mosaic
    from djax.model import Model
    from djax.models import init_params

    from torch_reference import make_llada_moe, rel_error

    make_llada_moe(
        tmp_path, dense_layers=(0,), n_layers=2, expert_hidden=64, dense_hidden=128, seed=2
    )
    config = dataclasses.replace(djax.load(tmp_path).config, shared_expert_hidden=64)
    params = init_params(config, jnp.float16, seed=4)
    assert "shared" in params["ff_1"]
    model = Model(config, params, None, jnp.float16)
    mosaic = model.with_options(matmul_impl="mosaic", mlp_impl="mosaic", moe_impl="mosaic")
    products, kernel = [], split_k_mosaic.matmul_partials

    def spy(x, w, *args, **kwargs):
        products.append(w.shape)
        return kernel(x, w, *args, **kwargs)

    monkeypatch.setattr(split_k_mosaic, "matmul_partials", spy)
    ids = np.random.default_rng(3).integers(4, 100, (1, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the interpreted kernels' export
        ours = np.asarray(djax.forward_logits(mosaic, ids), np.float32)
    ref = np.asarray(djax.forward_logits(model.with_options(moe_impl="xla"), ids), np.float32)
    assert (64, 64) in products and (128, 64) in products  # shared and dense down products
    assert rel_error(ours, ref) <= 1e-2


def test_forward_with_every_mosaic_kernel_is_xlas(tmp_path):
    """A whole-sequence forward of 16 rows (a forward the products take) with every Mosaic
    GPU kernel asked for (Mosaic GPU's interpreter here): the split-K q/k/v product, then the
    RoPE kernel on its partials (4 heads: too few to run the product inside it), split-K/V
    attention, the output product with the tiled add into the SwiGLU kernel, the down
    product; its logits are XLA's to bf16 rounding."""
    from torch_reference import make_llada_dense, rel_error

    make_llada_dense(
        tmp_path, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, mlp_hidden=128, seed=4
    )
    xla = djax.load(tmp_path, BF16)
    options = {"matmul_impl": "mosaic", "mlp_impl": "mosaic", "rope_impl": "mosaic"}
    mosaic = xla.with_options(**options, attention_impl="split_kv", norm_impl="tiled")
    layers = mosaic.kernel_choice(Shapes.whole_sequence(1, 16)).refresh.layers
    assert (layers.qkv, layers.rope, layers.attention) == ("mosaic", "mosaic", "split_kv")
    assert (layers.out, layers.mlp, layers.down, layers.norm_into_mlp) == (
        ("mosaic",) * 3 + ("tiled",)
    )
    ids = np.random.default_rng(6).integers(4, 100, (1, 16))
    ours = np.asarray(djax.forward_logits(mosaic, ids), np.float32)
    ref = np.asarray(djax.forward_logits(xla, ids), np.float32)
    assert rel_error(ours, ref) <= 1e-2
