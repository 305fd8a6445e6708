"""Does conversion keep quality? Softmax vs plain linear attention (M = 1) vs MHLA on real digits.

With `mosaic` m > 1 every image is an m x m mosaic of real scans, so each region of the canvas
must attend to its own content, and samples are scored per cell. Layout "fixed": the class label
picks one of ten fixed layouts of digits, each cell a scan of its digit drawn at random; "random":
every cell of every mosaic is a scan drawn at random, unconditional, so position does not decide
content and a cell can only be one digit by attending to itself.

1. a digit classifier on the real train scans (FID features, sample accuracy);
2. a class-conditional softmax DiT pre-trained from scratch once (seed 0), reused by every seed;
3. per seed: copies converted to linear attention and to MHLA, each scored right after
   conversion, then the three variants (softmax control included) fine-tuned with the same
   recipe and budget and scored again.

Each phase's result lands in OUT/results.json as it finishes and a rerun with the same OUT
skips what is there, so an interrupted run loses at most the phase in progress.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from ..config import parse_blocks
from ..evaluation import fid as fidlib
from ..evaluation.store import pin_settings
from ..training.model import mixing_drift
from . import classifier as clf
from . import pixel_dit, report
from .digits_data import NUM_CLASSES, Digits, compose_mosaics, layouts, load_digits, random_mosaics, split_cells, to_uint8_rgb

PRETRAIN_SEED = 0


@dataclass(frozen=True)
class Settings:
    resolution: int
    patch_size: int
    layers: int
    heads: int
    head_dim: int
    mhla_blocks: tuple  # (bt, bh, bw) block grid of the MHLA variant; the linear variant has one block
    pretrain_steps: int
    finetune_steps: int
    batch_size: int
    pretrain_lr: float
    finetune_lr: float
    warmup: int
    ema_decay: float
    classifier_steps: int
    samples: int  # per evaluation, balanced over the classes
    sampling_steps: int
    guidance: float
    seeds: tuple
    mhla_lr: float = 0.0  # fine-tuning rate of the MHLA parameters (0: finetune_lr)
    data_free: bool = False  # also per seed: attention transfer and teacher-only fine-tuning, no scans (linear, MHLA)
    transfer_steps: int = 300  # attention transfer: optimizer steps per layer
    teacher_samples: int = 1000  # teacher-only fine-tuning: the teacher's own samples it trains on
    mosaic: int = 1  # cells per side: images are m x m mosaics of (resolution / m)-pixel scans, scored per cell
    hybrid: int = 0  # K >= 2: also the MHLA hybrid (every K-th layer keeps softmax); 0: no hybrid variant
    diagnostic: bool = False  # attention rank and entropy per layer of the first seed's fine-tuned models
    layout: str = "fixed"  # mosaics: "fixed" (the label picks one of ten layouts) or "random" (unconditional)
    curve_steps: tuple = ()  # also score linear and MHLA at these fine-tuning steps (data and teacher-only)
    guided_target: bool = False  # data-free: also MHLA taught the teacher's guided prediction, sampled at guidance 1
    mhla_lr_ablation: bool = False  # also MHLA with its parameters at the fine-tune rate (the mhla_lr ablation)
    # also MHLA on each of these block grids, a row each. Its runs are keyed by the grid, so grids may be added
    # to a finished run (left out of the pinned settings, like seeds), and a grid once run stays a row of it.
    other_grids: tuple = ()
    objective: str = "ddpm"  # how every model is trained and sampled: "ddpm" (epsilon, DDIM) or "flow" (velocity, Euler)
    precision: str = "fp32"  # "bf16": forward passes under bf16 autocast on CUDA

    @property
    def cell_resolution(self) -> int:
        return self.resolution // self.mosaic

    @property
    def conditional(self) -> bool:
        return self.layout == "fixed"

    def class_labels(self, n: int) -> torch.Tensor:
        """Labels of `n` samples: classes (layouts) balanced, or all 0 for unconditional mosaics."""
        return torch.arange(n) % NUM_CLASSES if self.conditional else torch.zeros(n, dtype=torch.long)

    @property
    def process(self) -> pixel_dit.Process:
        return pixel_dit.Process(self.objective, self.precision)

    def model_size(self) -> pixel_dit.ModelSize:
        return pixel_dit.ModelSize(self.layers, self.heads, self.head_dim, self.patch_size)

    def train_settings(self, phase: str, variant: str = "") -> pixel_dit.TrainSettings:
        steps, lr = (self.pretrain_steps, self.pretrain_lr) if phase == "pretrain" else (self.finetune_steps, self.finetune_lr)
        mhla_lr = self.mhla_lr if phase == "finetune" and variant != "mhla_base_lr" else 0.0
        return pixel_dit.TrainSettings(steps, self.batch_size, lr, min(self.warmup, steps), self.ema_decay, mhla_lr=mhla_lr,
                                       process=self.process)


# Settings added after runs were made: left out of a run's pinned settings while at these defaults,
# so such a run (which used them implicitly) can still be resumed.
LATER_DEFAULTS = {"mhla_lr": 0.0, "data_free": False, "transfer_steps": 300, "teacher_samples": 1000,
                  "mosaic": 1, "hybrid": 0, "diagnostic": False, "layout": "fixed", "curve_steps": [],
                  "guided_target": False, "mhla_lr_ablation": False, "objective": "ddpm", "precision": "fp32"}

MOSAIC_TRAIN = 20_000  # mosaics composed once from the train scans (the diffusion model's training set)
MOSAIC_REFERENCE = 5_000  # of them, the reference of the whole-image FID


PRESETS = {
    # Sized for one GPU in minutes (about 21k launch-bound steps); 256 tokens, MHLA on 4x4 = 16 blocks (M^2 = N).
    "full": Settings(resolution=16, patch_size=1, layers=4, heads=4, head_dim=32, mhla_blocks=(1, 4, 4),
                     pretrain_steps=6000, finetune_steps=1500, batch_size=128, pretrain_lr=3e-4, finetune_lr=1e-4,
                     warmup=200, ema_decay=0.999, classifier_steps=2000, samples=1000, sampling_steps=50,
                     guidance=1.5, seeds=(0, 1, 2)),
    # CI on a CPU in well under a minute: the whole pipeline, nothing meaningful learned.
    "toy": Settings(resolution=8, patch_size=1, layers=2, heads=2, head_dim=8, mhla_blocks=(1, 2, 2),
                    pretrain_steps=12, finetune_steps=6, batch_size=16, pretrain_lr=1e-3, finetune_lr=1e-3,
                    warmup=4, ema_decay=0.9, classifier_steps=30, samples=20, sampling_steps=3,
                    guidance=1.5, seeds=(0, 1)),
    # 1,024 tokens: 4 x 4 mosaics of the native 8x8 scans on a 32x32 canvas, patch 1; sized for one H200
    # in about 10 minutes from steps timed there on 2026-12-01 (batch 256: softmax 129 ms, linear 49,
    # MHLA 47, hybrid 67; 500 samples x 50 DDIM steps: softmax 7.4 s, MHLA 2.5 s). 4,096 tokens does
    # not fit: a softmax step at 64x64 took 0.8 s at batch 128.
    # MHLA on 4 x 4 = 16 blocks (M^2 = 256 <= N = 1,024, the digits preset's grid, which here also
    # coincides with the 4 x 4 cells); MHLA parameters at 16x the rate (logits of a row-softmax over
    # M = 16 entries: the paper's step on Mc ~ 1/M is a relative change of about M x lr).
    "mosaic-full": Settings(resolution=32, patch_size=1, layers=4, heads=4, head_dim=32, mhla_blocks=(1, 4, 4),
                            pretrain_steps=2000, finetune_steps=600, batch_size=128, pretrain_lr=3e-4, finetune_lr=3e-4,
                            warmup=200, ema_decay=0.999, classifier_steps=2000, samples=500, sampling_steps=25,
                            guidance=1.5, seeds=(0, 1, 2), mhla_lr=5e-3, mosaic=4, hybrid=3, diagnostic=True),
    # 1,024 tokens where position does not decide content: every cell a random scan, unconditional
    # (guidance 1). Fixed before its run: mosaic-full's settings but the layouts, plus the mhla_lr
    # ablation row (MHLA parameters at the fine-tune rate).
    "mosaic-random": Settings(resolution=32, patch_size=1, layers=4, heads=4, head_dim=32, mhla_blocks=(1, 4, 4),
                              pretrain_steps=2000, finetune_steps=600, batch_size=128, pretrain_lr=3e-4, finetune_lr=3e-4,
                              warmup=200, ema_decay=0.999, classifier_steps=2000, samples=500, sampling_steps=25,
                              guidance=1.0, seeds=(0, 1, 2), mhla_lr=5e-3, mosaic=4, hybrid=3, diagnostic=True,
                              layout="random", mhla_lr_ablation=True),
    # mosaic-random with a teacher that learns it. Fixed from the teacher probe alone (recipes/experiments/results/
    # teacher-probe, before any conversion was run on such a teacher): with the DDPM epsilon objective the softmax
    # teacher sits at the per-pixel bound for ~3,000 steps (attention on its own cell uniform), with rectified flow
    # at 1e-3 it leaves the bound by ~1,000 steps (cell FID 19.5 at 2,000 steps, 6.2 at 4,000). bf16 autocast: a
    # softmax step 25-27 ms at batch 128 (fp32 with TF32, above: 129 ms at batch 256). The rest as mosaic-random,
    # the 5 x 5 block-grid ablation included.
    "mosaic-random-flow": Settings(resolution=32, patch_size=1, layers=4, heads=4, head_dim=32, mhla_blocks=(1, 4, 4),
                                   pretrain_steps=4000, finetune_steps=600, batch_size=128, pretrain_lr=1e-3, finetune_lr=3e-4,
                                   warmup=200, ema_decay=0.999, classifier_steps=2000, samples=500, sampling_steps=25,
                                   guidance=1.0, seeds=(0, 1, 2), mhla_lr=5e-3, mosaic=4, hybrid=3, diagnostic=True,
                                   layout="random", mhla_lr_ablation=True, other_grids=((1, 5, 5),), objective="flow",
                                   precision="bf16"),
    # CI on a CPU: 2 x 2 mosaics of 8x8 scans (256 tokens), three layers so the hybrid keeps one softmax.
    "mosaic-toy": Settings(resolution=16, patch_size=1, layers=3, heads=2, head_dim=8, mhla_blocks=(1, 2, 2),
                           pretrain_steps=8, finetune_steps=4, batch_size=8, pretrain_lr=1e-3, finetune_lr=1e-3,
                           warmup=2, ema_decay=0.9, classifier_steps=20, samples=20, sampling_steps=2,
                           guidance=1.5, seeds=(0, 1), mhla_lr=1e-2, mosaic=2, hybrid=3, diagnostic=True),
}
# CI on a CPU: mosaic-random-flow's path (random layouts, rectified flow, the ablation rows) at mosaic-toy's size.
PRESETS["mosaic-random-toy"] = replace(PRESETS["mosaic-toy"], guidance=1.0, layout="random", mhla_lr_ablation=True,
                                       objective="flow", seeds=(0,))

VARIANTS = ("softmax", "linear", "mhla")


def grid_variant(blocks) -> str:
    return "mhla_" + "x".join(map(str, blocks))


def variants(settings: Settings) -> tuple:
    return (VARIANTS + (("hybrid",) if settings.hybrid else ()) + (("mhla_base_lr",) if settings.mhla_lr_ablation else ())
            + tuple(grid_variant(g) for g in settings.other_grids))


def variant_blocks(settings: Settings) -> dict:
    mhla = tuple(settings.mhla_blocks)
    blocks = {"softmax": None, "linear": (1, 1, 1), "mhla": mhla, "hybrid": mhla, "mhla_base_lr": mhla,
              **{grid_variant(g): tuple(g) for g in settings.other_grids}}
    return {v: blocks[v] for v in variants(settings)}


def variant_layers(settings: Settings, variant: str) -> str:
    return f"hybrid:{settings.hybrid}" if variant == "hybrid" else "all"


def variant_labels(settings: Settings) -> dict:
    m = math.prod(settings.mhla_blocks)
    labels = {"softmax": "softmax", "linear": "linear (one block)", "mhla": f"MHLA ({m} blocks)",
              "hybrid": f"MHLA hybrid ({m} blocks, 1 in {settings.hybrid} layers softmax)",
              "mhla_base_lr": f"MHLA ({m} blocks), its parameters at the fine-tune rate",
              **{grid_variant(g): f"MHLA ({math.prod(g)} blocks, grid {' x '.join(map(str, g))})" for g in settings.other_grids}}
    return {v: labels[v] for v in variants(settings)}


def table_rows(settings: Settings) -> list[tuple[str, str, int, str]]:
    labels, blocks = variant_labels(settings), variant_blocks(settings)
    m = {v: "—" if b is None else str(math.prod(b)) for v, b in blocks.items()}
    first = [(f"{labels[v]}{' (pre-trained)' if v == 'softmax' else ', converted'}", m[v], 0, f"{v}/converted") for v in labels]
    rows = first + [(f"{labels[v]}, fine-tuned", m[v], settings.finetune_steps, f"{v}/finetuned") for v in labels]
    if settings.data_free:
        rows += [row for v in DATA_FREE for row in (
            (f"{labels[v]}, attention transfer (no scans)", m[v], 0, f"{v}/transferred"),
            (f"{labels[v]}, transfer + teacher-only fine-tune (no scans)", m[v], settings.finetune_steps, f"{v}/teacher"))]
        if settings.guided_target:
            rows.append((f"{labels['mhla']}, transfer + teacher-only fine-tune on the guided target (no scans; sampled at "
                         "guidance 1)", m["mhla"], settings.finetune_steps, "mhla/teacher_guided"))
    return rows


DATA_FREE = ("linear", "mhla")
CURVED = ("linear", "mhla")  # the variants `curve_steps` scores along the way


def curve_rows(settings: Settings) -> list[tuple[str, list[tuple[int, str]]]]:
    """(label, [(fine-tune step, results key)]) per quality curve: 0, the curve steps, the budget."""
    labels, steps = variant_labels(settings), sorted(settings.curve_steps)
    kinds = [("fine-tune on the scans", "converted", "finetuned")]
    if settings.data_free:
        kinds.append(("attention transfer + teacher-only fine-tune (no scans)", "transferred", "teacher"))
    return [(f"{labels[v]}, {what}", [(0, f"{v}/{start}"), *((n, f"{v}/{end}@{n}") for n in steps),
                                       (settings.finetune_steps, f"{v}/{end}")])
            for v in CURVED for what, start, end in kinds]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python recipes/experiments/digits.py", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="full", help="sizes and steps (default: full, for one GPU)")
    p.add_argument("--out", type=Path, default=None, help="output dir; a rerun resumes there (default: outputs/digits, "
                   "outputs/<preset> for the mosaic presets)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes after the pre-training (one GPU "
                   "serves several: these small models leave it mostly idle); default 1")
    p.add_argument("--only-seed", type=int, default=None, help=argparse.SUPPRESS)  # one process of --jobs
    kinds = {"int": int, "float": float, "str": str, "tuple": lambda text: tuple(int(x) for x in text.split(",") if x),
             "bool": lambda text: text.lower() in ("1", "true", "yes")}
    for f in fields(Settings):
        kind = {"mhla_blocks": parse_blocks, "other_grids": parse_grids}.get(f.name, kinds[f.type])
        presets = ", ".join(f"{name}: {getattr(preset, f.name)}" for name, preset in PRESETS.items())
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=f"({presets})")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    args.out = args.out or Path("outputs/digits" if args.preset in ("full", "toy") else f"outputs/{args.preset}")
    overrides = {f.name: getattr(args, f.name) for f in fields(Settings) if getattr(args, f.name) is not None}
    try:
        settings = replace(PRESETS[args.preset], **overrides)
        check(settings)
    except ValueError as e:
        p.error(str(e))
    if args.only_seed is not None and args.only_seed not in settings.seeds:
        p.error(f"--only-seed {args.only_seed} is not one of the seeds {settings.seeds}")
    return args, settings


def parse_grids(text: str) -> tuple:
    """Block grids as typed: 'bt,bh,bw' each, separated by spaces or ';' (e.g. '1,5,5 1,8,8')."""
    grids = []
    for g in re.sub(r"\s*([,x])\s*", r"\1", text).replace(";", " ").split():
        try:
            grid = parse_blocks(g)
        except ValueError:
            grid = g
        if isinstance(grid, str):  # 'auto' or not numbers
            raise argparse.ArgumentTypeError(f"each grid must be 'bt,bh,bw' (e.g. '1,5,5 1,8,8'), got {g!r}")
        grids.append(grid)
    return tuple(grids)


def recorded_grids(runs: dict) -> tuple:
    """The other grids a run's results already hold rows of (variant keys 'mhla_BTxBHxBW/...')."""
    found = (re.fullmatch(r"mhla_(\d+)x(\d+)x(\d+)", key.split("/")[0]) for key in runs)
    return tuple(dict.fromkeys(tuple(int(x) for x in m.groups()) for m in found if m))


