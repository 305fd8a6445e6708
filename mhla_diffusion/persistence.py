"""Load diffusers checkpoints (original or converted) and restore MHLA from `save_pretrained` dirs.

Plain diffusers `from_pretrained` rebuilds the default processors and drops the `processor.*`
weights; here the model is built, converted with the stored MHLAConfig, then those weights load.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from .config import MHLAConfig
from .conversion import CONFIG_KEY, convert, mhla_modules

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(name):
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of fp32, fp16, bf16") from None


@contextlib.contextmanager
def _quiet_diffusers():
    """Silence diffusers' 'weights not used' warning for the processor weights we load ourselves."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def checkpoint_kind(path) -> str:
    """'pipeline' or 'transformer' for a local diffusers dir; errors say what is wrong."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory; expected a diffusers pipeline or transformer dir")
    if (path / "model_index.json").is_file():
        return "pipeline"
    if (path / "config.json").is_file() and "_class_name" in json.loads((path / "config.json").read_text()):
        return "transformer"
    raise ValueError(f"{path} is not a diffusers dir: no model_index.json (pipeline) or config.json with _class_name (model)")


def transformer_dir(path) -> Path:
    path = Path(path)
    return path / "transformer" if checkpoint_kind(path) == "pipeline" else path


def stored_config(path) -> MHLAConfig | None:
    """The MHLAConfig saved with a transformer (or pipeline) dir, None if it is not converted."""
    cfg_file = transformer_dir(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no transformer/config.json: this pipeline has no transformer")
    stored = json.loads(cfg_file.read_text()).get(CONFIG_KEY)
    return None if stored is None else MHLAConfig.from_dict(stored)


def load(src, torch_dtype=None, **kwargs):
    """A pipeline or transformer from a local dir or a hub id, exactly as diffusers loads it."""
    import diffusers

    torch_dtype = parse_dtype(torch_dtype)
    path = Path(src)
    if path.exists():
        kind = checkpoint_kind(path)
    elif str(src).count("/") == 1 and not str(src).startswith((".", "/", "~")):
        kind = "pipeline"  # a hub id: diffusers downloads it when online
    else:
        raise FileNotFoundError(f"{src} does not exist (expected a local diffusers dir or a hub id 'org/name')")
    with _quiet_diffusers():
        if kind == "pipeline":
            return diffusers.DiffusionPipeline.from_pretrained(src, dtype=torch_dtype, **kwargs)
        class_name = json.loads((path / "config.json").read_text())["_class_name"]
        cls = getattr(diffusers, class_name, None)
        if cls is None:
            raise ValueError(f"{path}: model class {class_name} is not in this diffusers version")
        return cls.from_pretrained(path, dtype=torch_dtype, **kwargs)


def _processor_state(tdir: Path) -> dict:
    """The `processor.` tensors of a saved transformer (single file or sharded safetensors)."""
    from safetensors.torch import load_file

    files = sorted(tdir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{tdir} holds no .safetensors weights (save with safe_serialization=True)")
    state = {}
    for f in files:
        state.update({k: v for k, v in load_file(str(f)).items() if ".processor." in k})
    return state


def restore(transformer, path, config: MHLAConfig):
    """Convert a freshly loaded transformer with its stored `config` and load the MHLA weights of `path`."""
    convert(transformer, config)
    state = _processor_state(transformer_dir(path))
    modules = mhla_modules(transformer)
    for key in state:  # matrices of block grids chosen by blocks="auto" are created on demand
        owner, _, rest = key.partition(".mixing.logits.")
        if rest and owner in modules:
            modules[owner].mixing.add(tuple(int(n) for n in rest.split("x")))
    own = {k for k in transformer.state_dict() if ".processor." in k}
    if own != set(state):
        raise ValueError(f"{path}: MHLA weights do not match the stored config (missing {sorted(own - set(state))[:3]}, unexpected {sorted(set(state) - own)[:3]})")
    transformer.load_state_dict(state, strict=False)  # copies cast to each parameter's dtype
    return transformer


def from_pretrained(path, torch_dtype=None, **kwargs):
    """Load a converted transformer or pipeline saved with `save_pretrained`, MHLA restored."""
    config = stored_config(path)
    if config is None:
        raise ValueError(f"{path} is not converted to MHLA (no '{CONFIG_KEY}' in its transformer config.json); convert it first with mhla_diffusion.convert or `mhla-diffusion convert`")
    obj = load(path, torch_dtype=torch_dtype, **kwargs)
    restore(getattr(obj, "transformer", obj), path, config)
    return obj
