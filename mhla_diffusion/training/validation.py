"""Periodic validation samples, written as PNG images or MP4 videos under output_dir/samples/, plus
one labelled grid per step (grid.png, also logged to tensorboard as "validation").

Sampling goes through the family's own diffusers pipeline (as users will run the model),
with the EMA weights when EMA is on, from a fixed generator so steps are comparable.
"""

from __future__ import annotations

import contextlib
import textwrap
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
    samples = [np.asarray(arr) for arr in (out.frames if family.video else out.images)]
    files = []
    for i, arr in enumerate(samples):
        path = folder / f"{i:02d}.{'mp4' if family.video else 'png'}"
        if family.video:
            write_video(path, arr)
        else:
            Image.fromarray((np.clip(arr, 0, 1) * 255).round().astype(np.uint8)).save(path)
        files.append(path)
    names = list(config.validation_prompts) if family.text else [f"class {c}" for c in config.validation_classes]
    return files + [_grid(folder / "grid.png", samples, names, family.video, step, config)]


def _grid(path: Path, samples: list, names: list[str], video: bool, step: int, config) -> Path:
    """One row per validation sample, labelled with its prompt or class; videos show 4 frames spread over the clip."""
    from ..evaluation.figures import labelled_grid

    if video:
        picks = np.linspace(0, len(samples[0]) - 1, min(4, len(samples[0]))).round().astype(int)
        cells, columns = [[s[i] for i in picks] for s in samples], [f"frame {i}" for i in picks]
    else:
        cells, columns = [[s] for s in samples], None
    wrap = lambda name: "\n".join(textwrap.wrap(name, 28)[:3])  # noqa: E731
    return labelled_grid(path, cells, [wrap(n) for n in names], columns,
                         title=f"step {step}: {config.validation_inference_steps} steps, guidance "
                               f"{config.validation_guidance_scale}")


def log_grid(accelerator, path: Path, step: int) -> None:
    """The step's grid as a tensorboard image (when tensorboard is the tracker)."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image("validation", np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")
