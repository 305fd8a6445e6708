#!/usr/bin/env python
"""Encode a recipe's raw data once into a latent cache, then train from it.

    accelerate launch recipes/precompute.py --config recipes/configs/sana_1600m_t2i.yaml --out data/sana_cache
    accelerate launch recipes/train.py --config recipes/configs/sana_1600m_t2i.yaml --data_dir data/sana_cache

Uses the recipe's pretrained, data_dir, resolution, num_frames, max_sequence_length,
train_batch_size (encoding batch) and num_workers; other keys are accepted and ignored.
"""

from __future__ import annotations

import argparse
import logging
import sys

from accelerate import Accelerator

from mhla_diffusion.training.config import load_config, parse_overrides
from mhla_diffusion.training.launch import run_recipe
from mhla_diffusion.training.precompute import precompute


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML; any other --key value overrides one of its keys")
    parser.add_argument("--out", required=True, help="new directory for the cache")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.config, parse_overrides(rest))
    accelerator = Accelerator()
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING)
    info = precompute(cfg, args.out, accelerator)
    if accelerator.is_main_process:
        print(f"wrote {info['samples']} samples to {args.out} ({info['unreadable']} unreadable files skipped)")


if __name__ == "__main__":
    sys.exit(run_recipe(main))
