"""Entry point: builds the parser from the command modules and turns user errors into one line."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module registers its sub-commands: register(subparsers) -> None, handlers set `func`.
COMMAND_MODULES = ["convert", "transfer", "info", "demo", "eval", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mhla-diffusion",
        description="Retrofit diffusers transformers with multi-head linear attention (MHLA).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, NotADirectoryError, OSError) as err:
        print(f"mhla-diffusion {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mhla-diffusion {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
