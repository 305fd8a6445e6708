"""Image files in and out: folders of real images, generated samples written atomically, and
the one rule for unreadable input files (here and in training data)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
MAX_UNREADABLE = 0.1  # default: the fraction of a set's files that may be unreadable
NAMED = 3  # unreadable paths named in warnings and messages


class UnreadableFiles:
    """Unreadable inputs: skip each, count it once however often it is met, and give up once more
    than `limit` (a fraction) of the `total` files are unreadable. One bad file among thousands
    must not stop hours of work; a folder of mostly broken files must not pass quietly."""

    def __init__(self, limit: float = MAX_UNREADABLE, option: str = "--max-unreadable"):
        if not 0 <= limit <= 1:
            raise ValueError(f"{option} is a fraction of the files, from 0 to 1; got {limit}")
        self.limit, self.option, self.paths = limit, option, {}  # a dict: ordered, and a quick membership test

    def add(self, path, err, total: int) -> None:
        if path in self.paths:
            return
        self.paths[path] = None
        if len(self.paths) <= NAMED:
            log.info("skipping unreadable %s: %s", path, err)  # the caller reports the count
        if len(self.paths) > self.limit * total:
            raise ValueError(f"unreadable files past the limit of {self.limit * 100:g}%: {len(self.paths)} of {total} so far "
                             f"({self.named()}); fix or remove them, or raise {self.option}")

    def named(self) -> str:
        more = len(self.paths) - NAMED
        return ", ".join(map(str, list(self.paths)[:NAMED])) + (f" and {more} more" if more > 0 else "")

    def summary(self) -> str:
        return f"skipped {len(self.paths)} unreadable file(s): {self.named()}"


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


def batches(paths, batch_size: int, unreadable: UnreadableFiles | None = None) -> Iterator[torch.Tensor]:
    """(B, 3, H, W) uint8 batches; a new batch starts where the image size changes. Unreadable
    files go to `unreadable` (None: they are errors, as in generated samples)."""
    paths = list(paths)
    batch = []
    for path in paths:
        try:
            img = load_uint8(path)
        except Exception as err:  # noqa: BLE001 - whatever the decoder raises, the file is unreadable
            if unreadable is None:
                raise
            unreadable.add(path, err, len(paths))
            continue
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
