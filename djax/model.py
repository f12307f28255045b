"""`djax.load` and the loaded `Model`: config, params, tokenizer, and the Flax module that
runs them; `forward_logits` is the full-sequence debugging and parity entry point."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from djax import checkpoint, folders, programs, sharding
from djax.config import ConfigError, ModelConfig, from_hf_dict, load_hf_config, resolve_token_ids
from djax.generation import generation_defaults
from djax.kernel_options import KernelOptions
from djax.models import abstract_params, fp8
from djax.models.kernel_choice import KernelChoice, Shapes

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Characters orbax's save reads as a pattern in a folder's path (it globs the save folder).
GLOB_CHARACTERS = "[]*?"
# What `convert` copies beside the weights: the config, the tokenizer and generation
# defaults, and the demo model's training record (`djax.demo`).
MODEL_FILES = ("config.json", *TOKENIZER_FILES, "demo.json")


@dataclasses.dataclass
class Model:
    """A loaded model: what `generate` and `forward_logits` take.

    `params` is the plain nested dict of arrays (possibly sharded over `mesh`); `options`
    are the kernel options (`KernelOptions`), resolved for each program it runs
    (`kernel_choice`); `weights` is the params' weight format (`djax.models.fp8.WEIGHTS`:
    `dtype`, every weight in `dtype`, or `fp8`, the projections and experts as e4m3 values
    `<name>` beside fp32 scales `<name>_scale`); `k_major`: the fp8 values, the dense
    products' and experts', are K-major, the layout of the fp8 x fp8 kernels, which `load`
    and `with_options` give them where the options take those kernels on the model's
    device (`kernel_choice.holds_k_major`).
    """

    config: ModelConfig
    params: dict
    tokenizer: Any | None
    dtype: Any
    path: str | None = None
    mesh: Any | None = None
    options: KernelOptions = KernelOptions()
    weights: str = "dtype"
    k_major: bool = False

    def with_options(self, **options: Any) -> Model:
        """This model with kernel `options` replaced (checked as `load` checks them); where
        they change the fp8 values' layout (`kernel_choice.holds_k_major`), with its params
        moved to the new one (a copy of the fp8 values)."""
        new = self.options.replace(**options)
        wanted = programs.holds_k_major(new, self.config, self.dtype, self.mesh, self.weights)
        params = self.params
        if wanted != self.k_major:
            placed = _shardings(self.config, self.dtype, self.mesh, self.weights, wanted)
            params = fp8.to_layout(params, wanted, placed)
        return dataclasses.replace(self, options=new, params=params, k_major=wanted)

    def kernel_choice(self, shapes: Shapes) -> KernelChoice:
        """What the kernel options resolve to on this model's device for forwards of
        `shapes` (`KernelChoice.explain()` prints it; `djax.engine.kernel_choice` gives a
        generation's)."""
        return programs.kernel_choice(
            self.options,
            self.config,
            self.dtype,
            shapes,
            self.mesh,
            weights=self.weights,
            k_major=self.k_major,
        )


# The dtypes a model computes (and `convert` stores) in.
COMPUTE_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))


def compute_dtype(dtype: Any) -> Any:
    """`dtype` as a numpy dtype, one of `COMPUTE_DTYPES`; a ValueError naming it otherwise
    (an integer dtype failed inside the random init, an 8-bit float generated nothing)."""
    try:
        checked = jnp.dtype(dtype)
    except TypeError:
        checked = None
    if checked not in COMPUTE_DTYPES:
        names = ", ".join(d.name for d in COMPUTE_DTYPES)
        raise ValueError(f"dtype={dtype!r}; expected one of {names}")
    return checked


