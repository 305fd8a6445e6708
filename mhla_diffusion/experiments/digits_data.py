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


LAYOUT_SEED = 0  # fixed: the mosaic layouts are the same in every run


def layouts(cells_per_side: int) -> torch.Tensor:
    """(NUM_CLASSES, m * m) digit of each cell (row-major) of each mosaic layout; a layout is what
    the model's class label selects. Drawn once at random, each layout from shuffled runs of the
    ten digits, so neighbouring cells mostly differ and no digit appears more than ceil(m^2 / 10)
    times. m = 1 is plain digits: layout c is digit c."""
    m2 = cells_per_side * cells_per_side
    if m2 == 1:
        return torch.arange(NUM_CLASSES)[:, None]
    generator = torch.Generator().manual_seed(LAYOUT_SEED)
    runs = -(-m2 // NUM_CLASSES)
    return torch.stack([torch.cat([torch.randperm(NUM_CLASSES, generator=generator) for _ in range(runs)])[:m2]
                        for _ in range(NUM_CLASSES)])


def split_cells(images: torch.Tensor, cells_per_side: int) -> torch.Tensor:
    """(N, 1, m c, m c) -> (N m^2, 1, c, c), cells in row-major order per image."""
    n, ch, side, _ = images.shape
    m, c = cells_per_side, side // cells_per_side
    return images.reshape(n, ch, m, c, m, c).permute(0, 2, 4, 1, 3, 5).reshape(n * m * m, ch, c, c)


def join_cells(cells: torch.Tensor, cells_per_side: int) -> torch.Tensor:
    """The inverse of `split_cells`."""
    m = cells_per_side
    nm2, ch, c, _ = cells.shape
    return cells.reshape(nm2 // (m * m), m, m, ch, c, c).permute(0, 3, 1, 4, 2, 5).reshape(nm2 // (m * m), ch, m * c, m * c)


def compose_mosaics(scans: torch.Tensor, scan_labels: torch.Tensor, layout_ids: torch.Tensor, cells_per_side: int,
                    seed: int) -> torch.Tensor:
    """Mosaics of layouts `layout_ids`: each cell a scan of its layout's digit drawn at random (with
    replacement) from `scans`, independently per cell and mosaic."""
    want = layouts(cells_per_side)[layout_ids].flatten()
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.empty_like(want)
    for digit in range(NUM_CLASSES):
        pool = torch.nonzero(scan_labels == digit).flatten()
        where = torch.nonzero(want == digit).flatten()
        chosen[where] = pool[torch.randint(len(pool), (len(where),), generator=generator)]
    return join_cells(scans[chosen], cells_per_side)


def random_mosaics(scans: torch.Tensor, count: int, cells_per_side: int, seed: int) -> torch.Tensor:
    """`count` mosaics whose every cell is a scan drawn at random (with replacement) from `scans`: no
    layout, the digits of the cells independent of each other and of their position."""
    generator = torch.Generator().manual_seed(seed)
    return join_cells(scans[torch.randint(len(scans), (count * cells_per_side ** 2,), generator=generator)], cells_per_side)
