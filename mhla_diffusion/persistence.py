"""Load diffusers checkpoints, original or converted, and read what a checkpoint dir holds.

A converted dir names its MHLA model classes in `model_index.json` (or `_class_name`), so diffusers
itself loads it as MHLA (`models.py`). `from_pretrained` here adds what a user should not have to
repeat: the dtype the dir was saved in, and dirs saved before those classes existed (their
`model_index.json` names the diffusers class: the converted components are passed in explicitly).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from .config import MHLAConfig
from .conversion import CONFIG_KEY
from .interrupts import terminate_as_interrupt

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = sorted(DTYPES)  # what --dtype accepts
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def parse_dtype(name):
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}") from None


def dtype_name(dtype) -> str | None:
    """"bfloat16" for torch.bfloat16, None for None: what a JSON report says."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def read_json(path: Path) -> dict:
    """A JSON file; a broken one is named in the error."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it from a good copy") from None


def checkpoint_kind(path) -> str:
    """'pipeline' or 'transformer' for a local diffusers dir; errors say what is wrong."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory; expected a diffusers pipeline or transformer dir")
    if (path / "model_index.json").is_file():
        return "pipeline"
    if (path / "config.json").is_file() and "_class_name" in read_json(path / "config.json"):
        return "transformer"
    raise ValueError(f"{path} is not a diffusers dir: no model_index.json (pipeline) or config.json with _class_name (model)")


def transformer_dir(path) -> Path:
    path = Path(path)
    return path / "transformer" if checkpoint_kind(path) == "pipeline" else path


def converted_components(path) -> dict[str, dict]:
    """Config of each converted model in a dir, by subfolder ("" for a transformer dir)."""
    path = Path(path)
    if checkpoint_kind(path) == "transformer":
        cfg = read_json(path / "config.json")
        return {"": cfg} if CONFIG_KEY in cfg else {}
    index = read_json(path / "model_index.json")
    found = {}
    for name, entry in index.items():
        cfg_file = path / name / "config.json"
        if not name.startswith("_") and isinstance(entry, list) and cfg_file.is_file():
            cfg = read_json(cfg_file)
            if CONFIG_KEY in cfg:
                found[name] = cfg
    return found


