"""`mhla-diffusion demo`: the whole workflow with no download.

By default on the bundled, really trained digits DiT (experiments/digits_demo.py: convert, fit by
attention transfer, reload, score, one labelled picture). With `--family`, on a random-weight
tiny pipeline of that family: build, save, convert as `mhla-diffusion convert` does, reload with
`mhla_diffusion.from_pretrained`, and sample both with the same seeds (this shows the plumbing,
not quality). `--save DIR` only writes such a tiny pipeline, to try the other commands on.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..families import FAMILIES, family_by_name
from .main import counted


def sample(pipe, family: str, seed: int, steps: int) -> np.ndarray:
    """Images (N, H, W, 3) in [0, 1] from a tiny pipeline of `family` (video: its frames)."""
    fam = family_by_name(family)
    out = pipe(**fam.demo_kwargs(), num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
               output_type="np")
    return out.frames[0] if fam.video else out.images


def run_tiny(args, out: Path) -> int:
    from .. import from_pretrained
    from ..conversion import convert, default_config, mhla_modules
    from ..evaluation.figures import labelled_grid
    from ..persistence import load
    from ..zoo import build_pipeline

    t0, steps = time.perf_counter(), args.steps or 10
    build_pipeline(args.family, seed=args.seed).save_pretrained(out / "original")
    print(f"[1/4] built a tiny random-weight {args.family} pipeline -> {out / 'original'}")

    pipe = load(out / "original")
    convert(pipe, default_config(pipe.transformer))
    pipe.save_pretrained(out / "mhla")
    print(f"[2/4] converted {counted(len(mhla_modules(pipe.transformer)), 'self-attention layer')} to MHLA -> {out / 'mhla'}")

    original, converted = load(out / "original"), from_pretrained(out / "mhla")
    print("[3/4] reloaded both (MHLA via mhla_diffusion.from_pretrained)")

    rows, times = {}, {}
    for name, p in (("original", original), ("MHLA, untrained", converted)):
        p.set_progress_bar_config(disable=True)
        t = time.perf_counter()
        rows[name] = sample(p, args.family, args.seed, steps)
        times[name] = time.perf_counter() - t
    diff = float(np.abs(rows["original"] - rows["MHLA, untrained"]).mean())
    what = "frame" if family_by_name(args.family).video else "sample"
    labelled_grid(out / "demo.png", [list(images) for images in rows.values()],
                  [f"{name}\n{times[name]:.2f} s" for name in rows],
                  [f"{what} {i}" for i in range(len(rows["original"]))],
                  title=f"tiny random-weight {args.family} pipeline, same seeds ({steps} steps)",
                  footer=f"random weights: this shows conversion and reloading work, not quality "
                         f"(mean |difference| {diff:.3f}); run `mhla-diffusion demo` for a trained model")
    print(f"[4/4] sampled {counted(len(rows['original']), what)} with {steps} steps: original {times['original']:.2f}s, "
          f"MHLA {times['MHLA, untrained']:.2f}s; mean |difference| {diff:.3f} (untrained conversion) -> {out / 'demo.png'}")
    print(f"done in {time.perf_counter() - t0:.1f}s. Next: `mhla-diffusion info {out / 'mhla'}`")
    return 0


def run(args) -> int:
    from diffusers.utils.logging import disable_progress_bar

    from ..zoo import build_pipeline

    disable_progress_bar()
    if args.save:
        family = args.family or "dit"
        build_pipeline(family, seed=args.seed).save_pretrained(args.save)
        print(f"wrote a tiny random-weight {family} pipeline to {args.save}; try `mhla-diffusion convert {args.save} "
              f"{args.save}-mhla` and `mhla-diffusion info {args.save}-mhla`")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.family:
        return run_tiny(args, out)
    from ..experiments import digits_demo

    settings = digits_demo.DemoSettings(steps=args.steps or digits_demo.DemoSettings.steps, seed=args.seed,
                                        per_class=args.per_class, transfer_steps=args.transfer_steps)
    summary = digits_demo.run(out, settings, progress=not args.no_progress)
    print(f"done in {summary['seconds']:.0f}s: {summary['picture']}, {out / 'summary.json'}. "
          f"Next: `mhla-diffusion info {summary['converted_dir']}`")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="convert, fit, reload and score the bundled trained digits DiT (no download)",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--family", choices=[f.name for f in FAMILIES],
                   help="instead, the random-weight tiny pipeline of this family (plumbing, not quality)")
    p.add_argument("--save", metavar="DIR", help="only write a tiny random-weight pipeline (of --family, default dit) to DIR")
    p.add_argument("--out", default="outputs/demo", help="folder for the converted model, demo.png and summary.json")
    p.add_argument("--steps", type=int, default=0, help="denoising steps (0: 20 for the digits demo, 10 with --family)")
    p.add_argument("--per-class", type=int, default=2, help="digits demo: samples per digit in each row")
    p.add_argument("--transfer-steps", type=int, default=150, help="digits demo: attention-transfer steps per layer")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