def default_dtype() -> Any:
    """bf16 on accelerators, fp32 on the CPU (where bf16 matmuls are slow and tests want fp32)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load_tokenizer(folder: str | Path) -> Any | None:
    """The folder's HF tokenizer, or None when it has no tokenizer files; ConfigError naming
    the folder when they cannot be read."""
    folder = Path(folder)
    if (
        not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        return None
    try:
        if (folder / "tokenizer.json").is_file():
            # Straight to the fast tokenizer: AutoTokenizer would consult config.json, whose
            # `model_type: llada` transformers does not know, and importing it imports torch
            # where torch is installed (seconds of start-up).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as err:  # tokenizers and transformers raise many kinds on bad files
        raise ConfigError(
            f"{folder}: its tokenizer files (tokenizer.json, tokenizer_config.json) cannot be "
            f"read: {type(err).__name__}: {err}"
        ) from err


def read_config(folder: str | Path, tokenizer: Any | None) -> ModelConfig:
    """The folder's config; a config.json that declares quantised weights
    (`quantization_config`) raises a ConfigError naming its method: djax quantises from
    full-precision weights itself (`weights="fp8"`)."""
    folder = Path(folder)
    hf = load_hf_config(folder)
    source = str(folder / "config.json")
    if hf.get("quantization_config") is not None:  # null: not quantised
        quant = hf["quantization_config"]
        method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"{source}: declares quantised weights (quantization_config with quant_method="
            f"{method!r}); djax does not load pre-quantised checkpoints (their block-wise "
            "scales included): load the full-precision model, with weights='fp8' "
            "(CLI: --weights fp8) to store its projections in fp8"
        )
    return resolve_token_ids(from_hf_dict(hf, source), tokenizer, source)


def load(
    path: str | Path,
    dtype: Any = None,
    *,
    mesh: Any = None,
    weights: str | None = None,
    allow_pickle: bool = False,
    progress: bool = False,
    **options: Any,
) -> Model:
    """Load an HF model folder or a folder written by `djax convert`.

    dtype: compute and storage dtype (default: bf16 on GPU/TPU, fp32 on CPU). mesh: a
    `jax.sharding.Mesh` from `djax.make_mesh` to load straight into shards. weights: the
    weight format (`djax.models.fp8`): `"dtype"` (every weight in `dtype`) or `"fp8"` (every
    projection and expert weight as e4m3 with an fp32 scale per output channel, quantised
    as loaded); default: what a converted folder holds, else `"dtype"`. A converted folder
    holding another format than `weights` raises a CheckpointError. options: the
    fields of `djax.kernel_options.KernelOptions` (`attention_impl="auto"|"xla"|"cudnn"|
    "split_kv"`, `mlp_impl`, `matmul_impl` and `rope_impl`, each `"auto"|"xla"|"mosaic"`,
    `moe_impl="auto"|"xla"|"mosaic"`,
    `norm_impl="auto"|"xla"|"mosaic"|"fused"|"tiled"`,
    `fp8_impl="auto"|"dequant"|"scaled"|"mosaic"`; where the fp8 x fp8 kernels run, under
    `mosaic` or `auto`, the fp8 values are held K-major, `Model.k_major`). An unknown
    option name
    raises a TypeError naming the closest valid one, and a value outside its choices a
    ValueError naming them, before anything is read.
    """
    kernel_options = KernelOptions.from_keywords(options)
    if weights is not None:
        fp8.check_weights(weights)
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh={mesh!r:.60}; expected a jax.sharding.Mesh (djax.make_mesh) or None")
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model path {str(folder)!r} is not a folder; expected an HF "
            "model folder or one written by `djax convert`"
        )
    checkpoint.check_complete(folder)
    dtype = compute_dtype(dtype or default_dtype())
    tokenizer = load_tokenizer(folder)
    config = read_config(folder, tokenizer)
    if checkpoint.is_converted(folder):
        stored = checkpoint.stored_weights(folder)
        if weights not in (None, stored):
            raise checkpoint.CheckpointError(
                f"{folder}: holds {stored!r} weights (converted with --weights {stored}); "
                f"weights={weights!r} contradicts it: leave weights unset (or pass "
                f"{stored!r}), or convert the source again with --weights {weights}"
            )
        weights = stored
        shardings = _shardings(config, dtype, mesh, weights)
        k_major = programs.holds_k_major(kernel_options, config, dtype, mesh, weights)
        if k_major:  # its program compiles while the params are read
            avals = checkpoint.restored_avals(config, dtype, shardings, weights)
            layout = _k_major_layout(avals, config, dtype, mesh, weights).compile_ahead(avals)
        params = checkpoint.restore_orbax(folder, config, dtype, shardings, weights)
    else:
        weights = weights or "dtype"
        bar = _progress_bar(f"loading {folder.name}") if progress else None
        shardings = _shardings(config, dtype, mesh, "dtype")
        params = checkpoint.load_hf_params(folder, config, dtype, shardings, allow_pickle, bar)
        if weights == "fp8":
            params = fp8.quantize_params(params, _shardings(config, dtype, mesh, weights))
        k_major = programs.holds_k_major(kernel_options, config, dtype, mesh, weights)
        if k_major:
            layout = _k_major_layout(params, config, dtype, mesh, weights)
    if k_major:
        params = layout(params)
    return Model(
        config, params, tokenizer, dtype, str(folder), mesh, kernel_options, weights, k_major
    )


def _shardings(
    config: ModelConfig, dtype: Any, mesh: Any, weights: str, k_major: bool = False
) -> dict | None:
    return None if mesh is None else sharding.param_shardings(config, dtype, mesh, weights, k_major)


def _k_major_layout(
    params: dict, config: ModelConfig, dtype: Any, mesh: Any, weights: str
) -> fp8.Layout:
    """The move of a load's fp8 values (`params`: arrays or avals) K-major."""
    return fp8.Layout.of(params, True, _shardings(config, dtype, mesh, weights, True))


