"""`mhla-diffusion demo`: the whole workflow on a really trained model, on a CPU, with no download.

The bundled model (`mhla_diffusion/assets/digits/`, its MODEL_CARD.md says how it was made) is the
digits experiment's pre-trained softmax DiT (16 x 16 digit scans, 256 tokens) and its digit
classifier. The demo converts the DiT to MHLA, fits each converted layer to the original's own
attention outputs on the original's own samples (attention transfer: no data), saves and reloads
the converted dir, and scores samples of the original, the converted model before fitting and
after it with the classifier, into one labelled picture and a summary.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from . import classifier as clf
from . import pixel_dit
from .digits_data import NUM_CLASSES

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "digits"
# The digits experiment's settings that make the bundled model (its MODEL_CARD.md records them).
PRETRAIN_SETTINGS = ("resolution", "patch_size", "layers", "heads", "head_dim", "pretrain_steps", "batch_size",
                     "pretrain_lr", "warmup", "ema_decay", "classifier_steps", "samples", "sampling_steps", "guidance")


@dataclass(frozen=True)
class DemoSettings:
    per_class: int = 2  # samples per digit in each row
    steps: int = 20  # DDIM steps
    guidance: float = 1.5
    blocks: tuple = (1, 4, 4)  # MHLA's block grid: 16 blocks of 4 x 4 tokens (M^2 = N)
    transfer_steps: int = 150  # attention transfer: optimizer steps per layer
    seed: int = 0


def load_models(assets: Path = ASSETS):
    """The bundled softmax DiT (float32) and digit classifier."""
    from diffusers import DiTTransformer2DModel

    if not (assets / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"the demo model is missing from {assets}: reinstall mhla-diffusion, or run "
                                "`mhla-diffusion demo --family dit` for the random-weight demo")
    teacher = DiTTransformer2DModel.from_pretrained(assets / "transformer", torch_dtype=torch.float32).eval()
    judge = clf.DigitClassifier()
    judge.load_state_dict(load_file(assets / "classifier.safetensors"))
    return teacher, judge.eval()


def _as_tiles(images: torch.Tensor) -> list:
    """(N, 1, R, R) in [-1, 1] -> N (R, R, 3) arrays in [0, 1]."""
    return list(((images + 1) / 2).clamp(0, 1).repeat(1, 3, 1, 1).permute(0, 2, 3, 1).numpy())


def run(out: Path, s: DemoSettings, assets: Path = ASSETS, progress: bool = True) -> dict:
    from .. import from_pretrained
    from ..conversion import convert, default_config
    from ..evaluation.figures import labelled_grid
    from ..transfer import transfer

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    teacher, judge = load_models(assets)
    config = default_config(teacher, blocks=s.blocks)
    labels = torch.arange(s.per_class * NUM_CLASSES) % NUM_CLASSES
    sample = lambda model: pixel_dit.sample(model, labels, s.steps, s.guidance, s.seed)  # noqa: E731 - same noise each time
    print(f"[1/4] loaded the pre-trained softmax DiT ({sum(p.numel() for p in teacher.parameters()) / 1e6:.1f}M "
          f"parameters, {teacher.config.sample_size} x {teacher.config.sample_size} digits) from {assets}")

    converted = copy.deepcopy(teacher)
    convert(converted, config)
    fitted = copy.deepcopy(teacher)
    fits = transfer(fitted, config, lambda: pixel_dit.sample(fitted, labels, s.steps, s.guidance, s.seed + 1000),
                    keep=16, steps=s.transfer_steps, lr=1e-2, projection_lr=1e-3, seed=s.seed, progress=progress)
    print(f"[2/4] converted {len(fits)} layers to MHLA ({s.blocks} blocks) and fitted each to the softmax layer's "
          "output on the model's own samples (no data): relative error "
          + ", ".join(f"{f.before:.2f} -> {f.after:.2f}" for f in fits))

    fitted.save_pretrained(out / "mhla")
    reloaded = from_pretrained(out / "mhla").eval()
    print(f"[3/4] saved the converted model to {out / 'mhla'} and reloaded it ({type(reloaded).__name__})")

    rows = {"original (softmax)": teacher, "MHLA, converted": converted, "MHLA + attention transfer": reloaded}
    scores, tiles = {}, []
    for name, model in rows.items():
        images = sample(model)
        scores[name] = clf.accuracy(judge, images, labels)
        tiles.append(_as_tiles(images))
    order = torch.argsort(labels, stable=True)  # columns: 0 0 0 1 1 1 ... as the labels say
    picture = labelled_grid(out / "demo.png", [[row[i] for i in order] for row in tiles],
                            [f"{name}\naccuracy {acc:.2f}" for name, acc in scores.items()],
                            [str(int(labels[i])) for i in order],
                            title=f"Digits DiT, same seeds per column ({s.steps} DDIM steps, guidance {s.guidance})",
                            cell=40, footer="accuracy: the bundled digit classifier's agreement with the asked digit "
                                            "(chance 0.10)")
    summary = {"scores": scores, "layers": [{"layer": f.name, "before": f.before, "after": f.after} for f in fits],
               "settings": asdict(s), "seconds": round(time.perf_counter() - t0, 1), "picture": str(picture),
               "converted_dir": str(out / "mhla")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = "\n".join(f"  {name:28s} accuracy {acc:.2f}" for name, acc in scores.items())
    print(f"[4/4] sampled {len(labels)} digits per model -> {picture}\n{text}")
    return summary


def make_assets(out: Path, preset: str = "full", device=None, progress: bool = True) -> dict:
    """Train what the demo ships with the digits experiment's own code and settings: its classifier
    and its pre-trained softmax DiT (seed 0), written to `out` with a MODEL_CARD.md."""
    import datetime
    import shlex
    import sys

    from safetensors.torch import save_file

    from .digits import PRESETS, PRETRAIN_SEED, card
    from .digits_data import load_digits

    s = PRESETS[preset]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    digits = load_digits(s.resolution)
    t0 = time.perf_counter()
    judge = clf.train_classifier(digits.train_images, digits.train_labels, steps=s.classifier_steps, seed=PRETRAIN_SEED,
                                 device=device, progress=progress)
    model = pixel_dit.build_dit(s.resolution, s.model_size(), PRETRAIN_SEED).to(device)
    losses = pixel_dit.train(model, digits.train_images, digits.train_labels, s.train_settings("pretrain"), PRETRAIN_SEED,
                             "pretrain (softmax)", progress)
    labels = torch.arange(s.samples) % NUM_CLASSES
    accuracy = clf.accuracy(judge, pixel_dit.sample(model, labels, s.sampling_steps, s.guidance, PRETRAIN_SEED), labels)
    facts = {"preset": preset, "card": card(device), "torch": torch.__version__,
             "date": datetime.date.today().isoformat(), "seconds": round(time.perf_counter() - t0, 1),
             "command": shlex.join(["python", *sys.argv]),
             "classifier_test_accuracy": round(clf.accuracy(judge, digits.test_images, digits.test_labels), 4),
             "sample_accuracy": round(accuracy, 4), "final_loss": round(sum(losses[-100:]) / len(losses[-100:]), 4),
             "settings": {k: getattr(s, k) for k in PRETRAIN_SETTINGS}}
    out.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(out / "transformer")
    save_file({k: v.cpu().contiguous() for k, v in judge.state_dict().items()}, str(out / "classifier.safetensors"))
    (out / "MODEL_CARD.md").write_text(
        "# The demo's digits DiT\n\nA class-conditional DiT (diffusers `DiTTransformer2DModel`, softmax attention) "
        f"on scikit-learn's 8 x 8 digit scans upscaled to {s.resolution} x {s.resolution} (pixel space, "
        f"{s.resolution ** 2} tokens), and the digit classifier that scores its samples: the digits experiment's "
        "pre-trained model and classifier (mhla_diffusion/experiments/digits.py), made by its own code.\n\n"
        f"- command: `{facts['command']}`\n- card: {facts['card']}, torch {facts['torch']}, {facts['date']}, "
        f"{facts['seconds']} s\n- classifier accuracy on the held-out scans: {facts['classifier_test_accuracy']}\n"
        f"- accuracy of {s.samples} samples ({s.sampling_steps} DDIM steps, guidance {s.guidance}): "
        f"{facts['sample_accuracy']}\n- final training loss (mean of the last 100 steps): {facts['final_loss']}\n\n"
        f"```json\n{json.dumps(facts['settings'], indent=2)}\n```\n")
    return facts
