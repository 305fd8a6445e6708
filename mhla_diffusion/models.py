"""The MHLA model classes: each supported diffusers transformer class, converted.

`MHLAWanTransformer3DModel` is `WanTransformer3DModel` whose config holds an "mhla" entry and whose
self-attention runs MHLA from construction on. Because the class is defined here, `save_pretrained`
records `["mhla_diffusion", "MHLA..."]` in a pipeline's `model_index.json` and plain diffusers
(`DiffusionPipeline.from_pretrained`, `WanPipeline.from_pretrained`, `MHLA....from_pretrained`) loads it
as MHLA, every weight through diffusers' own loader and its own missing/unexpected-key warnings.
Where mhla_diffusion is not imported, diffusers refuses the component and says to import it.
"""

from __future__ import annotations

import inspect
import logging
import math
import re

import diffusers
import torch
from diffusers import ModelMixin  # noqa: F401  diffusers' loader looks this name up in a custom class's module

from . import conversion
from .config import MHLAConfig
from .families import FAMILIES, self_attentions
from .mixing import initial_logits, resample_logits
from .processors import MHLAProcessorBase

log = logging.getLogger("mhla_diffusion")

PREFIX = "MHLA"
# mixing logits as mhla-diffusion 0.1 saved them: one matrix per block grid seen, keyed by the grid
LEGACY_MIXING = re.compile(r"^(?P<layer>.+\.processor)\.mixing\.logits\.(?P<blocks>\d+x\d+x\d+)$")


class MHLAModelMixin:
    """What the MHLA classes add to their diffusers class; `_mhla_base` is that class."""

    _mhla_base: type

    def _mhla_install(self, mhla: dict | None) -> None:
        """Convert self (just built by the diffusers __init__) with the stored config, or the default."""
        self._mhla_legacy = mhla is not None and "mix_blocks" not in mhla
        config = MHLAConfig.from_dict(mhla) if mhla is not None else conversion.default_config(self)
        config = conversion.resolve_config(self, config)
        conversion.set_attn_processor(self, {**conversion.attn_processors(self), **conversion.build_processors(self, config)})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        check_complete(model, pretrained_model_name_or_path)
        return model

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, resolved_model_file, pretrained_model_name_or_path, loaded_keys,
                               *args, **kwargs):
        """diffusers' loading step (0.42), with a 0.1-format dir's mixing logits migrated first."""
        if model._mhla_legacy:
            if state_dict is None:  # sharded: the migration needs every shard's keys at once
                from safetensors.torch import load_file

                state_dict = {k: v for f in resolved_model_file for k, v in load_file(f).items()}
            migrate_mixing(model, state_dict, pretrained_model_name_or_path)
            loaded_keys = list(state_dict)
            model._mhla_legacy = False
        return super()._load_pretrained_model(model, state_dict, resolved_model_file, pretrained_model_name_or_path,
                                              loaded_keys, *args, **kwargs)

    def save_pretrained(self, *args, **kwargs):
        lora = sorted({k.split(".base_layer.")[0] for k in self.state_dict() if ".base_layer." in k})
        if lora:  # peft renames the wrapped weights: such a dir would load with them missing
            raise ValueError(f"this model carries live peft LoRA layers ({', '.join(lora[:2])}, ...): merge them into the "
                             "weights first (peft's merge_and_unload, or mhla_diffusion.training.model.merge_lora), "
                             "or save the adapter alone with peft's get_peft_model_state_dict")
        conversion.sync_config(self)  # processors replaced one by one (`attn.set_processor`) are seen here
        return super().save_pretrained(*args, **kwargs)


def _set_attn_processor(self, processor):
    self._mhla_base.set_attn_processor(self, processor)
    conversion.sync_config(self)


def _set_default_attn_processor(self):
    self._mhla_base.set_default_attn_processor(self)
    conversion.sync_config(self)


_CLASSES: dict[type, type] = {}


