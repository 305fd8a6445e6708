"""When does a softmax teacher start using attention? See mhla_diffusion/experiments/teacher_probe.py.

    python recipes/experiments/teacher_probe.py --runs ddpm@3e-4 flow@3e-4 --steps 4000 --precision bf16   # one H200
    python recipes/experiments/teacher_probe.py --preset mosaic-random-toy --steps 6 --every 3             # a CPU, seconds
"""

import sys

from mhla_diffusion.experiments.teacher_probe import main

if __name__ == "__main__":
    sys.exit(main())
