"""`mhla-diffusion demo`: the whole workflow on an embedded tiny pipeline, no download.

Builds a random-weight pipeline from a bundled config, saves it as a checkpoint, converts it
the way `mhla-diffusion convert` does, reloads it with `mhla_diffusion.from_pretrained`, and
samples both with the same seeds into a side-by-side PNG.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..families import FAMILIES, family_by_name


def sample(pipe, family: str, seed: int, steps: int) -> np.ndarray:
    """Images (N, H, W, 3) in [0, 1] from a tiny pipeline of `family` (video: its frames)."""
    fam = family_by_name(family)
    out = pipe(**fam.demo_kwargs(), num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
               output_type="np")
    return out.frames[0] if fam.video else out.images


def side_by_side(rows: dict, path: Path, scale: int = 8) -> None:
    """One row per model, images left to right, upscaled so a person can see them."""
    tiles = [np.concatenate(list(imgs), axis=1) for imgs in rows.values()]
    grid = np.concatenate(tiles, axis=0)
    img = Image.fromarray((grid.clip(0, 1) * 255).round().astype(np.uint8))
    img.resize((img.width * scale, img.height * scale), Image.NEAREST).save(path)


def run(args) -> int:
    from .. import from_pretrained
    from ..conversion import convert, default_config, mhla_modules
    from ..persistence import load
    from ..zoo import build_pipeline

    from diffusers.utils.logging import disable_progress_bar

    disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    build_pipeline(args.family, seed=args.seed).save_pretrained(out / "original")
    print(f"[1/4] built a tiny random-weight {args.family} pipeline -> {out / 'original'}")

    pipe = load(out / "original")
    convert(pipe, default_config(pipe.transformer))
    pipe.save_pretrained(out / "mhla")
    print(f"[2/4] converted {len(mhla_modules(pipe.transformer))} self-attention layers to MHLA -> {out / 'mhla'}")

    original, converted = load(out / "original"), from_pretrained(out / "mhla")
    print("[3/4] reloaded both (MHLA via mhla_diffusion.from_pretrained)")

    rows, times = {}, {}
    for name, p in (("original", original), ("mhla", converted)):
        p.set_progress_bar_config(disable=True)
        t = time.perf_counter()
        rows[name] = sample(p, args.family, args.seed, args.steps)
        times[name] = time.perf_counter() - t
    side_by_side(rows, out / "demo.png")
    diff = float(np.abs(rows["original"] - rows["mhla"]).mean())
    print(f"[4/4] sampled {len(rows['mhla'])} images with {args.steps} steps: original {times['original']:.2f}s, "
          f"MHLA {times['mhla']:.2f}s; mean |difference| {diff:.3f} (untrained conversion) -> {out / 'demo.png'}")
    print(f"done in {time.perf_counter() - t0:.1f}s. Next: `mhla-diffusion info {out / 'mhla'}`")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="convert, reload and sample an embedded tiny pipeline (no download)")
    p.add_argument("--family", default="dit", choices=[f.name for f in FAMILIES])
    p.add_argument("--out", default="outputs/demo", help="folder for the checkpoints and demo.png")
    p.add_argument("--steps", type=int, default=10, help="denoising steps")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
