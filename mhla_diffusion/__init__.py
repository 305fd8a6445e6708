"""mhla-diffusion: multi-head linear attention (MHLA) for pretrained diffusers transformers."""

from .blocks import auto_blocks
from .config import MHLAConfig
from .ops import mhla_attention

__all__ = [
    "MHLAConfig",
    "auto_blocks",
    "mhla_attention",
    "convert",
    "mhla_processors",
    "set_attn_processor",
    "attn_processors",
    "mhla_parameters",
    "is_converted",
    "from_pretrained",
    "default_config",
]

_LAZY = {  # these import diffusers-facing code; kept lazy so the op imports without diffusers
    "convert": "convert",
    "mhla_processors": "convert",
    "set_attn_processor": "convert",
    "attn_processors": "convert",
    "mhla_parameters": "convert",
    "is_converted": "convert",
    "default_config": "convert",
    "from_pretrained": "persistence",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
