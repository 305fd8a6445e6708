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
