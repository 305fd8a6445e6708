"""`mhla-diffusion transfer SRC DST`: convert without a dataset, each layer fitted to its softmax original."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from .convert import add_config_args, config_overrides
from .main import counted
from .eval import _sampling_args, _settings


def write_report(fits, path: Path) -> None:
    """transfer.json (per layer: relative error before and after, loss curve) and tensorboard curves."""
    from torch.utils.tensorboard import SummaryWriter

    rows = [{"layer": f.name, "before": f.before, "after": f.after, "curve": f.curve} for f in fits]
    (path / "transfer.json").write_text(json.dumps(rows, indent=1))
    with SummaryWriter(str(path / "transfer_logs")) as writer:
        for f in fits:
            for step, loss in enumerate(f.curve):
                writer.add_scalar(f"transfer/{f.name}", loss, step)


def fit_table(fits) -> str:
    """Which layers fit well and which did not: the table to choose `--layers` or `--keep-softmax-worst` by."""
    rank = {f.name: i + 1 for i, f in enumerate(sorted(fits, key=lambda f: f.after))}
    lines = ["| layer | rel. error after conversion | after transfer | rank (1 = best fit) |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {f.name} | {f.before:.4g} | {f.after:.4g} | {rank[f.name]} |" for f in fits])


def run(args) -> int:
    from ..conversion import converted_indices, default_config, is_converted, transformers_of
    from ..persistence import checkpoint_kind, is_hub_id, load, save_atomically
    from ..evaluation.sampling import generate
    from ..transfer import transfer

    if not is_hub_id(args.src) and checkpoint_kind(args.src) != "pipeline":
        raise ValueError(f"{args.src} is a transformer dir; transfer samples the original model, so it needs its pipeline dir")
    if args.num_samples < 1 or args.keep_calls < 1 or args.steps_per_layer < 0 or args.layers_per_pass < 0:
        raise ValueError("--num-samples and --keep-calls must be >= 1, --steps-per-layer and --layers-per-pass >= 0")
    t0 = time.perf_counter()
    pipe = load(args.src, torch_dtype=args.dtype)
    models = transformers_of(pipe)
    if any(is_converted(m) for m in models.values()):
        raise ValueError(f"{args.src} is already converted to MHLA: the teacher must be the original model")
    pipe.set_progress_bar_config(disable=True)
    config = default_config(next(iter(models.values())), **config_overrides(args))
    settings = _settings(args, args.guidance_scale)

    def run_teacher():
        for start in tqdm(range(0, args.num_samples, args.batch_size), desc="teacher trajectories", leave=False):
            generate(pipe, range(start, min(start + args.batch_size, args.num_samples)), settings)

    fits = transfer(pipe, config, run_teacher, args.keep_calls, args.steps_per_layer, args.lr, args.projection_lr,
                    args.keep_softmax_worst, args.layers_per_pass, seed=args.seed)

    def save(path):
        pipe.save_pretrained(path)
        write_report(fits, Path(path))

    save_atomically(save, args.dst, overwrite=args.overwrite)
    print(fit_table(fits))
    for name, m in models.items():
        n = len(converted_indices(m))
        print(f"{name}: {counted(n, 'self-attention layer')} MHLA (layers={m.config['mhla']['layers']})")
    print(f"-> {args.dst} (report: transfer.json, tensorboard: transfer_logs/) in {time.perf_counter() - t0:.1f}s")
    return 0


def register(sub) -> None:
    p = sub.add_parser("transfer", help="convert without data: fit each MHLA layer to its softmax original on the "
                                        "original model's own samples",
                       description="The original pipeline samples; each converted layer's MHLA parameters are fitted "
                                   "to reproduce that layer's softmax outputs on those calls, layer by layer.")
    p.add_argument("src", metavar="SRC", help="the original (unconverted) pipeline dir or hub id")
    p.add_argument("dst", metavar="DST", help="new dir to write, loadable like any converted dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST whole")
    p.add_argument("--num-samples", type=int, default=8, help="teacher samples whose calls are recorded")
    p.add_argument("--batch-size", type=int, default=4, help="samples per pipeline call")
    p.add_argument("--keep-calls", type=int, default=16, help="recorded calls kept per layer (a uniform sample of all)")
    p.add_argument("--layers-per-pass", type=int, default=0,
                   help="record this many layers per sampling pass, to bound memory (0: all layers in one pass); "
                        "calls are kept on the CPU: about keep-calls x 2 x tokens x width x bytes per layer")
    p.add_argument("--steps-per-layer", type=int, default=200, help="optimizer steps per layer")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate of the MHLA parameters")
    p.add_argument("--projection-lr", type=float, default=None,
                   help="also fit the layer's q/k/v/out projections at this learning rate (default: MHLA parameters only)")
    p.add_argument("--keep-softmax-worst", type=int, default=0, metavar="K",
                   help="the K layers that fit worst keep softmax attention (a data-driven hybrid)")
    p.add_argument("--guidance-scale", type=float, help="CFG scale of the teacher's sampling (default: the pipeline's)")
    add_config_args(p)
    _sampling_args(p, steps=10)
    p.set_defaults(func=run)