def stored_config(path) -> MHLAConfig | None:
    """The MHLAConfig saved with a transformer (or pipeline) dir, None if it is not converted."""
    cfg_file = transformer_dir(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no transformer/config.json: this pipeline has no transformer")
    stored = read_json(cfg_file).get(CONFIG_KEY)
    return None if stored is None else MHLAConfig.from_dict(stored)


def saved_dtype(model_dir) -> torch.dtype | None:
    """The dtype a model dir's weights were saved in (its first floating-point tensor's)."""
    for key, (_, dtype) in tensor_headers(model_dir).items():
        if dtype in SAFETENSORS_DTYPES and ".processor." not in key:
            return SAFETENSORS_DTYPES[dtype]
    return None


def tensor_headers(model_dir) -> dict:
    """Shape and dtype of every tensor in a model dir's safetensors files, read from their headers;
    a damaged file is named in the error."""
    from safetensors import SafetensorError, safe_open

    found = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    found[key] = (tuple(sl.get_shape()), sl.get_dtype())
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{f} is not a readable safetensors file ({err}); restore it from a good copy") from None
    return found


@contextlib.contextmanager
def _damaged_files_named(path: Path):
    """diffusers' loaders re-raise safetensors' header errors without the file: find and name it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as err:
        for model_dir in {f.parent for f in path.rglob("*.safetensors")}:
            tensor_headers(model_dir)  # raises, naming the damaged file
        raise ValueError(f"{path}: a weights file could not be read ({err})") from None


def is_hub_id(src) -> bool:
    return str(src).count("/") == 1 and not str(src).startswith((".", "/", "~")) and not Path(src).exists()


def load(src, torch_dtype=None, **kwargs):
    """A pipeline or transformer from a local dir or a hub id, as diffusers loads it; a converted
    dir comes back converted (see `from_pretrained`)."""
    import diffusers

    from .models import check_complete

    torch_dtype = parse_dtype(torch_dtype)
    path = Path(src)
    if is_hub_id(src):
        try:
            obj = diffusers.DiffusionPipeline.from_pretrained(src, dtype=torch_dtype, **kwargs)
        except OSError as err:  # diffusers' offline message points at a stack trace the user does not see
            raise OSError(f"could not load {src} from the Hugging Face hub ({str(err).splitlines()[0]}); "
                          "check the network, or pass a local diffusers dir") from None
    elif not path.exists():
        raise FileNotFoundError(f"{src} does not exist (expected a local diffusers dir or a hub id 'org/name')")
    elif converted_components(path):
        return from_pretrained(path, torch_dtype=torch_dtype, **kwargs)
    elif checkpoint_kind(path) == "pipeline":
        with _damaged_files_named(path):
            obj = diffusers.DiffusionPipeline.from_pretrained(src, dtype=torch_dtype, **kwargs)
    else:
        class_name = read_json(path / "config.json")["_class_name"]
        cls = getattr(diffusers, class_name, None)
        if cls is None:
            raise ValueError(f"{path}: model class {class_name} is not in this diffusers version")
        with _damaged_files_named(path):
            obj = cls.from_pretrained(path, dtype=torch_dtype, **kwargs)
    for name, model in getattr(obj, "components", {"": obj}).items():
        if isinstance(model, torch.nn.Module):
            check_complete(model, path / name)
    return obj


def from_pretrained(path, torch_dtype=None, **kwargs):
    """Load a converted transformer or pipeline saved with `save_pretrained`, MHLA restored.

    torch_dtype: None loads every component in the dtype the transformer was saved in.
    """
    from .models import class_named

    path = Path(path)
    converted = converted_components(path)
    if not converted:
        raise ValueError(f"{path} is not converted to MHLA (no '{CONFIG_KEY}' in its transformer config.json); convert it "
                         "first with mhla_diffusion.convert or `mhla-diffusion convert`")
    with _damaged_files_named(path):
        dtype = parse_dtype(torch_dtype) or saved_dtype(path / next(iter(converted)))
        models = {name: class_named(cfg["_class_name"]).from_pretrained(path / name, dtype=dtype)
                  for name, cfg in converted.items() if name not in kwargs}  # components passed in are not loaded
        if "" in models:
            return models[""]
        import diffusers

        return diffusers.DiffusionPipeline.from_pretrained(path, dtype=dtype, **{**models, **kwargs})


def save_atomically(save, dst, overwrite: bool = False) -> None:
    """Run `save(dir)` into a temporary dir beside `dst`, then rename it into place.

    `dst` is either its old self or complete: an exception, Ctrl-C or SIGTERM leave it as it was and
    nothing behind; a kill -9 leaves `.<name>.mhla-partial` (and, mid-rename, `.<name>.mhla-replaced`),
    which the next call cleans up first (restoring a replaced `dst`). An existing `dst` is refused
    unless `overwrite`, and then replaced whole, never merged into.
    """
    from safetensors import SafetensorError

    dst = Path(dst).absolute()
    partial, replaced = (dst.parent / f".{dst.name}.mhla-{what}" for what in ("partial", "replaced"))
    if replaced.exists() and not dst.exists():  # a killed rename: put the old dst back
        os.replace(replaced, dst)
    for stale in (partial, replaced):
        if stale.exists():
            shutil.rmtree(stale)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass --overwrite to replace it (the whole dir), or choose another DST")
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with terminate_as_interrupt():
            try:
                save(partial)
            except SafetensorError as err:  # e.g. a full disk, raised by safetensors' writer
                raise OSError(f"writing {dst} failed: {err}") from None
            if dst.exists():
                os.replace(dst, replaced)
            os.replace(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if replaced.exists() and not dst.exists():
            os.replace(replaced, dst)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
