"""Per-pixel bound of the random-mosaic experiment (issue 21), from the repo root:
`PYTHONPATH=. python recipes/experiments/results/mosaic-random-1024-v2/pixel_bound.py` (CPU, seconds).

The eps-loss of the best denoiser that sees only its own pixel (and its position, and the digit class of
its cell when given): the level a model with no spatial context (uniform attention) can reach. The
computation is `teacher_probe.pixel_bound`, which the teacher probe records beside every run."""
import torch
torch.set_num_threads(1)
from mhla_diffusion.experiments.digits_data import load_digits
from mhla_diffusion.experiments.pixel_dit import Process
from mhla_diffusion.experiments.teacher_probe import pixel_bound
scans = load_digits(8)
print("per-pixel MMSE eps-loss, position only (random mosaics):", pixel_bound(scans.train_images, Process()))
print("per-pixel MMSE eps-loss, position + cell's digit class (fixed layouts, no dropout):",
      pixel_bound(scans.train_images, Process(), scans.train_labels))
