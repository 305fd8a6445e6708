#!/usr/bin/env python
"""Encode a recipe's raw data once into a latent cache, then train from it.

    accelerate launch recipes/precompute.py --config recipes/configs/sana_1600m_t2i_1024.yaml --out data/sana_cache
    accelerate launch recipes/train.py --config recipes/configs/sana_1600m_t2i_1024.yaml --data_dir data/sana_cache

Uses the recipe's pretrained, data_dir, resolution, num_frames, max_sequence_length,
train_batch_size (encoding batch) and num_workers; other keys are accepted and ignored.

Without a dataset, the original model's own samples make the cache (resumable: rerun the same command):

    accelerate launch recipes/precompute.py --config recipes/configs/wan21_t2v_1_3b.yaml --out data/teacher_samples \
        --teacher_samples 2000 --prompts prompts.txt
    accelerate launch recipes/train.py --config recipes/configs/wan21_t2v_1_3b.yaml --config recipes/configs/teacher_only.yaml
"""

from __future__ import annotations

import argparse
import logging
import sys

from accelerate import Accelerator

from mhla_diffusion.training.train_config import load_config, parse_overrides
from mhla_diffusion.training.launch import run_recipe
from mhla_diffusion.training.precompute import precompute
from mhla_diffusion.training.teacher_cache import write_teacher_cache


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="recipe YAML; give it again to layer another on top (its keys win: "
                        "a family's config, then configs/teacher_only.yaml); any other --key value overrides one of its keys")
    parser.add_argument("--out", required=True, help="new directory for the cache")
    teacher = parser.add_argument_group("teacher samples instead of a dataset")
    teacher.add_argument("--teacher_samples", type=int, default=0, help="samples of the original model to cache (0: encode data_dir)")
    teacher.add_argument("--prompts", help="text file, one prompt per line (text-to-image/video models); sample i gets prompt i mod count")
    teacher.add_argument("--teacher_steps", type=int, help="denoising steps (default: the pipeline's)")
    teacher.add_argument("--teacher_guidance", type=float, help="classifier-free guidance scale (default: the pipeline's)")
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.config, parse_overrides(rest))
    accelerator = Accelerator()
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING)
    if args.teacher_samples:
        info = write_teacher_cache(cfg, args.out, args.teacher_samples, args.prompts, args.teacher_steps,
                                   args.teacher_guidance, accelerator)
    else:
        info = precompute(cfg, args.out, accelerator)
    if accelerator.is_main_process:
        print(f"wrote {info['samples']} samples to {args.out} ({info['unreadable']} unreadable files skipped)")


if __name__ == "__main__":
    sys.exit(run_recipe(main))
