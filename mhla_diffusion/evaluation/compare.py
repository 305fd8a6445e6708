"""`eval compare`: teacher and student on the same seeds and prompts -> PSNR, SSIM, latent MSE.

Latents are captured at the VAE decoder's input, the one place every pipeline passes its
final latents through (DiTPipeline has no output_type="latent").
"""

from __future__ import annotations

import contextlib
import gc
import json
from pathlib import Path

import numpy as np
import torch

from ..persistence import dtype_name
from .figures import labelled_grid
from .sampling import SamplingSettings, generate, load_pipeline


@contextlib.contextmanager
def capture_latents(pipe):
    """Record every tensor passed to `pipe.vae.decode` (float32, CPU)."""
    captured = []
    decode = pipe.vae.decode

    def recording(z, *args, **kwargs):
        captured.append(z.detach().float().cpu())
        return decode(z, *args, **kwargs)

    pipe.vae.decode = recording
    try:
        yield captured
    finally:
        del pipe.vae.decode  # the class method shows through again


def run_pipeline(model, num_samples: int, settings: SamplingSettings, batch_size: int, torch_dtype=None, device="cpu"):
    """(images (n, [F,] H, W, 3) in [0, 1], latents (n, ...)) for samples 0..n-1; the pipeline is freed after."""
    pipe = load_pipeline(model, torch_dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    images = []
    with capture_latents(pipe) as latents:
        for start in range(0, num_samples, batch_size):
            images.append(generate(pipe, range(start, min(num_samples, start + batch_size)), settings))
    del pipe
    gc.collect()
    return np.concatenate(images), torch.cat(latents)


def as_frames(images: np.ndarray) -> torch.Tensor:
    """(n, [F,] H, W, 3) -> (n*F, 3, H, W) float32, videos compared frame by frame."""
    x = torch.from_numpy(images).float()
    return x.reshape(-1, *x.shape[-3:]).permute(0, 3, 1, 2)


def image_metrics(teacher: np.ndarray, student: np.ndarray) -> dict:
    """Per-image PSNR (dB) and SSIM in [0, 1] pixel range, student vs teacher."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    if teacher.shape != student.shape:
        raise ValueError(f"teacher and student samples differ in shape: {teacher.shape} vs {student.shape}")
    t, s = as_frames(teacher), as_frames(student)
    psnr = peak_signal_noise_ratio(s, t, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(s, t, data_range=1.0, reduction="none")
    return {"psnr": psnr.tolist(), "ssim": ssim.tolist()}


def latent_mse(teacher: torch.Tensor, student: torch.Tensor) -> list[float]:
    if teacher.shape != student.shape:
        raise ValueError(f"teacher and student latents differ in shape: {tuple(teacher.shape)} vs {tuple(student.shape)}")
    return (student - teacher).pow(2).flatten(1).mean(1).tolist()


def side_by_side(teacher: np.ndarray, student: np.ndarray, path, per: dict, rows: int = 8) -> None:
    """Labelled PNG, one row per sample (its PSNR and SSIM): teacher | student | |difference| x4
    (first frame of videos)."""
    pick = lambda x: x[:rows, 0] if x.ndim == 5 else x[:rows]  # noqa: E731
    t, s = pick(teacher), pick(student)
    diff = np.clip(np.abs(s - t) * 4.0, 0.0, 1.0)
    labels = [f"sample {i}\nPSNR {per['psnr'][i]:.1f} dB\nSSIM {per['ssim'][i]:.3f}" for i in range(len(t))]
    labelled_grid(path, [list(row) for row in zip(t, s, diff)], labels, ["teacher", "student", "|difference| x 4"],
                  title="teacher vs student, same seeds" + (" (first frame)" if teacher.ndim == 5 else ""))


def run_compare(teacher, student, out, num_samples: int, settings: SamplingSettings, *, batch_size: int = 4,
                torch_dtype=None, device="cpu", grid_rows: int = 8) -> dict:
    """Both models on samples 0..n-1; writes `out`/compare.json and `out`/compare.png."""
    if num_samples < 1:
        raise ValueError(f"compare needs at least one sample, got {num_samples}")
    t_img, t_lat = run_pipeline(teacher, num_samples, settings, batch_size, torch_dtype, device)
    s_img, s_lat = run_pipeline(student, num_samples, settings, batch_size, torch_dtype, device)
    per = {**image_metrics(t_img, s_img), "latent_mse": latent_mse(t_lat, s_lat)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    grid = out / "compare.png"
    side_by_side(t_img, s_img, grid, per, rows=grid_rows)
    report = {
        "teacher": str(teacher),
        "student": str(student),
        "num_samples": num_samples,
        **{f"{k}_mean": float(np.mean(v)) for k, v in per.items()},
        "teacher_latent_mean_square": float(t_lat.pow(2).mean()),
        "per_image": per,
        "settings": {**settings.to_dict(), "batch_size": batch_size, "dtype": dtype_name(torch_dtype)},
        "grid": str(grid),
    }
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    return report
