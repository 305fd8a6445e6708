"""Does conversion keep quality? See mhla_diffusion/experiments/digits.py and the README.

    python recipes/experiments/digits.py                 # one GPU, sized for a few minutes
    python recipes/experiments/digits.py --preset toy    # the whole pipeline on a CPU in about a minute
    python recipes/experiments/digits.py --preset mosaic-full   # 1,024 tokens: 4x4 mosaics of real scans, one H200, ~10 min
    python recipes/experiments/digits.py --preset mosaic-toy    # the mosaic pipeline on a CPU in under a minute
"""

import sys

from mhla_diffusion.experiments.digits import main

if __name__ == "__main__":
    sys.exit(main())
