"""`mhla-diffusion info DIR`: what a diffusers dir holds, what of it is converted, and whether it loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..config import MHLAConfig
from ..conversion import CONFIG_KEY
from ..families import SUPPORTED, family_by_name
from ..models import LEGACY_MIXING, PREFIX
from ..persistence import checkpoint_kind, read_json, tensor_headers


def weights(model_dir: Path) -> dict:
    """Shape and dtype of every tensor of a model dir (headers only); none at all is an error."""
    found = tensor_headers(model_dir)
    if not found:
        raise ValueError(f"{model_dir} holds no .safetensors weights: the dir is incomplete")
    return found


def attention_paths(cfg: dict) -> list[str]:
    """The self-attention module paths of the model a config.json describes (its family knows them)."""
    return family_by_name(cfg["_class_name"].removeprefix(PREFIX)).self_attention_paths(cfg)


def expected_mhla(cfg: dict, config: MHLAConfig) -> dict:
    """The MHLA tensors a converted model of this config.json must hold: key -> shape (None: any)."""
    paths = attention_paths(cfg)
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    m = math.prod(config.mix_blocks) if config.mix_blocks else None
    keys = {}
    for i in config.converted_layers(len(paths)):
        proc = f"{paths[i]}.processor"
        keys[f"{proc}.mixing.logits"] = (m, m) if m else None
        if config.output_norm:
            keys[f"{proc}.norm_gain"] = (heads, head_dim)
        if config.output_gate:
            keys[f"{proc}.gate.weight"] = keys[f"{proc}.gate.bias"] = None
    return keys


def describe_model(model_dir: Path, listed_class: str | None = None) -> dict:
    """Facts about one model dir, checked as loading would check them (no model is built)."""
    cfg = read_json(model_dir / "config.json")
    name = cfg.get("_class_name", "")
    if name.removeprefix(PREFIX) not in SUPPORTED.split(", "):
        raise ValueError(f"{model_dir}: unsupported model class {name}; supported: {SUPPORTED}")
    tensors = weights(model_dir)
    info = {"class": name, "parameters": sum(math.prod(s) for s, _ in tensors.values()),
            "dtypes": sorted({d for _, d in tensors.values()}), "converted": CONFIG_KEY in cfg}
    if not info["converted"]:
        return info
    config = MHLAConfig.from_dict(cfg[CONFIG_KEY])
    info["mhla"] = config.to_dict()
    info["converted_layers"] = config.converted_layers(len(attention_paths(cfg)))
    legacy = {k for k in tensors if LEGACY_MIXING.match(k)}
    notes = []
    if config.mix_blocks is None:  # 0.1 format: logits per block grid, migrated when loaded
        notes.append("saved in the 0.1 format (one mixing matrix per block grid): loading migrates it to one matrix "
                     "per layer; re-save it (`mhla-diffusion convert DIR NEW_DIR`) to store the new format")
    elif listed_class is not None and not listed_class.startswith(PREFIX):
        notes.append(f"model_index.json lists {listed_class}: plain diffusers would load softmax attention; "
                     "mhla_diffusion.from_pretrained loads MHLA, and re-saving it updates model_index.json")
    expected = expected_mhla(cfg, config)
    missing = [k for k in expected if k not in tensors and not (k.endswith(".mixing.logits") and config.mix_blocks is None)]
    wrong = [k for k, shape in expected.items() if k in tensors and shape and tensors[k][0] != shape]
    if missing or wrong:
        bad = sorted({k.split(".processor.")[0] for k in missing + wrong})
        raise ValueError(f"{model_dir}: MHLA weights {'missing' if missing else 'of the wrong shape'} for "
                         f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''} ({len(missing)} missing, {len(wrong)} "
                         "mis-shaped): this dir would not load; restore it or convert the original model again")
    mixing = {}
    for key in sorted(k for k in tensors if k.endswith(".mixing.logits") or k in legacy):
        grid = key.rsplit(".", 1)[1] if key in legacy else "x".join(map(str, config.mix_blocks))
        mixing.setdefault(key.split(".processor.")[0], []).append(f"{grid} (M={tensors[key][0][0]})")
    info.update(mhla_layers=mixing, notes=notes)
    return info


def describe(path) -> dict:
    """Facts about a checkpoint dir, read from its files (no model is built); errors where it would not load."""
    path = Path(path)
    kind = checkpoint_kind(path)
    info = {"path": str(path), "kind": kind, "models": {}}
    if kind == "transformer":
        info["models"]["transformer"] = describe_model(path)
        return info
    index = read_json(path / "model_index.json")
    info["pipeline"] = index.get("_class_name")
    info["components"] = sorted(k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None)
    for name in info["components"]:
        cfg_file = path / name / "config.json"
        if cfg_file.is_file() and read_json(cfg_file).get("_class_name", "").removeprefix(PREFIX) in SUPPORTED.split(", "):
            info["models"][name] = describe_model(path / name, listed_class=index[name][1])
    if not info["models"]:
        raise ValueError(f"{path}: no supported transformer among its components ({', '.join(info['components'])}); supported: {SUPPORTED}")
    return info


def run(args) -> int:
    info = describe(Path(args.dir))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}: diffusers {info['kind']}" + (f" {info['pipeline']}" if "pipeline" in info else ""))
    if "components" in info:
        print(f"  components: {', '.join(info['components'])}")
    for name, m in info["models"].items():
        print(f"  {name}: {m['class']}, {m['parameters'] / 1e6:.2f}M parameters, dtype {'/'.join(m['dtypes'])}")
        if not m["converted"]:
            print("    MHLA: not converted (run `mhla-diffusion convert`)")
            continue
        c = m["mhla"]
        print(f"    MHLA: blocks={c['blocks']} mix_blocks={c['mix_blocks']} layers={c['layers']} feature={c['feature']} "
              f"normalize={c['normalize']} output_norm={c['output_norm']} output_gate={c['output_gate']} mix_init={c['mix_init']}")
        layers = m["converted_layers"]
        print(f"    converted self-attention layers ({len(layers)}): {layers}")
        for layer, mix in m["mhla_layers"].items():
            print(f"      {layer}: mixing {', '.join(mix)}")
        for note in m["notes"]:
            print(f"    note: {note}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("info", help="what a diffusers dir holds and whether it loads; exit 2 where it would not")
    p.add_argument("dir", metavar="DIR", help="a diffusers pipeline or transformer dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