def mhla_class(base: type) -> type:
    """The MHLA model class of a diffusers transformer class (an MHLA class is its own)."""
    if issubclass(base, MHLAModelMixin):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = _make_class(base)
    return _CLASSES[base]


def _make_class(base: type) -> type:
    def __init__(self, *args, mhla: dict | None = None, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._mhla_install(mhla)

    # diffusers reads a model's config keys off its __init__ signature: the base's, plus "mhla"
    sig = inspect.signature(base.__init__)
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    params.append(inspect.Parameter("mhla", inspect.Parameter.KEYWORD_ONLY, default=None))
    params += [p for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD]
    __init__.__signature__ = sig.replace(parameters=params)
    namespace = {"__init__": __init__, "__module__": "mhla_diffusion", "_mhla_base": base,
                 "__doc__": f"`{base.__name__}` converted to MHLA (mhla_diffusion.models)."}
    if hasattr(base, "set_attn_processor"):
        namespace["set_attn_processor"] = _set_attn_processor
    if hasattr(base, "set_default_attn_processor"):
        namespace["set_default_attn_processor"] = _set_default_attn_processor
    name = PREFIX + base.__name__
    cls = type(name, (MHLAModelMixin, base), namespace)
    cls.__qualname__ = name
    return cls


def class_named(name: str) -> type:
    """An MHLA class by name ("MHLAWanTransformer3DModel"), or the class of a stored `_class_name`."""
    base_name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if not any(base_name in fam.class_names for fam in FAMILIES):
        raise AttributeError(f"no MHLA model class {name!r}; supported: {', '.join(PREFIX + c for f in FAMILIES for c in f.class_names)}")
    return mhla_class(getattr(diffusers, base_name))


def check_complete(model, where) -> None:
    """Refuse a model with weights that were never loaded (diffusers leaves them on the meta device)."""
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if not missing:
        return
    mhla = [n for n in missing if ".processor." in n]
    layers = sorted({n.split(".processor.")[0] for n in mhla})
    what = f"MHLA weights of {', '.join(layers[:3])}" if mhla else ", ".join(missing[:3])
    raise ValueError(f"{where}: the checkpoint lacks {len(missing)} weights ({what}{', ...' if len(missing) > 3 else ''}); "
                     "it is incomplete: restore the missing files or convert the original model again")


def migrate_mixing(model, state_dict: dict, where) -> None:
    """Turn 0.1-format mixing logits (one matrix per block grid) into the one matrix per layer that
    lives on `mix_blocks`: the saved matrix of that grid, else the largest saved one resampled to it,
    else the init (a grid never run had none saved). Says so in one line."""
    saved: dict[str, dict] = {}
    for m in [LEGACY_MIXING.match(k) for k in list(state_dict)]:
        if m:
            blocks = tuple(int(n) for n in m["blocks"].split("x"))
            saved.setdefault(m["layer"], {})[blocks] = state_dict.pop(m.string)
    names = {id(m): n for n, m in model.named_modules()}
    how = set()
    for attn in self_attentions(model):
        proc = attn.processor
        if not isinstance(proc, MHLAProcessorBase):
            continue
        layer, target = f"{names[id(attn)]}.processor", proc.mixing.mix_blocks
        found = saved.get(layer, {})
        if target in found:
            logits, what = found[target], "kept"
        elif found:
            src = max(found, key=math.prod)
            logits, what = resample_logits(found[src], src, target), f"resampled from {'x'.join(map(str, src))}"
        else:
            logits, what = initial_logits(target, proc.config.mix_init), "initialised (none saved)"
        state_dict[f"{layer}.mixing.logits"] = logits.to(torch.float32)
        how.add(what)
    log.warning("%s: MHLA mixing logits in the 0.1 format (one matrix per block grid) migrated to one matrix per layer "
                "on block grid %s (%s); save_pretrained again to store the new format", where,
                "x".join(map(str, model.config[conversion.CONFIG_KEY]["mix_blocks"])),
                ", ".join(sorted(how)) or "no converted layer")
