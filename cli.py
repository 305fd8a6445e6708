"""`python cli.py ...` from the repo root: the same as the `mhla-diffusion` console script."""

import sys

from mhla_diffusion.cli import main

if __name__ == "__main__":
    sys.exit(main())
