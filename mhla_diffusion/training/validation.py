"""Periodic validation samples, written as PNG images or MP4 videos under output_dir/samples/.

Sampling goes through the family's own diffusers pipeline (as users will run the model),
with the EMA weights when EMA is on, from a fixed generator so steps are comparable.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image



def check_validation(config, family) -> None:
    """Fail before training if periodic sampling is asked for without anything to sample."""
    if config.validation_steps <= 0:
        return
    what = "validation_prompts" if family.text else "validation_classes"
    if not getattr(config, what):
        raise ValueError(f"validation_steps is {config.validation_steps} but {what} is empty")


@contextlib.contextmanager
def ema_weights(ema, params):
    """Temporarily swap the EMA weights into `params` (no-op without EMA)."""
    if ema is None:
        yield
        return
    ema.store(params)
    ema.copy_to(params)
    try:
        yield
    finally:
        ema.restore(params)


def write_video(path: Path, frames: np.ndarray, fps: int = 16) -> None:
    """(F, H, W, 3) floats in [0, 1] -> H.264 mp4 (PyAV; sizes rounded up to even as H.264 needs)."""
    import imageio.v3 as iio

    frames = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    pad = [(0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0)]
    iio.imwrite(path, np.pad(frames, pad, mode="edge"), plugin="pyav", codec="libx264", fps=fps)


@torch.no_grad()
def sample(pipe, transformer, family, config, step: int) -> list[Path]:
    """Generate the validation set with `transformer` (of `family`) and write it to disk; returns the files."""
    setattr(pipe, config.component, transformer)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(config.seed)
    common = {"num_inference_steps": config.validation_inference_steps, "guidance_scale": config.validation_guidance_scale,
              "generator": generator, "output_type": "np"}
    if family.text:
        h, w = config.resolution
        kwargs = {"prompt": list(config.validation_prompts), **family.size_kwargs(h, w, config.num_frames),
                  **family.any_size, **family.validation_kwargs}
    else:
        kwargs = {"class_labels": [int(c) for c in config.validation_classes]}
    was_training = transformer.training
    transformer.eval()
    try:
        out = pipe(**kwargs, **common)
    finally:
        transformer.train(was_training)
    folder = Path(config.output_dir) / "samples" / f"step-{step:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i, arr in enumerate(out.frames if family.video else out.images):
        path = folder / f"{i:02d}.{'mp4' if family.video else 'png'}"
        if family.video:
            write_video(path, np.asarray(arr))
        else:
            Image.fromarray((np.clip(arr, 0, 1) * 255).round().astype(np.uint8)).save(path)
        files.append(path)
    return files
