"""`mhla-diffusion convert SRC DST`: convert a checkpoint and save it with save_pretrained."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..config import MIX_INITS
from ..persistence import DTYPE_NAMES
from ..ops.feature_maps import FEATURE_MAPS
from .main import counted


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """MHLAConfig fields as options; unset ones keep the model family's released variant."""
    g = parser.add_argument_group("MHLA (defaults: the model family's released variant)")
    g.add_argument("--blocks", help="block grid 'bt,bh,bw' (or 'bh,bw' for images), or 'auto' (default)")
    g.add_argument("--layers", help="'all' (default), 'hybrid:K' (every K-th layer keeps softmax), or indices '0,2,5'")
    g.add_argument("--feature", choices=sorted(FEATURE_MAPS), help="feature map (default relu)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None, help="divide by phi(q).z (default: on; off for Wan and its relatives)")
    g.add_argument("--output-norm", action=argparse.BooleanOptionalAction, default=None, help="per-head RMSNorm on the output (default: Wan and its relatives only)")
    g.add_argument("--output-gate", action=argparse.BooleanOptionalAction, default=None, help="SiLU output gate (default off)")
    g.add_argument("--mix-init", choices=MIX_INITS, help="mixing-matrix init (default locality)")


def config_overrides(args) -> dict:
    names = ("blocks", "layers", "feature", "normalize", "output_norm", "output_gate", "mix_init")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def run(args) -> int:
    """Convert SRC (every transformer of a pipeline), or re-save an already converted SRC as it is,
    into DST atomically."""
    from ..conversion import convert, converted_indices, default_config, is_converted, transformers_of
    from ..persistence import checkpoint_kind, is_hub_id, load, save_atomically

    if not is_hub_id(args.src):
        checkpoint_kind(args.src)  # a clear error for a dir that is no diffusers dir, before anything else
        src, dst = Path(args.src).resolve(), Path(args.dst).resolve()
        if dst == src or src in dst.parents:
            raise ValueError(f"DST {args.dst} is SRC or inside it; write the converted model to a new dir")
    t0 = time.perf_counter()
    obj = load(args.src, torch_dtype=args.dtype)
    models = transformers_of(obj)
    overrides = config_overrides(args)
    if any(is_converted(m) for m in models.values()):
        if overrides:
            raise ValueError(f"{args.src} is already converted to MHLA; converting it again would throw away its MHLA "
                             f"weights ({', '.join('--' + k.replace('_', '-') for k in overrides)} given): convert the "
                             "original model, or drop the MHLA options to re-save it as it is (e.g. with --dtype)")
        done = "re-saved (already MHLA, weights and config kept)"
    else:
        convert(obj, default_config(next(iter(models.values())), **overrides))
        done = "converted to MHLA"
    save_atomically(obj.save_pretrained, args.dst, overwrite=args.overwrite)
    for name, model in models.items():
        layers = converted_indices(model)
        cfg = model.config["mhla"]
        print(f"{name or 'transformer'} ({type(model).__name__}): {counted(len(layers), 'self-attention layer')} {done} "
              f"(blocks={cfg['blocks']}, layers={cfg['layers']})")
    print(f"-> {args.dst} in {time.perf_counter() - t0:.1f}s")
    return 0


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a diffusers pipeline or transformer to MHLA and save it",
                       description="SRC: a local diffusers pipeline or transformer dir, or a hub id when online.")
    p.add_argument("src", metavar="SRC", help="diffusers pipeline or transformer dir (or hub id); a converted SRC is re-saved as it is")
    p.add_argument("dst", metavar="DST", help="new dir to write (written atomically; an existing one needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST whole")
    p.add_argument("--dtype", choices=DTYPE_NAMES, metavar="DTYPE", help="load and save in this dtype: bf16 (bfloat16), fp16 (float16) or fp32 (float32); default: as stored")
    add_config_args(p)
    p.set_defaults(func=run)
