"""djax: a JAX/XLA-compiled inference engine for diffusion language models.

Public API: `load`, `convert`, `forward_logits`, `generate`, `GenerationConfig`,
`make_mesh`, `init_distributed`.
"""

from djax.config import ConfigError, ModelConfig
from djax.engine import GenerationConfig, GenerationOutput, GenerationStats, generate
from djax.model import Model, convert, forward_logits, load

__all__ = [
    "ConfigError",
    "GenerationConfig",
    "GenerationOutput",
    "GenerationStats",
    "Model",
    "ModelConfig",
    "convert",
    "forward_logits",
    "generate",
    "load",
]
