"""Does conversion keep quality? Softmax vs plain linear attention (M = 1) vs MHLA on real digits.

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
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from ..config import parse_blocks
from ..evaluation import fid as fidlib
from ..evaluation.store import pin_settings
from ..training.model import mixing_drift
from . import classifier as clf
from . import pixel_dit, report
from .digits_data import NUM_CLASSES, load_digits, to_uint8_rgb

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

    def model_size(self) -> pixel_dit.ModelSize:
        return pixel_dit.ModelSize(self.layers, self.heads, self.head_dim, self.patch_size)

    def train_settings(self, phase: str) -> pixel_dit.TrainSettings:
        steps, lr = (self.pretrain_steps, self.pretrain_lr) if phase == "pretrain" else (self.finetune_steps, self.finetune_lr)
        mhla_lr = self.mhla_lr if phase == "finetune" else 0.0
        return pixel_dit.TrainSettings(steps, self.batch_size, lr, min(self.warmup, steps), self.ema_decay, mhla_lr=mhla_lr)


# Settings added after runs were made: left out of a run's pinned settings while at these defaults,
# so such a run (which used them implicitly) can still be resumed.
LATER_DEFAULTS = {"mhla_lr": 0.0, "data_free": False, "transfer_steps": 300, "teacher_samples": 1000}


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
}

VARIANTS = ("softmax", "linear", "mhla")


def variant_blocks(settings: Settings) -> dict:
    return {"softmax": None, "linear": (1, 1, 1), "mhla": tuple(settings.mhla_blocks)}


def variant_labels(settings: Settings) -> dict:
    m = math.prod(settings.mhla_blocks)
    return {"softmax": "softmax", "linear": "linear (one block)", "mhla": f"MHLA ({m} blocks)"}


def table_rows(settings: Settings) -> list[tuple[str, str, int, str]]:
    labels, blocks = variant_labels(settings), variant_blocks(settings)
    m = {v: "—" if b is None else str(math.prod(b)) for v, b in blocks.items()}
    first = [(f"{labels[v]}{' (pre-trained)' if v == 'softmax' else ', converted'}", m[v], 0, f"{v}/converted") for v in VARIANTS]
    rows = first + [(f"{labels[v]}, fine-tuned", m[v], settings.finetune_steps, f"{v}/finetuned") for v in VARIANTS]
    if settings.data_free:
        rows += [row for v in DATA_FREE for row in (
            (f"{labels[v]}, attention transfer (no scans)", m[v], 0, f"{v}/transferred"),
            (f"{labels[v]}, transfer + teacher-only fine-tune (no scans)", m[v], settings.finetune_steps, f"{v}/teacher"))]
    return rows


DATA_FREE = ("linear", "mhla")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python recipes/experiments/digits.py", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="full", help="sizes and steps (default: full, for one GPU)")
    p.add_argument("--out", type=Path, default=Path("outputs/digits"), help="output dir; a rerun resumes there")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    kinds = {"int": int, "float": float, "tuple": lambda text: tuple(int(x) for x in text.split(",")),
             "bool": lambda text: text.lower() in ("1", "true", "yes")}
    for f in fields(Settings):
        kind = parse_blocks if f.name == "mhla_blocks" else kinds[f.type]
        presets = ", ".join(f"{name}: {getattr(preset, f.name)}" for name, preset in PRESETS.items())
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=f"({presets})")
    args = p.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in fields(Settings) if getattr(args, f.name) is not None}
    try:
        settings = replace(PRESETS[args.preset], **overrides)
        check(settings)
    except ValueError as e:
        p.error(str(e))
    return args, settings


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
    if isinstance(s.mhla_blocks, str):
        raise ValueError("mhla_blocks must be an explicit block grid here, e.g. 1,4,4")
    side = s.resolution // s.patch_size
    check_blocks((1, side, side), s.mhla_blocks)
    if math.prod(s.mhla_blocks) < 2:
        raise ValueError(f"mhla_blocks {s.mhla_blocks} is one block, the linear variant; MHLA needs M > 1")


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
    """Scores samples: FID on the classifier's features against the real train scans, and the
    classifier's accuracy against the requested classes."""

    def __init__(self, classifier, resolution: int, reference_images: torch.Tensor, device):
        self.classifier, self.device = classifier, device
        self.feature = clf.FIDFeatures(classifier, resolution)
        self.reference = fidlib.tensor_stats(to_uint8_rgb(reference_images), self.feature, device=device)

    def score(self, images: torch.Tensor, labels: torch.Tensor) -> dict:
        fake = fidlib.tensor_stats(to_uint8_rgb(images), self.feature, device=self.device)
        return {"fid": fidlib.frechet_distance(self.reference, fake), "accuracy": clf.accuracy(self.classifier, images, labels),
                "n": len(labels)}


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


