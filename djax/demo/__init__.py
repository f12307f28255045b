"""The small dLLM that ships with djax: its tokenizer, task, trainer and packaged weights.

`default_model_path()` is the packaged model folder (an HF LLaDA layout that `djax.load`
opens); `describe()` gives a one-line label for it and `generation_defaults()` the answer
layout it was trained for (`djax generate` with no `--model` should use both).
"""

from __future__ import annotations

from pathlib import Path

from djax.config import read_json_object

MODEL_DIR = Path(__file__).parent / "model"
METADATA = "demo.json"  # the training record `djax.demo.train` writes beside the weights
EXAMPLE_PROMPTS = ("347+2958=", "sort 3,9,1,4,1,7", "reverse diffusion")


def default_model_path() -> Path:
    """The packaged demo model folder `djax/demo/model/`."""
    if not (MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo model is not installed at {MODEL_DIR}; train it with "
            f"`python -m djax.demo.train --out {MODEL_DIR}` or pass a model folder"
        )
    return MODEL_DIR


def model_info(path: str | Path | None = None) -> dict | None:
    """The training record of a demo model folder (default: the packaged one), or None when
    the folder holds no demo model."""
    folder = MODEL_DIR if path is None else Path(path)
    record = folder / METADATA
    if not record.is_file():
        return None
    return read_json_object(record)


def describe(path: str | Path | None = None) -> str | None:
    """A one-line label for a demo model folder (None when it is not one), e.g.
    "djax demo model: tiny LLaDA, 2.04M params, trained 12000 steps on NVIDIA H200; it
    answers 'A+B=', 'sort x,y,...' and 'reverse letters' (try '347+2958=')"."""
    info = model_info(path)
    if info is None:
        return None
    label = (
        f"djax demo model: tiny LLaDA, {info['n_params'] / 1e6:.2f}M params, trained "
        f"{info['steps']} steps on {info['trained_on']}"
    )
    if info.get("platform") == "cpu":
        label += " (development build, CPU-trained)"
    return (
        f"{label}; it answers 'A+B=', 'sort x,y,...' and 'reverse letters' "
        f"(try {EXAMPLE_PROMPTS[0]!r})"
    )


def generation_defaults(path: str | Path | None = None) -> dict:
    """`GenerationConfig` fields the demo model was trained for (gen_length, block_length):
    its folder's `generation_config.json`, which `djax convert` copies along."""
    from djax.generation import generation_defaults

    return generation_defaults(MODEL_DIR if path is None else path)
