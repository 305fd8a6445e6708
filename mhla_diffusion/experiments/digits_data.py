"""scikit-learn's bundled handwritten digits (1,797 real 8x8 scans, no download) as images in [-1, 1].

One fixed stratified split serves the classifier (its test accuracy) and the diffusion model
(trained on the train split only), so the held-out digits are real images neither model saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_CLASSES = 10
SPLIT_SEED = 0  # fixed: every run, preset and seed uses the same split


@dataclass
class Digits:
    train_images: torch.Tensor  # (N, 1, R, R) float in [-1, 1]
    train_labels: torch.Tensor  # (N,) int64
    test_images: torch.Tensor
    test_labels: torch.Tensor


def load_digits(resolution: int, test_fraction: float = 0.25) -> Digits:
    """The digits upscaled (bilinear) to `resolution` x `resolution`, split train/test."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError('the digits experiment needs scikit-learn: pip install -e ".[experiments]"') from None
    if resolution < 8:
        raise ValueError(f"resolution must be at least the scans' 8 pixels, got {resolution}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    data = sk_load_digits()
    pixels = torch.tensor(data.images, dtype=torch.float32) / 16.0 * 2.0 - 1.0  # scans hold 0..16
    images = F.interpolate(pixels[:, None], size=(resolution, resolution), mode="bilinear", align_corners=False)
    labels = torch.tensor(data.target, dtype=torch.int64)
    train, test = train_test_split(torch.arange(len(labels)).numpy(), test_size=test_fraction,
                                   stratify=labels.numpy(), random_state=SPLIT_SEED)
    train, test = torch.as_tensor(train), torch.as_tensor(test)
    return Digits(images[train], labels[train], images[test], labels[test])


def to_uint8_rgb(images: torch.Tensor) -> torch.Tensor:
    """(N, 1, R, R) in [-1, 1] -> (N, 3, R, R) uint8, the input format of the FID machinery."""
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.expand(-1, 3, -1, -1).contiguous()
