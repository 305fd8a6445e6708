"""Generated samples on disk, one PNG per image (a folder of frames per video).

A sample exists once its final name exists (files and frame folders are renamed into place),
so an interrupted run resumes with the missing indices. `settings.json` pins what made the
samples; resuming with other settings is refused instead of mixing two sets.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .images import IMAGE_SUFFIXES, save_png, to_uint8


class SampleStore:
    def __init__(self, root):
        self.root = Path(root)

    def _path(self, i: int) -> Path:
        return self.root / f"{i:06d}"

    def exists(self, i: int) -> bool:
        p = self._path(i)
        return p.with_suffix(".png").is_file() or p.is_dir()

    def missing(self, n: int) -> list[int]:
        return [i for i in range(n) if not self.exists(i)]

    def pin_settings(self, settings: dict) -> None:
        """Record `settings`, or check they equal the recorded ones."""
        pin_settings(self.root, settings, "samples")

    def save(self, i: int, sample: np.ndarray) -> None:
        """One sample in [0, 1]: (H, W, 3) image, or (F, H, W, 3) video."""
        pixels = to_uint8(sample)
        path = self._path(i)
        if pixels.ndim == 3:
            save_png(pixels, path.with_suffix(".png"))
            return
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
        tmp.mkdir()
        for f, frame in enumerate(pixels):
            save_png(frame, tmp / f"{f:04d}.png")
        os.rename(tmp, path)

    def image_paths(self, n: int) -> list[Path]:
        """Images of samples 0..n-1 (every frame of a video), in order."""
        paths = []
        for i in range(n):
            p = self._path(i)
            if p.is_dir():
                paths += sorted(f for f in p.iterdir() if f.suffix in IMAGE_SUFFIXES)
            else:
                paths.append(p.with_suffix(".png"))
        return paths


def pin_settings(root, settings: dict, what: str) -> None:
    """Record `settings` in `root`/settings.json, or check they equal the recorded ones, so a
    resumed run never mixes results made with other settings."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    file = root / "settings.json"
    if file.is_file():
        old = json.loads(file.read_text())
        if old != settings:
            diff = sorted(k for k in old.keys() | settings.keys() if old.get(k) != settings.get(k))
            raise ValueError(f"{root} holds {what} made with other settings ({', '.join(diff)} differ); use another output dir")
    else:
        file.write_text(json.dumps(settings, indent=2, sort_keys=True))
