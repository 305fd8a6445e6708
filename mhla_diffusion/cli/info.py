"""`mhla-diffusion info DIR`: what a diffusers dir holds and what of it is converted."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..families import SUPPORTED
from ..persistence import checkpoint_kind, stored_config, transformer_dir


def describe(path) -> dict:
    """Facts about a checkpoint dir, read from its files (no model is built)."""
    from safetensors import safe_open

    path = Path(path)
    kind = checkpoint_kind(path)
    tdir = transformer_dir(path)
    info = {"path": str(path), "kind": kind}
    if kind == "pipeline":
        index = json.loads((path / "model_index.json").read_text())
        info["pipeline"] = index.get("_class_name")
        info["components"] = sorted(k for k, v in index.items() if not k.startswith("_") and v and v[0] is not None)
    cfg = json.loads((tdir / "config.json").read_text())
    info["transformer"] = cfg.get("_class_name")
    if info["transformer"] not in SUPPORTED.split(", "):
        raise ValueError(f"{tdir}: unsupported model class {info['transformer']}; supported: {SUPPORTED}")
    config = stored_config(path)
    info["converted"] = config is not None
    if config is not None:
        info["mhla"] = config.to_dict()
    params, mixing, dtypes = 0, {}, set()
    if config is not None:
        layers = config.converted_layers(cfg["num_layers"])
        info["converted_layers"] = layers
    for f in sorted(tdir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                shape = sl.get_shape()
                params += math.prod(shape)
                dtypes.add(sl.get_dtype())
                if ".mixing.logits." in key:
                    mixing.setdefault(key.split(".processor.")[0], []).append(f"{key.rsplit('.', 1)[1]} (M={shape[0]})")
    info.update(parameters=params, dtypes=sorted(dtypes), mhla_layers=mixing)
    return info


def run(args) -> int:
    info = describe(Path(args.dir))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}: diffusers {info['kind']}" + (f" {info['pipeline']}" if "pipeline" in info else ""))
    if "components" in info:
        print(f"  components: {', '.join(info['components'])}")
    print(f"  transformer: {info['transformer']}, {info['parameters'] / 1e6:.2f}M parameters, dtype {'/'.join(info['dtypes'])}")
    if not info["converted"]:
        print("  MHLA: not converted (run `mhla-diffusion convert`)")
        return 0
    m = info["mhla"]
    print(f"  MHLA: blocks={m['blocks']} layers={m['layers']} feature={m['feature']} normalize={m['normalize']} "
          f"output_norm={m['output_norm']} output_gate={m['output_gate']} mix_init={m['mix_init']}")
    print(f"  converted self-attention layers ({len(info['converted_layers'])}): {info['converted_layers']}")
    for layer, mix in info["mhla_layers"].items():
        print(f"    {layer}: mixing {', '.join(mix)}")
    if not info["mhla_layers"]:
        print("    mixing matrices: created at the first forward (blocks='auto', no native resolution)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("info", help="show what a diffusers dir holds and what is converted")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
