"""Does conversion keep quality? See mhla_diffusion/experiments/digits.py and the README.

    python recipes/experiments/digits.py                 # one GPU, sized for a few minutes
    python recipes/experiments/digits.py --preset toy    # the whole pipeline on a CPU in about a minute
"""

import sys

from mhla_diffusion.experiments.digits import main

if __name__ == "__main__":
    sys.exit(main())