def curve(losses: list[float]) -> dict:
    every = max(1, len(losses) // 250)
    return {"every": every, "loss": report.smooth(losses, every)}


def evaluate(results: Results, judge: Judge, model, key: str, seed: int, s: Settings, out: Path, extra: dict) -> None:
    """Sample, score, record; the first seed's samples also become a grid PNG."""
    labels = torch.arange(s.samples) % NUM_CLASSES
    with timed(results, "sampling+scoring"):
        images = pixel_dit.sample(model, labels, s.sampling_steps, s.guidance, seed)
        scores = judge.score(images, labels)
    if seed == s.seeds[0]:
        report.save_grid(out / f"samples_{key.replace('/', '_')}.png", images, labels)
    results.add_run(key, seed, {**scores, **extra})
    print(f"[digits] {key} seed {seed}: FID {scores['fid']:.3f}, accuracy {scores['accuracy']:.3f}", flush=True)


def seed_phase(base, digits, judge: Judge, seed: int, s: Settings, results: Results, out: Path, progress: bool) -> None:
    labels = variant_labels(s)
    for variant, blocks in variant_blocks(s).items():
        if results.done(f"{variant}/converted", seed) and results.done(f"{variant}/finetuned", seed):
            continue
        model = pixel_dit.converted_copy(base, blocks)
        if not results.done(f"{variant}/converted", seed):
            evaluate(results, judge, model, f"{variant}/converted", seed, s, out, {"finetune_steps": 0})
        if not results.done(f"{variant}/finetuned", seed):
            with timed(results, f"finetune {variant}"):
                losses = pixel_dit.train(model, digits.train_images, digits.train_labels, s.train_settings("finetune"),
                                         seed, f"finetune {labels[variant]} seed {seed}", progress)
            results.data["curves"][f"{variant}/seed{seed}"] = curve(losses)
            evaluate(results, judge, model, f"{variant}/finetuned", seed, s, out,
                     {"finetune_steps": s.finetune_steps, **mixing_drift(model)})
        del model
    if s.data_free:
        data_free_phase(base, judge, seed, s, results, out, progress)


def data_free_phase(base, judge: Judge, seed: int, s: Settings, results: Results, out: Path, progress: bool) -> None:
    """Conversion with the pre-trained model as the only teacher, no scans: attention transfer on its own
    samples, then fine-tuning on its own samples with its prediction as the distillation target."""
    from ..conversion import default_config
    from ..transfer import transfer

    labels = variant_labels(s)
    teacher_labels = torch.arange(s.teacher_samples) % NUM_CLASSES
    teacher_images = None
    for variant in DATA_FREE:
        if results.done(f"{variant}/transferred", seed) and results.done(f"{variant}/teacher", seed):
            continue
        model = copy.deepcopy(base)
        fit_labels = torch.arange(4 * NUM_CLASSES) % NUM_CLASSES
        with timed(results, f"transfer {variant}"):
            fits = transfer(model, default_config(model, blocks=variant_blocks(s)[variant]),
                            lambda: pixel_dit.sample(model, fit_labels, s.sampling_steps, s.guidance, seed + 2000),
                            keep=16, steps=s.transfer_steps, lr=1e-2, projection_lr=s.finetune_lr * 10, seed=seed,
                            progress=progress)
        evaluate(results, judge, model, f"{variant}/transferred", seed, s, out,
                 {"finetune_steps": 0, "layers": [{"layer": f.name, "before": f.before, "after": f.after} for f in fits]})
        if teacher_images is None:
            with timed(results, "teacher samples"):
                teacher_images = pixel_dit.sample(base, teacher_labels, s.sampling_steps, s.guidance, seed + 1000)
        with timed(results, f"teacher-only finetune {variant}"):
            losses = pixel_dit.train(model, teacher_images, teacher_labels, s.train_settings("finetune"), seed,
                                     f"teacher-only {labels[variant]} seed {seed}", progress, teacher=base)
        results.data["curves"][f"{variant}_teacher/seed{seed}"] = curve(losses)
        evaluate(results, judge, model, f"{variant}/teacher", seed, s, out,
                 {"finetune_steps": s.finetune_steps, **mixing_drift(model)})
        del model


def write_report(out: Path, s: Settings, results: Results) -> None:
    (out / "results.md").write_text(report.results_markdown(results.data, table_rows(s)))
    report.plot_losses(out / "loss_curves.png", results.data["curves"], variant_labels(s))


def main(argv=None) -> int:
    args, s = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out, progress = args.out, not args.no_progress
    t0 = time.perf_counter()
    pinned = json.loads(json.dumps({k: v for k, v in asdict(s).items()
                                    if k != "seeds" and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])}))
    try:
        pin_settings(out, pinned, "digits results")  # more seeds may be added to a finished run, nothing else
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (out / "checkpoints").mkdir(exist_ok=True)
    header = {"settings": json.loads(json.dumps(asdict(s))), "preset": args.preset, "device": str(device), "card": card(device),
              "torch": torch.__version__, "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}
    results = Results(out / "results.json", header)

    with timed(results, "data"):
        digits = load_digits(s.resolution)
    classifier = classifier_phase(out, digits, s, results, device, progress)
    test_acc = clf.accuracy(classifier, digits.test_images, digits.test_labels)
    judge = Judge(classifier, s.resolution, digits.train_images, device)
    results.data["classifier"] = {"test_accuracy": test_acc, "train_n": len(digits.train_labels), "test_n": len(digits.test_labels),
                                  "features": judge.feature.num_features}
    results.data["real_heldout"] = judge.score(digits.test_images, digits.test_labels)
    report.save_grid(out / "samples_real.png", digits.test_images, digits.test_labels)
    print(f"[digits] classifier test accuracy {test_acc:.4f}; held-out real scans FID {results.data['real_heldout']['fid']:.3f}", flush=True)

    base = pretrain_phase(out, digits, s, results, device, progress)
    for seed in s.seeds:
        seed_phase(base, digits, judge, seed, s, results, out, progress)
        results.data["wall_s"] = time.perf_counter() - t0
        write_report(out, s, results)
    print(f"[digits] done in {time.perf_counter() - t0:.1f} s: {out / 'results.md'}", flush=True)
    return 0
