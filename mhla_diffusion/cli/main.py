"""Entry point: builds the parser from the command modules and turns user errors into one line.

`mhla-diffusion --debug COMMAND ...` or MHLA_DEBUG=1 shows the traceback instead; the recipes
(recipes/train.py, recipes/precompute.py) end through the same `report_errors`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..interrupts import terminate_as_interrupt

# Each module registers its sub-commands: register(subparsers) -> None, handlers set `func`.
COMMAND_MODULES = ["convert", "transfer", "info", "demo", "eval", "bench"]
# What bad input raises (FileNotFoundError, NotADirectoryError, FileExistsError are OSErrors);
# anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)


def counted(n: int, noun: str) -> str:
    """'1 sample', '3 samples': counts in messages."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get("MHLA_DEBUG", "") not in ("", "0")


def report_errors(call, prog: str, debug: bool, interrupted: str = "interrupted", interrupted_to=None) -> int:
    """`call()`'s exit status; a user error becomes one line on stderr and 2, Ctrl-C or SIGTERM the line
    `interrupted` (on `interrupted_to`, stderr by default) and 130 (tracebacks when `debug`). Under a
    launcher only RANK 0 speaks: every process meets the same bad input, and N copies of the line would bury it."""
    speak = os.environ.get("RANK", "0") == "0"
    with terminate_as_interrupt():  # SIGTERM too, and the message is printed before a second one lands
        try:
            return call() or 0
        except USER_ERRORS as err:
            if debug:
                raise
            if speak:
                print(f"{prog}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if debug:
                raise
            if speak:
                print(f"{prog}: {interrupted}", file=interrupted_to or sys.stderr, flush=True)
            return 130


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, where it has one worth showing and the text does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
        return f"{text} (default: %(default)s)" if shown and (action.option_strings or action.nargs) else text


class Parser(argparse.ArgumentParser):
    """Every command's parser (add_subparsers makes its sub-parsers of the parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("mhla-diffusion")
    except PackageNotFoundError:  # a checkout that was not installed (`python cli.py`)
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mhla-diffusion", description="Retrofit diffusers transformers with multi-head linear attention (MHLA).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error (or set MHLA_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return report_errors(lambda: args.func(args), f"mhla-diffusion {args.command}", debug_requested(args.debug))


if __name__ == "__main__":
    sys.exit(main())
