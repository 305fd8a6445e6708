"""How a recipe run ends: a user error as one line on stderr and exit 2, Ctrl-C or SIGTERM as the
command that resumes (on stdout) and exit 130, instead of tracebacks around the message.

`--debug` (anywhere in the recipe's arguments) or MHLA_DEBUG=1 keeps the traceback; only the
main process speaks (cli.main.report_errors).
"""

from __future__ import annotations

import os
import shlex
import sys

from ..cli.main import debug_requested, report_errors
from .train_config import config_source

DROPPED_ON_RESUME = ("resume", "overwrite_output_dir")  # the resume command must not delete the run


def resume_command(script: str, argv: list[str]) -> str:
    """The command line that continues this run from its latest checkpoint."""
    kept, i = [], 0
    while i < len(argv):
        key = argv[i][2:].partition("=")[0].replace("-", "_") if argv[i].startswith("--") else None
        takes_value = "=" not in argv[i] and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if key in DROPPED_ON_RESUME:
            i += 2 if takes_value else 1
            continue
        kept.append(argv[i])
        i += 1
    return shlex.join(["accelerate", "launch", script, *kept, "--resume", "latest"])


def check_precision(config, overrides: dict, source) -> None:
    """`accelerate launch --mixed_precision P` and the recipe's `mixed_precision` must agree: a YAML
    value must not silently override the launch flag. A `--mixed_precision` given to the recipe itself
    wins, as any `--key value` does; the launcher's default ("no") defers to the recipe."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched not in ("no", config.mixed_precision) and "mixed_precision" not in overrides:
        raise ValueError(f"accelerate launch --mixed_precision {launched} disagrees with mixed_precision "
                         f"{config.mixed_precision} from {config_source(source)}: pass --mixed_precision "
                         f"{launched} to the recipe as well (or change its config)")


def run_recipe(main, resumable: bool = False, argv=None) -> int:
    """`main(argv)` (sys.argv by default) as a process exit status."""
    script = sys.argv[0]
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested("--debug" in argv)
    argv = [a for a in argv if a != "--debug"]
    interrupted = f"interrupted; continue with: {resume_command(script, argv)}" if resumable else "interrupted"
    # The resume line goes to stdout: accelerate launch 1.16 tees the child's stderr, and the chunk that
    # reaches it with the Ctrl-C is lost in its interrupted read; stdout it leaves alone.
    return report_errors(lambda: main(argv), os.path.basename(script), debug, interrupted, interrupted_to=sys.stdout)
