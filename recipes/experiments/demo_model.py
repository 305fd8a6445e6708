"""Train the model `mhla-diffusion demo` ships (mhla_diffusion/assets/digits/) with the digits
experiment's own code: see mhla_diffusion/experiments/digits_demo.py.

    python recipes/experiments/demo_model.py --out mhla_diffusion/assets/digits   # one GPU, about 2 minutes
"""

import argparse
import json
import sys
from pathlib import Path

from mhla_diffusion.experiments.digits import PRESETS
from mhla_diffusion.experiments.digits_demo import make_assets

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="assets folder to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full", help="the digits experiment's sizes and steps")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    args = p.parse_args()
    print(json.dumps(make_assets(args.out, args.preset, args.device), indent=2))
    sys.exit(0)