def check(s: Settings) -> None:
    """Refuse settings that cannot run, before anything is trained."""
    from ..blocks import check_blocks

    positive = ["resolution", "patch_size", "layers", "heads", "head_dim", "batch_size", "classifier_steps", "sampling_steps", "pretrain_steps"]
    bad = [n for n in positive if getattr(s, n) < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be positive")
    bad = [n for n in ("finetune_steps", "warmup") if getattr(s, n) < 0]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be zero or more")
    if s.samples < 2 * NUM_CLASSES:
        raise ValueError(f"samples must be at least {2 * NUM_CLASSES} (FID needs two per class at least), got {s.samples}")
    if not s.seeds:
        raise ValueError("seeds is empty")
    if s.resolution % s.patch_size:
        raise ValueError(f"resolution {s.resolution} is not a multiple of patch size {s.patch_size}")
    if s.mosaic < 1 or s.resolution % s.mosaic or s.cell_resolution < 8:
        raise ValueError(f"mosaic {s.mosaic} must divide resolution {s.resolution} into cells of at least the scans' 8 pixels")
    pixel_dit.Process(s.objective, s.precision)  # refuses an unknown objective or precision
    if s.layout not in ("fixed", "random"):
        raise ValueError(f"layout {s.layout!r} must be fixed or random")
    if not s.conditional and (s.mosaic == 1 or s.guidance != 1.0 or s.data_free):
        raise ValueError("layout random needs mosaic > 1, guidance 1 (it is unconditional) and no data_free")
    if any(not 0 < n < s.finetune_steps for n in s.curve_steps):
        raise ValueError(f"curve_steps {s.curve_steps} must lie strictly between 0 and finetune_steps ({s.finetune_steps})")
    if s.guided_target and not (s.data_free and s.guidance != 1.0):
        raise ValueError("guided_target needs data_free and a guidance scale other than 1 to distill")
    if s.hybrid and not 2 <= s.hybrid <= s.layers:
        raise ValueError(f"hybrid {s.hybrid} must be 0 (no hybrid variant) or in 2..layers ({s.layers}): every K-th layer keeps softmax")
    if isinstance(s.mhla_blocks, str):
        raise ValueError("mhla_blocks must be an explicit block grid here, e.g. 1,4,4")
    side = s.resolution // s.patch_size
    for name, grid in [("mhla_blocks", s.mhla_blocks), *(("other_grids", g) for g in s.other_grids)]:
        check_blocks((1, side, side), grid)
        if math.prod(grid) < 2:
            raise ValueError(f"{name} {grid} is one block, the linear variant; MHLA needs M > 1")
    grids = [tuple(s.mhla_blocks), *map(tuple, s.other_grids)]
    repeated = sorted({g for g in grids if grids.count(g) > 1})
    if repeated:
        raise ValueError(f"other_grids repeat {', '.join(map(str, repeated))} (mhla_blocks is {tuple(s.mhla_blocks)})")


def card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, torch threads: {torch.get_num_threads()})"


