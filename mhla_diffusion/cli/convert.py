"""`mhla-diffusion convert SRC DST`: convert a checkpoint and save it with save_pretrained."""

from __future__ import annotations

import argparse
import time

from ..config import MIX_INITS
from ..reference import FEATURE_MAPS


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """MHLAConfig fields as options; unset ones keep the model family's released variant."""
    g = parser.add_argument_group("MHLA (defaults: the model family's released variant)")
    g.add_argument("--blocks", help="block grid 'bt,bh,bw' (or 'bh,bw' for images), or 'auto' (default)")
    g.add_argument("--layers", help="'all' (default), 'hybrid:K' (every K-th layer keeps softmax), or indices '0,2,5'")
    g.add_argument("--feature", choices=sorted(FEATURE_MAPS), help="feature map (default relu)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None, help="divide by phi(q).z (default: on; off for Wan)")
    g.add_argument("--output-norm", action=argparse.BooleanOptionalAction, default=None, help="per-head RMSNorm on the output (default: Wan only)")
    g.add_argument("--output-gate", action=argparse.BooleanOptionalAction, default=None, help="SiLU output gate (default off)")
    g.add_argument("--mix-init", choices=MIX_INITS, help="mixing-matrix init (default locality)")


def config_overrides(args) -> dict:
    names = ("blocks", "layers", "feature", "normalize", "output_norm", "output_gate", "mix_init")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def run(args) -> int:
    from ..conversion import convert, default_config, mhla_modules
    from ..persistence import load

    t0 = time.perf_counter()
    obj = load(args.src, torch_dtype=args.dtype)
    transformer = getattr(obj, "transformer", obj)
    config = default_config(transformer, **config_overrides(args))
    convert(transformer, config)
    obj.save_pretrained(args.dst)
    n = len(mhla_modules(transformer))
    print(f"converted {type(transformer).__name__}: {n} self-attention layers to MHLA "
          f"(blocks={config.blocks}, layers={config.layers}) -> {args.dst} in {time.perf_counter() - t0:.1f}s")
    return 0


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a diffusers pipeline or transformer to MHLA and save it",
                       description="SRC: a local diffusers pipeline or transformer dir, or a hub id when online.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="load and save in this dtype (default: as stored)")
    add_config_args(p)
    p.set_defaults(func=run)