def _progress_bar(description: str):
    from tqdm import tqdm

    return functools.partial(tqdm, desc=description, unit="param")


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: Any = jnp.bfloat16,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool = True,
    weights: str = "dtype",
) -> Path:
    """HF folder -> orbax checkpoint folder that `djax.load` opens directly, its weights in
    the format `weights` (`load`'s; under `"fp8"` the e4m3 values and fp32 scales are stored,
    so loading does not quantise again, and the folder's `djax.json` records it).

    `src` is only read, and is checked whole (config, every tensor's header, dtype and
    shape) before anything is written. A `dst` that is, lies inside or holds `src` is
    refused (symlinks resolved), and a non-empty one unless `overwrite` and it is a folder
    `convert` wrote (it holds `djax.json`): no other folder is ever deleted. The new folder is
    written beside `dst` and renamed into place once written and verified; an old `dst` is
    deleted only then. An error or interrupt (SIGINT, SIGTERM) leaves `dst` as it was.
    Copies `MODEL_FILES` (config, tokenizer, generation defaults) along.
    """
    fp8.check_weights(weights)
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"source {str(src)!r} is not a folder; expected an HF model folder")
    if checkpoint.is_converted(src):
        raise ConfigError(f"{src}: already a djax checkpoint; nothing to convert")
    target = folders.check_apart(src, dst)
    pattern = sorted(set(GLOB_CHARACTERS) & set(str(target)))
    if pattern:
        raise ValueError(
            f"output {str(dst)!r}: its path holds {''.join(pattern)!r}, which orbax's save "
            "reads as a file pattern; expected a path without any of [ ] * ?"
        )
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"output {str(dst)!r} is a file; expected a folder")

    def replaceable(folder: Path) -> bool:
        return checkpoint.convert_wrote(folder, MODEL_FILES)

    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"output folder {str(dst)!r} is not empty; pass "
                "overwrite=True (CLI: --overwrite) to replace it"
            )
        if not replaceable(target):
            raise FileExistsError(
                f"output folder {str(dst)!r} is not a folder djax convert wrote (its "
                f"{checkpoint.MARKER}, {checkpoint.PARAMS_DIR}/ and the model files, nothing "
                "else), and overwrite replaces only those; empty it or choose another"
            )
    left = folders.leftovers(target)
    if left:
        logging.getLogger("djax").warning(
            "%d folder(s) beside %s were left by an interrupted convert (or one still "
            "running): %s; delete them to free their space",
            len(left),
            dst,
            ", ".join(p.name for p in left),
        )
    dtype = compute_dtype(dtype)
    config = read_config(src, load_tokenizer(src))
    generation_defaults(src)  # copied along: a bad one is refused now, not at every load
    checkpoint.open_checked(src, config, dtype, allow_pickle)
    with folders.staged(target) as staging:
        # `dequant` holds the values as stored (`auto` may hold them K-major on this
        # device): checkpoints keep the layout `abstract_params` describes
        model = load(
            src,
            dtype,
            weights=weights,
            allow_pickle=allow_pickle,
            progress=progress,
            fp8_impl="dequant",
        )
        for name in MODEL_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, staging / name)
        metadata = {
            "family": config.family,
            "dtype": dtype.name,
            "weights": weights,
            "source": str(src.absolute()),
        }
        checkpoint.save_orbax(staging, model.params, metadata)
        checkpoint.check_orbax(staging, abstract_params(config, dtype, weights))
        folders.replace(staging, target, replaceable if overwrite else None)
    return dst


def forward_logits(
    model: Model, token_ids: Any, attention_mask: Any = None, *, block_length: int | None = None
) -> jax.Array:
    """Full-sequence fp32 logits [batch, seq, vocab].

    token_ids: [batch, seq] ints; attention_mask: [batch, seq], 1 for real tokens and 0 for
    padding (left padding: positions count from each row's first real token). Padding keys
    are masked out of every row's attention. Attention is bidirectional, or with
    `block_length=B` block-causal (LLaDA2's block diffusion): a position sees its own block
    and the earlier ones, blocks of B positions counted from each row's first real token.
    """
    if block_length is not None and (
        not isinstance(block_length, int) or isinstance(block_length, bool) or block_length < 1
    ):
        raise ValueError(f"block_length={block_length!r}; expected a positive int or None")
    ids = np.asarray(token_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or not ids.size:
        raise ValueError(
            f"token_ids has shape {ids.shape} and dtype {ids.dtype}; expected [batch, seq] "
            "integers, at least one of each"
        )
    if ids.shape[1] > model.config.max_seq_len:
        raise ValueError(
            f"token_ids holds {ids.shape[1]} positions; expected at most the model's maximum "
            f"sequence length {model.config.max_seq_len}"
        )
    if ids.min() < 0 or ids.max() >= model.config.vocab_size:
        raise ValueError(
            f"token_ids hold values in [{ids.min()}, {ids.max()}]; expected ids in "
            f"[0, {model.config.vocab_size})"
        )
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask, bool)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {mask.shape}; expected {ids.shape}")
    kernels = model.kernel_choice(Shapes.whole_sequence(*ids.shape))
    fn = programs.forward_program(model.config, model.dtype, kernels, model.mesh, block_length)
    return fn(model.params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
