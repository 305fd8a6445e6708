"""`mhla-diffusion` command line: one module per command group, each with `register(subparsers)`."""

from .main import main

__all__ = ["main"]