class Results:
    """results.json, rewritten atomically after every phase."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {"runs": {}, "curves": {}}
        self.data.update(header)

    def done(self, key: str, seed: int) -> bool:
        return str(seed) in self.data["runs"].get(key, {})

    def add_run(self, key: str, seed: int, value: dict) -> None:
        self.data["runs"].setdefault(key, {})[str(seed)] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)


class Judge:
    """Scores samples per cell: FID on the classifier's features against the real train scans, and
    the classifier's accuracy against the requested digits (plain digits: one cell, the image), or,
    for unconditional random mosaics, its confidence (mean top-class probability: is each cell
    legibly one digit).

    Mosaics are also scored whole: FID of the concatenated per-cell logits (m^2 x 10 features)
    against mosaics composed from the train scans. That space sees what per-cell scores cannot: which
    digit stands where, jointly (a cell copying its neighbour, one layout's digits bleeding into
    another's); each cell's style is left to the cell FID. Inception features would read 32x32 grey
    mosaics as upscaled noise."""

    def __init__(self, classifier, s: Settings, reference_cells: torch.Tensor, device, reference_mosaics=None):
        self.classifier, self.device, self.mosaic, self.conditional = classifier, device, s.mosaic, s.conditional
        self.feature = clf.FIDFeatures(classifier, s.cell_resolution)
        self.reference = fidlib.tensor_stats(to_uint8_rgb(reference_cells), self.feature, device=device)
        self.layouts = layouts(s.mosaic)
        if s.mosaic > 1:
            self.reference_mosaics = self.mosaic_stats(reference_mosaics)

    @torch.no_grad()
    def mosaic_stats(self, images: torch.Tensor) -> fidlib.FeatureStats:
        cells = split_cells(to_uint8_rgb(images)[:, :1].float() / 127.5 - 1.0, self.mosaic)  # the samples' uint8 path
        logits = torch.cat([self.classifier(chunk.to(self.device)).cpu() for chunk in cells.split(4000)])
        features = logits.reshape(len(images), -1).double().numpy()
        return fidlib.FeatureStats(features.mean(0), np.cov(features, rowvar=False), len(images))

    def score(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        cells = split_cells(images, self.mosaic)
        fake = fidlib.tensor_stats(to_uint8_rgb(cells), self.feature, device=self.device)
        scores = {"fid": fidlib.frechet_distance(self.reference, fake), "n": len(labels)}
        if self.conditional:
            scores["accuracy"] = clf.accuracy(self.classifier, cells, self.layouts[labels].flatten())
        else:
            scores["confidence"] = clf.confidence(self.classifier, cells)
        if self.mosaic > 1:
            scores["image_fid"] = fidlib.frechet_distance(self.reference_mosaics, self.mosaic_stats(images))
            scores["cells"] = len(cells)
        return scores


@contextlib.contextmanager
def timed(results: Results, phase: str):
    """Add the phase's wall time to results['timings_s'] and print it."""
    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    timings = results.data.setdefault("timings_s", {})
    timings[phase] = timings.get(phase, 0.0) + dt
    results.save()
    print(f"[digits] {phase}: {dt:.1f} s", flush=True)


def classifier_phase(out: Path, digits, s: Settings, results: Results, device, progress: bool):
    path = out / "checkpoints" / "classifier.pt"
    model = clf.DigitClassifier().to(device)
    if path.is_file():
        model.load_state_dict(torch.load(path, map_location=device))
        return model.eval()
    with timed(results, "classifier"):
        model = clf.train_classifier(digits.train_images, digits.train_labels, steps=s.classifier_steps,
                                     seed=PRETRAIN_SEED, device=device, progress=progress)
        torch.save(model.state_dict(), path)
    return model


def pretrain_phase(out: Path, digits, s: Settings, results: Results, device, progress: bool):
    from diffusers import DiTTransformer2DModel

    path = out / "checkpoints" / "pretrained"
    if (path / "config.json").is_file():
        return DiTTransformer2DModel.from_pretrained(path).to(device).eval()
    with timed(results, "pretrain"):
        model = pixel_dit.build_dit(s.resolution, s.model_size(), PRETRAIN_SEED).to(device)
        losses = pixel_dit.train(model, digits.train_images, digits.train_labels, s.train_settings("pretrain"),
                                 PRETRAIN_SEED, "pretrain (softmax)", progress)
        results.data["curves"]["pretrain"] = curve(losses)
        model.save_pretrained(path)
    return model


def save_samples(path: Path, images, labels, s: Settings) -> None:
    """Plain digits: 10 per class; mosaics: 4 per layout (random ones: 40), each pixel drawn 3 x 3."""
    rows = labels if s.conditional else torch.arange(len(labels)) % NUM_CLASSES
    report.save_grid(path, images, rows, *((4, 3 * s.resolution) if s.mosaic > 1 else ()))


def attention_diagnostic(model, s: Settings, seed: int) -> list[dict]:
    """The paper's diagnostic on one model: per layer, the numerical rank and row entropy of the
    attention it computes (softmax, linear or MHLA, read off its own q and k) on all N queries, at
    the last denoising step of one sample of layout 0."""
    from ..evaluation.attention_capture import record_projections
    from ..evaluation.attention_stats import layer_stats
    from ..processors import MHLAProcessorBase

    attentions = {str(i): block.attn1 for i, block in enumerate(model.transformer_blocks)}
    with record_projections(attentions) as captures:
        pixel_dit.sample(model, torch.zeros(1, dtype=torch.long), s.sampling_steps, s.guidance, seed + 3000, process=s.process)
    rows = []
    for i, cap in captures.items():
        mhla = isinstance(attentions[i].processor, MHLAProcessorBase)
        kind = "softmax" if not mhla else ("linear" if math.prod(cap.blocks) == 1 else "mhla")
        stats = layer_stats(cap, max_queries=cap.q.shape[0], kinds=(kind,))
        rows.append({"layer": int(i), "kind": kind, "rank": stats[f"{kind}_rank"], "entropy": stats[f"{kind}_entropy"],
                     "tokens": stats["tokens"], "head_dim": stats["head_dim"], "num_blocks": stats["num_blocks"],
                     "max_entropy": stats["max_entropy"]})
    return rows


def curve(losses: list[float]) -> dict:
    every = max(1, len(losses) // 250)
    return {"every": every, "loss": report.smooth(losses, every)}


def evaluate(results: Results, judge: Judge, model, key: str, seed: int, s: Settings, out: Path, extra: dict,
             guidance: float | None = None) -> None:
    """Sample (at the experiment's guidance unless given), score, record; the first seed's samples
    also become a grid PNG, except those along a curve."""
    labels = s.class_labels(s.samples)
    with timed(results, "sampling+scoring"):
        images = pixel_dit.sample(model, labels, s.sampling_steps, s.guidance if guidance is None else guidance, seed,
                                   process=s.process)
        scores = judge.score(images, labels)
    if seed == s.seeds[0] and "@" not in key:
        save_samples(out / f"samples_{key.replace('/', '_')}.png", images, labels, s)
    results.add_run(key, seed, {**scores, **extra})
    legibility = f"accuracy {scores['accuracy']:.3f}" if "accuracy" in scores else f"confidence {scores['confidence']:.3f}"
    print(f"[digits] {key} seed {seed}: FID {scores['fid']:.3f}, {legibility}", flush=True)


def finetune(results: Results, judge: Judge, model, images, labels, variant: str, kind: str, seed: int, s: Settings,
             out: Path, progress: bool, teacher=None) -> list[float]:
    """Fine-tune `model` (its `kind` of run: finetuned, teacher, teacher_guided), scoring the curve variants
    at `curve_steps` on the way (resumed runs repeat the fine-tune, so these are rewritten, not skipped)."""
    curve = s.curve_steps if variant in CURVED and kind in ("finetuned", "teacher") else ()
    score_at = lambda n: evaluate(results, judge, model, f"{variant}/{kind}@{n}", seed, s, out, {"finetune_steps": n})  # noqa: E731
    what = {"finetuned": "finetune", "teacher": "teacher-only finetune", "teacher_guided": "teacher-only guided finetune"}[kind]
    with timed(results, f"{what} {variant}"):
        return pixel_dit.train(model, images, labels, s.train_settings("finetune", variant), seed,
                               f"{what} {variant_labels(s)[variant]} seed {seed}", progress, teacher=teacher,
                               at_steps=curve, at_step=score_at)


def seed_phase(base, digits, judge: Judge, seed: int, s: Settings, results: Results, out: Path, progress: bool) -> None:
    for variant, blocks in variant_blocks(s).items():
        if results.done(f"{variant}/converted", seed) and results.done(f"{variant}/finetuned", seed):
            continue
        model = pixel_dit.converted_copy(base, blocks, variant_layers(s, variant))
        if not results.done(f"{variant}/converted", seed):
            evaluate(results, judge, model, f"{variant}/converted", seed, s, out, {"finetune_steps": 0})
        if not results.done(f"{variant}/finetuned", seed):
            losses = finetune(results, judge, model, digits.train_images, digits.train_labels, variant, "finetuned", seed, s,
                              out, progress)
            results.data["curves"][f"{variant}/seed{seed}"] = curve(losses)
            if s.diagnostic and seed == s.seeds[0]:
                with timed(results, "attention diagnostic"):
                    results.data.setdefault("attention", {})[variant] = attention_diagnostic(model, s, seed)
            evaluate(results, judge, model, f"{variant}/finetuned", seed, s, out,
                     {"finetune_steps": s.finetune_steps, **mixing_drift(model)})
        del model
    if s.data_free:
        data_free_phase(base, judge, seed, s, results, out, progress)


def data_free_phase(base, judge: Judge, seed: int, s: Settings, results: Results, out: Path, progress: bool) -> None:
    """Conversion with the pre-trained model as the only teacher, no scans: attention transfer on its own
    samples, then fine-tuning on its own samples with its prediction as the distillation target (both CFG
    branches; with `guided_target` also MHLA on the guided prediction, sampled at guidance 1)."""
    from ..conversion import default_config
    from ..transfer import transfer

    teacher_labels = s.class_labels(s.teacher_samples)
    teacher_images = None
    transferred = {}  # variant -> its transferred model, for the runs that start from it (MHLA: both targets)
    runs = [(v, "teacher", None) for v in DATA_FREE] + ([("mhla", "teacher_guided", s.guidance)] if s.guided_target else [])
    for variant, kind, guidance in runs:
        if results.done(f"{variant}/transferred", seed) and results.done(f"{variant}/{kind}", seed):
            continue
        if variant not in transferred:
            model = copy.deepcopy(base)
            fit_labels = s.class_labels(4 * NUM_CLASSES)
            with timed(results, f"transfer {variant}"):
                fits = transfer(model, default_config(model, blocks=variant_blocks(s)[variant]),
                                lambda: pixel_dit.sample(model, fit_labels, s.sampling_steps, s.guidance, seed + 2000,
                                                         process=s.process),
                                keep=16, steps=s.transfer_steps, lr=1e-2, projection_lr=s.finetune_lr * 10, seed=seed,
                                progress=progress)
            if not results.done(f"{variant}/transferred", seed):
                evaluate(results, judge, model, f"{variant}/transferred", seed, s, out,
                         {"finetune_steps": 0, "layers": [{"layer": f.name, "before": f.before, "after": f.after} for f in fits]})
            transferred[variant] = model
        model = copy.deepcopy(transferred[variant])
        if teacher_images is None:
            with timed(results, "teacher samples"):
                teacher_images = pixel_dit.sample(base, teacher_labels, s.sampling_steps, s.guidance, seed + 1000,
                                                  process=s.process)
        losses = finetune(results, judge, model, teacher_images, teacher_labels, variant, kind, seed, s, out, progress,
                          teacher=pixel_dit.Teacher(base, guidance))
        results.data["curves"][f"{variant}_{kind}/seed{seed}"] = curve(losses)
        evaluate(results, judge, model, f"{variant}/{kind}", seed, s, out,
                 {"finetune_steps": s.finetune_steps, **mixing_drift(model)}, guidance=1.0 if guidance else None)
        del model


def write_report(out: Path, s: Settings, results: Results) -> None:
    (out / "results.md").write_text(report.results_markdown(results.data, table_rows(s)) + report.curve_markdown(results.data, curve_rows(s)))
    report.plot_losses(out / "loss_curves.png", results.data["curves"], variant_labels(s),
                       "velocity MSE" if s.objective == "flow" else "epsilon MSE")
    if s.curve_steps:
        report.plot_quality(out / "quality_curves.png", results.data["runs"], curve_rows(s))
    if results.data.get("attention"):
        report.plot_attention(out / "attention.png", results.data["attention"], variant_labels(s))
    if s.mosaic > 1:
        names = ["real", *(key.replace("/", "_") for *_, key in table_rows(s))]
        report.sample_sheet(out / "samples.png", [(out / f"samples_{n}.png", n.replace("_", " ")) for n in names])


def load_data(s: Settings) -> tuple[Digits, Digits]:
    """(scans, images): the scans at cell size, and what the diffusion model learns and is judged
    against: the scans themselves, or mosaics of them (train: from the train scans; held-out: as
    many as an evaluation's samples, from the held-out scans, layouts balanced)."""
    scans = load_digits(s.cell_resolution)
    if s.mosaic == 1:
        return scans, scans
    train_ids, test_ids = s.class_labels(MOSAIC_TRAIN), s.class_labels(s.samples)
    if not s.conditional:
        return scans, Digits(random_mosaics(scans.train_images, MOSAIC_TRAIN, s.mosaic, seed=1), train_ids,
                             random_mosaics(scans.test_images, s.samples, s.mosaic, seed=2), test_ids)
    return scans, Digits(compose_mosaics(scans.train_images, scans.train_labels, train_ids, s.mosaic, seed=1), train_ids,
                         compose_mosaics(scans.test_images, scans.test_labels, test_ids, s.mosaic, seed=2), test_ids)


def run_seeds_in_parallel(argv: list[str], out: Path, s: Settings, jobs: int, results: Results) -> int:
    """Each seed in its own process (this command with --only-seed, in OUT/seeds/SEED, sharing OUT's
    checkpoints), `jobs` at a time; their results are merged into OUT's as each batch ends. A rerun
    resumes every seed where its process stopped."""
    import subprocess

    rc = 0
    for first in range(0, len(s.seeds), jobs):
        procs = []
        for seed in s.seeds[first:first + jobs]:
            child = out / "seeds" / str(seed)
            child.mkdir(parents=True, exist_ok=True)
            started = Results(child / "results.json", {})  # what a run without --jobs already did for this seed stays done
            for key, runs in results.data["runs"].items():
                if str(seed) in runs:
                    started.data["runs"].setdefault(key, {}).setdefault(str(seed), runs[str(seed)])
            for key, c in results.data["curves"].items():
                if key.endswith(f"/seed{seed}"):
                    started.data["curves"].setdefault(key, c)
            started.save()
            if not (child / "checkpoints").exists():
                (child / "checkpoints").symlink_to((out / "checkpoints").resolve(), target_is_directory=True)
            grids = ["--other-grids", " ".join(",".join(map(str, g)) for g in s.other_grids)] if s.other_grids else []
            cmd = [sys.executable, "-m", "mhla_diffusion.experiments.digits", *argv, *grids,  # the run's grids, recorded ones too
                   "--out", str(child), "--only-seed", str(seed), "--jobs", "1", "--no-progress"]
            procs.append(subprocess.Popen(cmd))
        codes = [p.wait() for p in procs]  # negative: killed by a signal (the OOM killer's -9)
        rc = rc or next((code for code in codes if code), 0)
        merge_seed_results(out, s, results)
    return rc


def merge_seed_results(out: Path, s: Settings, results: Results) -> None:
    """Runs, curves, diagnostics and timings of OUT/seeds/*/results.json into OUT's (the first seed's
    sample grids too)."""
    import shutil

    jobs = results.data.setdefault("jobs", {})
    for seed in s.seeds:
        child = out / "seeds" / str(seed)
        if not (child / "results.json").is_file():
            continue
        data = json.loads((child / "results.json").read_text())
        for key, runs in data["runs"].items():
            results.data["runs"].setdefault(key, {}).update(runs)
        results.data["curves"].update({k: v for k, v in data["curves"].items() if k != "pretrain"})
        if data.get("attention"):
            results.data.setdefault("attention", {}).update(data["attention"])
        jobs[str(seed)] = {"timings_s": data.get("timings_s", {}), "wall_s": data.get("wall_s")}
        if seed == s.seeds[0]:
            for png in child.glob("samples_*.png"):
                if png.name != "samples_real.png":
                    shutil.copyfile(png, out / png.name)
    results.save()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, s = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out, progress = args.out, not args.no_progress
    t0 = time.perf_counter()
    pinned = json.loads(json.dumps({k: v for k, v in asdict(s).items() if k not in ("seeds", "other_grids")
                                    and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])}))
    pinned["label_dropout"] = "once per sample"  # out dirs trained with diffusers' per-block dropout are refused
    try:
        pin_settings(out, pinned, "digits results")  # more seeds and grids may be added to a finished run, nothing else
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (out / "checkpoints").mkdir(exist_ok=True)
    results = Results(out / "results.json", {})
    s = replace(s, other_grids=tuple(dict.fromkeys((*map(tuple, s.other_grids), *recorded_grids(results.data["runs"])))))
    results.data.update({"settings": json.loads(json.dumps(asdict(s))), "preset": args.preset, "device": str(device),
                         "card": card(device), "torch": torch.__version__,
                         "command": shlex.join(["python", "recipes/experiments/digits.py", *argv]),
                         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")})

    with timed(results, "data"):
        scans, digits = load_data(s)
    classifier = classifier_phase(out, scans, s, results, device, progress)
    test_acc = clf.accuracy(classifier, scans.test_images, scans.test_labels)
    judge = Judge(classifier, s, scans.train_images, device, digits.train_images[:MOSAIC_REFERENCE])
    results.data["classifier"] = {"test_accuracy": test_acc, "train_n": len(scans.train_labels), "test_n": len(scans.test_labels),
                                  "features": judge.feature.num_features}
    if s.mosaic > 1:
        results.data["mosaics"] = {"train_n": MOSAIC_TRAIN, "reference_n": MOSAIC_REFERENCE, "layouts": layouts(s.mosaic).tolist()}
    results.data["real_heldout"] = judge.score(digits.test_images, digits.test_labels)
    save_samples(out / "samples_real.png", digits.test_images, digits.test_labels, s)
    print(f"[digits] classifier test accuracy {test_acc:.4f}; held-out real scans FID {results.data['real_heldout']['fid']:.3f}", flush=True)

    base = pretrain_phase(out, digits, s, results, device, progress)
    if args.jobs > 1 and len(s.seeds) > 1:
        del base
        rc = run_seeds_in_parallel(argv, out, s, args.jobs, results)
    else:
        rc = 0
        for seed in s.seeds if args.only_seed is None else (args.only_seed,):
            seed_phase(base, digits, judge, seed, s, results, out, progress)
            results.data["wall_s"] = time.perf_counter() - t0
            write_report(out, s, results)
    results.data["wall_s"] = time.perf_counter() - t0
    results.save()
    write_report(out, s, results)
    if rc:
        print(f"error: a seed's process failed (exit status {rc}); rerun the same command to resume", file=sys.stderr)
        return rc if rc > 0 else 1
    print(f"[digits] done in {time.perf_counter() - t0:.1f} s: {out / 'results.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
