"""Image files in and out: folders of real images, generated samples written atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def list_images(folder) -> list[Path]:
    """Image files under `folder` (recursive, sorted) so a reference set is read in a fixed order."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder of images")
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def load_uint8(path) -> torch.Tensor:
    """(3, H, W) uint8 RGB, the input format of the FID feature network."""
    with Image.open(path) as img:
        array = np.asarray(img.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def batches(paths, batch_size: int) -> Iterator[torch.Tensor]:
    """(B, 3, H, W) uint8 batches; a new batch starts where the image size changes."""
    batch = []
    for path in paths:
        img = load_uint8(path)
        if batch and (len(batch) == batch_size or img.shape != batch[0].shape):
            yield torch.stack(batch)
            batch = []
        batch.append(img)
    if batch:
        yield torch.stack(batch)


def to_uint8(array) -> np.ndarray:
    """Pipeline output in [0, 1] (float) -> uint8, rounding as PIL export does."""
    return (np.clip(np.asarray(array, dtype=np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)


def save_png(array: np.ndarray, path: Path) -> None:
    """Write a (H, W, 3) uint8 PNG through a temporary name, so a killed run leaves no partial file."""
    tmp = path.with_name(path.name + ".tmp")
    Image.fromarray(array).save(tmp, format="PNG")
    os.replace(tmp, path)
