"""What the digits experiment writes for people: results.md, loss_curves.png, sample grids."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import torch

from ..evaluation.images import save_png
from .digits_data import NUM_CLASSES, to_uint8_rgb


def mean_std(values: list[float]) -> str:
    """'m ± s' over seeds (sample std); one seed has no spread."""
    if not values:
        return "—"
    spread = f"{statistics.stdev(values):.3f}" if len(values) > 1 else "n/a"
    return f"{statistics.fmean(values):.3f} ± {spread}"


def grid(images: torch.Tensor, labels: torch.Tensor, cols: int, cell: int = 48) -> np.ndarray:
    """(H, W, 3) uint8: row c holds the first `cols` images of class c, each scaled to `cell` pixels."""
    scale = max(1, cell // images.shape[-1])
    pixels = to_uint8_rgb(images).repeat_interleave(scale, -1).repeat_interleave(scale, -2)
    size, gap = pixels.shape[-1], 2
    canvas = np.full((NUM_CLASSES * (size + gap) - gap, cols * (size + gap) - gap, 3), 255, np.uint8)
    for c in range(NUM_CLASSES):
        for j, i in enumerate(torch.nonzero(labels == c).flatten()[:cols].tolist()):
            y, x = c * (size + gap), j * (size + gap)
            canvas[y:y + size, x:x + size] = pixels[i].permute(1, 2, 0).numpy()
    return canvas


def save_grid(path: Path, images: torch.Tensor, labels: torch.Tensor, cols: int = 10) -> None:
    save_png(grid(images, labels, cols), Path(path))


def smooth(values: list[float], every: int) -> list[float]:
    """Means of consecutive chunks of `every` values (what results.json keeps of a loss curve)."""
    return [statistics.fmean(values[i:i + every]) for i in range(0, len(values), every)]


def moving_average(values, points: int = 40) -> np.ndarray:
    """Running mean over about 1/`points` of the curve: diffusion losses jump with the sampled timesteps."""
    values = np.asarray(values, dtype=np.float64)
    window = max(1, len(values) // points)
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_losses(path: Path, curves: dict, variants: dict) -> None:
    """Pre-training loss, and each variant's fine-tuning loss (mean over seeds, band = min..max),
    both as running means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (pre, fine) = plt.subplots(1, 2, figsize=(11, 4))
    if "pretrain" in curves:
        c = curves["pretrain"]
        loss = moving_average(c["loss"])
        pre.plot(np.arange(len(loss)) * c["every"], loss, color="black")
    pre.set(title="pre-training (softmax, from scratch)", xlabel="step", ylabel="epsilon MSE (running mean)", yscale="log")
    for name, label in variants.items():
        runs = [c for key, c in curves.items() if key.startswith(f"{name}/seed")]
        if not runs:
            continue
        length = min(len(c["loss"]) for c in runs)
        if length == 0:
            continue
        loss = np.array([moving_average(c["loss"][:length]) for c in runs])
        steps = np.arange(loss.shape[1]) * runs[0]["every"]
        line, = fine.plot(steps, loss.mean(0), label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        fine.fill_between(steps, loss.min(0), loss.max(0), color=line.get_color(), alpha=0.2)
    fine.set(title="fine-tuning after conversion", xlabel="step", ylabel="epsilon MSE (running mean)", yscale="log")
    if fine.lines:
        fine.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_markdown(results: dict, rows: list[tuple[str, str, int, str]]) -> str:
    """The results table; `rows` = (label, M, fine-tune steps, key into results['runs'])."""
    s = results["settings"]
    real = results.get("real_heldout")
    clf = results.get("classifier", {})
    seeds = sorted({seed for runs in results["runs"].values() for seed in runs}, key=int)
    lines = [
        "# Digits experiment: does conversion keep quality?",
        "",
        f"- date (UTC): {results['date']}",
        f"- card: {results['card']} (torch {results['torch']}, fp32 weights{', TF32 matmuls' if results['device'].startswith('cuda') else ''})",
        f"- command: `{results['command']}`",
        f"- time (all sessions of a resumed run): {sum(results.get('timings_s', {}).values()):.0f} s in the phases ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("timings_s", {}).items())
        + f"); the last session took {results['wall_s']:.0f} s",
        f"- data: scikit-learn digits upscaled to {s['resolution']}x{s['resolution']}: {clf.get('train_n')} train / {clf.get('test_n')} held-out test scans",
        f"- model: DiT, {s['layers']} layers, {s['heads']} heads x {s['head_dim']}, patch {s['patch_size']} "
        f"({(s['resolution'] // s['patch_size']) ** 2} tokens), pre-trained once ({s['pretrain_steps']} steps, seed 0), "
        f"fine-tuned {s['finetune_steps']} steps per variant and seed (seeds {', '.join(seeds)})",
        f"- samples: {s['samples']} per evaluation (balanced classes), DDIM {s['sampling_steps']} steps, guidance {s['guidance']}",
        f"- digit classifier: test accuracy {clf.get('test_accuracy', math.nan):.4f} on the held-out scans; "
        f"FID on its {clf.get('features')}-d penultimate features against the {clf.get('train_n')} train scans",
        "",
        f"| attention | blocks M | fine-tune steps | FID (mean ± std) | classifier accuracy (mean ± std) |",
        "|---|---|---|---|---|",
    ]
    if real:
        lines.append(f"| real held-out scans (n = {real['n']}) | — | — | {real['fid']:.3f} | {real['accuracy']:.3f} |")
    for label, m, steps, key in rows:
        runs = results["runs"].get(key, {})
        fids = [r["fid"] for r in runs.values()]
        accs = [r["accuracy"] for r in runs.values()]
        lines.append(f"| {label} | {m} | {steps} | {mean_std(fids)} | {mean_std(accs)} |")
    lines += ["", "FID is biased upward at small n: the real row uses the held-out scans' n, the models "
              f"{s['samples']} samples, so compare the models with each other and the real row as a floor only.", ""]
    return "\n".join(lines)
