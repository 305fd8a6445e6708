"""mhla-diffusion: multi-head linear attention (MHLA) for pretrained diffusers transformers.

Importing this package does not import diffusers (only loading checkpoints does), so the
operator and kernels work on machines without it.
"""

from .blocks import auto_blocks
from .config import MHLAConfig
from .conversion import (
    attn_processors,
    convert,
    default_config,
    is_converted,
    mhla_parameters,
    mhla_processors,
    set_attn_processor,
)
from .ops import mhla_attention
from .persistence import from_pretrained

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
