"""djax: a JAX/XLA-compiled inference engine for diffusion language models.

Public API: `load`, `convert`, `forward_logits`, `generate`, `GenerationConfig`,
`make_mesh`, `init_distributed`. Each name is imported on first use, so `import djax` (and
`djax --help`) does not import jax.
"""

import importlib
from importlib import metadata

try:
    __version__ = metadata.version("djax")
except metadata.PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

_EXPORTS = {
    "ConfigError": "djax.config",
    "ModelConfig": "djax.config",
    "GenerationConfig": "djax.generation",
    "GenerationOutput": "djax.engine",
    "GenerationStats": "djax.engine",
    "generate": "djax.engine",
    "Model": "djax.model",
    "convert": "djax.model",
    "forward_logits": "djax.model",
    "load": "djax.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'djax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
