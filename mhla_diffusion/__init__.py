"""mhla-diffusion: multi-head linear attention (MHLA) for pretrained diffusers transformers.

Importing this package does not import diffusers (only loading checkpoints does), so the
operator and kernels work on machines without it.
"""

import os as _os

# The Triton kernels live in the repo's top-level kernels/ (a namespace dir, installed as
# mhla_diffusion/kernels by pyproject); in a source checkout, find them beside this package.
if _os.path.isdir(_os.path.join(_os.path.dirname(__path__[0]), "kernels")):
    __path__.append(_os.path.dirname(__path__[0]))

from .blocks import auto_blocks  # noqa: E402
from .config import MHLAConfig  # noqa: E402
from .conversion import (  # noqa: E402
    attn_processors,
    convert,
    default_config,
    is_converted,
    mhla_parameters,
    mhla_processors,
    set_attn_processor,
)
from .ops import mhla_attention  # noqa: E402
from .persistence import from_pretrained  # noqa: E402


def __getattr__(name):
    """The MHLA model classes (`MHLAWanTransformer3DModel`, ...), built on first use so that importing
    the package does not import diffusers. diffusers' pipeline loader finds them here by the
    `["mhla_diffusion", "MHLA..."]` entries of `model_index.json` (and asks for `ModelMixin` beside them)."""
    if name == "ModelMixin" or name.startswith("MHLA") and name.endswith("Model"):
        from . import models

        return models.ModelMixin if name == "ModelMixin" else models.class_named(name)
    raise AttributeError(f"module 'mhla_diffusion' has no attribute {name!r}")


__all__ = [
    "MHLAConfig",
    "attn_processors",
    "auto_blocks",
    "convert",
    "default_config",
    "from_pretrained",
    "is_converted",
    "mhla_attention",
    "mhla_parameters",
    "mhla_processors",
    "set_attn_processor",
]
