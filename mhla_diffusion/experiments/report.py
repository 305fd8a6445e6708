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


def save_grid(path: Path, images: torch.Tensor, labels: torch.Tensor, cols: int = 10, cell: int = 48) -> None:
    save_png(grid(images, labels, cols, cell), Path(path))


def smooth(values: list[float], every: int) -> list[float]:
    """Means of consecutive chunks of `every` values (what results.json keeps of a loss curve)."""
    return [statistics.fmean(values[i:i + every]) for i in range(0, len(values), every)]


def moving_average(values, points: int = 40) -> np.ndarray:
    """Running mean over about 1/`points` of the curve: diffusion losses jump with the sampled timesteps."""
    values = np.asarray(values, dtype=np.float64)
    window = max(1, len(values) // points)
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_losses(path: Path, curves: dict, variants: dict, loss_name: str = "epsilon MSE") -> None:
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
    pre.set(title="pre-training (softmax, from scratch)", xlabel="step", ylabel=f"{loss_name} (running mean)", yscale="log")
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
    fine.set(title="fine-tuning after conversion", xlabel="step", ylabel=f"{loss_name} (running mean)", yscale="log")
    if fine.lines:
        fine.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attention(path: Path, attention: dict, variants: dict) -> None:
    """The global-collapse diagnostic: per layer, rank and row entropy of the attention each
    fine-tuned model computes (hybrid: its softmax layers marked with squares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in variants.items():
        rows = attention.get(name)
        if not rows:
            continue
        x = [r["layer"] for r in rows]
        for ax, metric in zip(axes, ("rank", "entropy")):
            line, = ax.plot(x, [r[metric] for r in rows], marker="o", label=label)
            soft = [r for r in rows if r["kind"] == "softmax" and name != "softmax"]
            ax.plot([r["layer"] for r in soft], [r[metric] for r in soft], "s", ms=10, mfc="none", color=line.get_color())
    first = next(iter(attention.values()))
    x = [r["layer"] for r in first]
    axes[0].plot(x, [r["head_dim"] for r in first], "k--", lw=1, label="head dim D (linear's bound)")
    axes[1].plot(x, [r["max_entropy"] for r in first], "k--", lw=1, label="log N (uniform)")
    axes[0].set(xlabel="layer", ylabel="numerical rank (mean over heads)", yscale="log", xticks=x,
                title=f"rank of the N x N attention (N = {first[0]['tokens']})")
    axes[1].set(xlabel="layer", ylabel="row entropy, nats (mean over heads)", xticks=x, title="entropy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Fine-tuned models, first seed: softmax vs linear vs MHLA (squares: a hybrid's softmax layers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sample_sheet(path: Path, panels: list[tuple[Path, str]], cols: int = 5) -> None:
    """Several sample grid PNGs side by side in one PNG at their own pixels, each under its title
    (missing ones are skipped)."""
    from PIL import Image, ImageDraw

    images = []
    for p, title in panels:
        if Path(p).is_file():
            with Image.open(p) as img:
                images.append((np.asarray(img.convert("RGB")), title))
    if not images:
        return
    h, w = max(a.shape[0] for a, _ in images), max(a.shape[1] for a, _ in images)
    title_h, gap = 16, 12
    rows = math.ceil(len(images) / cols)
    canvas = Image.new("RGB", (cols * (w + gap) - gap, rows * (h + title_h + gap) - gap), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (a, title) in enumerate(images):
        x, y = (i % cols) * (w + gap), (i // cols) * (h + title_h + gap)
        draw.text((x + 2, y + 2), title, fill="black")
        canvas.paste(Image.fromarray(a), (x, y + title_h))
    save_png(np.asarray(canvas), Path(path))


def sampler_text(s: dict) -> str:
    """How the settings `s` train and sample: the objective and its sampler."""
    if s.get("objective", "ddpm") == "flow":
        return f"rectified flow (velocity target), Euler {s['sampling_steps']} steps (sigma 1 to 1/1000, then 0)"
    return f"DDPM (epsilon target), DDIM {s['sampling_steps']} steps"


def run_lines(results: dict) -> list[str]:
    """The card's lines about the run itself: date, card, command, time (phases of seeds run in
    parallel processes added in)."""
    timings = dict(results.get("timings_s", {}))
    jobs = results.get("jobs", {})
    for job in jobs.values():
        for k, v in job["timings_s"].items():
            timings[k] = timings.get(k, 0.0) + v
    parallel = f", seeds in {len(jobs)} parallel processes" if jobs else ""
    cuda = results["device"].startswith("cuda")
    bf16 = cuda and results["settings"].get("precision", "fp32") == "bf16"
    return [
        f"- date (UTC): {results['date']}",
        f"- card: {results['card']} (torch {results['torch']}, fp32 weights{', TF32 matmuls' if cuda else ''}"
        f"{', forward passes under bf16 autocast' if bf16 else ''})",
        f"- command: `{results['command']}`",
        f"- time (all sessions of a resumed run): {sum(timings.values()):.0f} s in the phases ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
        + f"{parallel})" + (f"; the last session took {results['wall_s']:.0f} s" if "wall_s" in results else ""),
    ]


def curve_markdown(results: dict, curves: list[tuple[str, list[tuple[int, str]]]]) -> str:
    """Quality along fine-tuning: FID (mean ± std over seeds) at each scored step, per curve."""
    if not curves or len(curves[0][1]) <= 2:
        return ""
    steps = [n for n, _ in curves[0][1]]
    lines = ["", "## Quality along fine-tuning", "", "FID (mean ± std over seeds) after N fine-tuning steps:", "",
             "| run | " + " | ".join(f"N = {n}" for n in steps) + " |", "|---|" + "---|" * len(steps)]
    for label, points in curves:
        lines.append(f"| {label} | " + " | ".join(mean_std([r["fid"] for r in results["runs"].get(key, {}).values()])
                                                  for _, key in points) + " |")
    return "\n".join(lines + ["", ""])


def plot_quality(path: Path, runs: dict, curves: list[tuple[str, list[tuple[int, str]]]]) -> None:
    """FID against fine-tuning steps, one line per curve (mean over seeds, band = min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves:
        have = [(n, [r["fid"] for r in runs.get(key, {}).values()]) for n, key in points]
        have = [(n, v) for n, v in have if v]
        if not have:
            continue
        x = [n for n, _ in have]
        line, = ax.plot(x, [statistics.fmean(v) for _, v in have], marker="o", label=label)
        ax.fill_between(x, [min(v) for _, v in have], [max(v) for _, v in have], color=line.get_color(), alpha=0.2)
    ax.set(xlabel="fine-tuning steps", ylabel="FID (classifier features)", yscale="log",
           title="quality after conversion, along fine-tuning")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_markdown(results: dict, rows: list[tuple[str, str, int, str]]) -> str:
    """The results table; `rows` = (label, M, fine-tune steps, key into results['runs'])."""
    s = results["settings"]
    mosaic = s.get("mosaic", 1)
    if mosaic > 1:
        return mosaic_markdown(results, rows)
    real = results.get("real_heldout")
    clf = results.get("classifier", {})
    seeds = sorted({seed for runs in results["runs"].values() for seed in runs}, key=int)
    lines = [
        "# Digits experiment: does conversion keep quality?",
        "",
        *run_lines(results),
        f"- data: scikit-learn digits upscaled to {s['resolution']}x{s['resolution']}: {clf.get('train_n')} train / {clf.get('test_n')} held-out test scans",
        f"- model: DiT, {s['layers']} layers, {s['heads']} heads x {s['head_dim']}, patch {s['patch_size']} "
        f"({(s['resolution'] // s['patch_size']) ** 2} tokens), pre-trained once ({s['pretrain_steps']} steps, seed 0), "
        f"fine-tuned {s['finetune_steps']} steps per variant and seed (seeds {', '.join(seeds)})",
        f"- samples: {s['samples']} per evaluation (balanced classes), {sampler_text(s)}, guidance {s['guidance']}",
        f"- digit classifier: test accuracy {clf.get('test_accuracy', math.nan):.4f} on the held-out scans; "
        f"FID on its {clf.get('features')}-d penultimate features against the {clf.get('train_n')} train scans",
        "",
        "| attention | blocks M | fine-tune steps | seeds | FID (mean ± std) | classifier accuracy (mean ± std) |",
        "|---|---|---|---|---|---|",
    ]
    if real:
        lines.append(f"| real held-out scans (n = {real['n']}) | — | — | — | {real['fid']:.3f} | {real['accuracy']:.3f} |")
    for label, m, steps, key in rows:
        runs = results["runs"].get(key, {})
        fids = [r["fid"] for r in runs.values()]
        accs = [r["accuracy"] for r in runs.values()]
        lines.append(f"| {label} | {m} | {steps} | {len(fids)} | {mean_std(fids)} | {mean_std(accs)} |")
    lines += ["", "FID is biased upward at small n: the real row uses the held-out scans' n, the models "
              f"{s['samples']} samples, so compare the models with each other and the real row as a floor only.", ""]
    return "\n".join(lines)


def mosaic_markdown(results: dict, rows: list[tuple[str, str, int, str]]) -> str:
    """The mosaic results table: per-cell FID and accuracy, whole-image FID, mixing change."""
    s = results["settings"]
    m, cell = s["mosaic"], s["resolution"] // s["mosaic"]
    conditional = s.get("layout", "fixed") == "fixed"
    legibility = "accuracy" if conditional else "confidence"
    real, clf, mos = results.get("real_heldout"), results.get("classifier", {}), results.get("mosaics", {})
    seeds = sorted({seed for runs in results["runs"].values() for seed in runs}, key=int)
    tokens = (s["resolution"] // s["patch_size"]) ** 2
    lines = [
        f"# Mosaic experiment ({tokens:,} tokens): does conversion keep quality where local structure matters?",
        "",
        *run_lines(results),
        f"- data: {m}x{m} mosaics of scikit-learn's real {cell}x{cell} digit scans on a {s['resolution']}x{s['resolution']} canvas; "
        + ("the class label picks one of 10 fixed layouts (which digit in which cell, drawn at random once), each cell a scan "
           "of that digit drawn at random" if conditional else
           "unconditional: every cell of every mosaic a scan drawn at random, so position decides nothing about content")
        + f"; {mos.get('train_n')} train mosaics from the {clf.get('train_n')} train scans, "
        f"held-out mosaics from the {clf.get('test_n')} held-out scans",
        f"- model: DiT, {s['layers']} layers, {s['heads']} heads x {s['head_dim']}, patch {s['patch_size']} ({tokens} tokens), "
        f"pre-trained once ({s['pretrain_steps']} steps, lr {s['pretrain_lr']}, seed 0), fine-tuned {s['finetune_steps']} steps "
        f"per variant and seed (lr {s['finetune_lr']}, MHLA parameters {s.get('mhla_lr') or s['finetune_lr']}; seeds {', '.join(seeds)}), "
        f"batch {s['batch_size']}; MHLA blocks {tuple(s['mhla_blocks'])}",
        f"- samples: {s['samples']} mosaics per evaluation ({s['samples'] * m * m} cells{'; layouts balanced' if conditional else ''}), "
        f"{sampler_text(s)}, guidance {s['guidance']}",
        f"- digit classifier: test accuracy {clf.get('test_accuracy', math.nan):.4f} on the held-out scans. Cell FID: its "
        f"{clf.get('features')}-d penultimate features of every cell against the train scans. Image FID: the "
        f"{m * m} cells' classifier logits concatenated ({m * m * 10}-d) against {mos.get('reference_n')} train mosaics"
        + ("" if conditional else ". Cell confidence: the classifier's mean top-class probability per cell (is it legibly one digit)"),
        "",
        f"| attention | blocks M | fine-tune steps | seeds | cell FID (mean ± std) | cell {legibility} (mean ± std) | image FID (mean ± std) | mixing change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if real:
        lines.append(f"| real held-out mosaics (n = {real['n']}) | — | — | — | {real['fid']:.3f} | {real[legibility]:.3f} | "
                     f"{real['image_fid']:.3f} | — |")
    for label, mm, steps, key in rows:
        runs = list(results["runs"].get(key, {}).values())
        drift = [r["mhla/mixing_change"] for r in runs if "mhla/mixing_change" in r]
        lines.append(f"| {label} | {mm} | {steps} | {len(runs)} | {mean_std([r['fid'] for r in runs])} | {mean_std([r[legibility] for r in runs])} | "
                     f"{mean_std([r['image_fid'] for r in runs])} | {mean_std(drift) if drift else '—'} |")
    lines += ["", "Spread is the sample standard deviation over seeds (the softmax pre-trained row: one model, sampled with "
              "each seed's noise). Mixing change: mean |Mc - Mc0| / mean Mc0 over converted layers after fine-tuning "
              "(the linear variant's single 1 x 1 matrix cannot move). The real row uses as many mosaics as an evaluation, so "
              "its FIDs are the floor at that n.", ""]
    attention = results.get("attention")
    if attention:
        lines += ["Attention diagnostic (fine-tuned models, first seed; rank of the N x N attention, numerical, rtol 1e-6; "
                  "row entropy in nats, log N = "
                  f"{math.log(tokens):.2f}), per layer:", "",
                  "| model | " + " | ".join(f"layer {r['layer']}" for r in next(iter(attention.values()))) + " |",
                  "|---|" + "---|" * len(next(iter(attention.values())))]
        for name, rs in attention.items():
            lines.append(f"| {name} | " + " | ".join(f"{r['kind']}: rank {r['rank']:.0f}, H {r['entropy']:.2f}" for r in rs) + " |")
        lines.append("")
    return "\n".join(lines)
