"""Turn a diffusers transformer's self-attention into MHLA, in place.

A converted transformer is an instance of its MHLA model class (`models.py`): the diffusers class
it was, extended so that its config, `save_pretrained` and diffusers' loaders know it is MHLA.
Everything it will ever train exists when conversion returns.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .blocks import auto_blocks, check_blocks
from .config import MHLAConfig
from .families import default_grid, family_of, self_attentions, token_grid
from .ops.rope import share_rope_tables
from .processors import MHLAProcessorBase, TokenGrid

CONFIG_KEY = "mhla"  # key of the MHLAConfig in the transformer's config.json


def default_config(transformer, **overrides) -> MHLAConfig:
    """The released variant for this model family, with `overrides` applied."""
    return MHLAConfig(**{**family_of(transformer).defaults, **overrides})


def attn_processors(transformer) -> dict:
    """Processors by module path, also for models without `attn_processors` (DiT)."""
    return {f"{name}.processor": m.get_processor() for name, m in transformer.named_modules() if hasattr(m, "get_processor")}


def set_attn_processor(transformer, processors: dict) -> None:
    """`transformer.set_attn_processor(dict)` for every model, DiT included (which lacks it)."""
    modules = {f"{name}.processor": m for name, m in transformer.named_modules() if hasattr(m, "set_processor")}
    missing, extra = modules.keys() - processors.keys(), processors.keys() - modules.keys()
    if missing or extra:
        raise ValueError(f"processor dict does not match the model's attention layers (missing {sorted(missing)}, unknown {sorted(extra)})")
    for key, module in modules.items():
        module.set_processor(processors[key])
    sync_config(transformer)


def resolve_config(transformer, config: MHLAConfig) -> MHLAConfig:
    """`config` checked against the model's default size, with the mixing logits' block grid set.

    Fixed blocks must fit the default size's token grid (the family's `default_grid`: image models'
    sample_size, Wan's 480p x 81 frames, ...); the logits live on the fixed grid, or on the "auto" grid of that size.
    """
    grid, size = default_grid(transformer)
    where = f"of {family_of(transformer).class_of(transformer)} at {size}"
    if config.blocks != "auto":
        check_blocks(grid, config.blocks, where)
    mix_blocks = config.mix_blocks or (auto_blocks(grid) if config.blocks == "auto" else config.blocks)
    check_blocks(grid, mix_blocks, where)
    return replace(config, mix_blocks=mix_blocks)


def publish_grid(module, args, kwargs) -> None:
    """Forward pre-hook: tell the processors the token grid of this call (models pass none).

    A module-level function reading the grid off the module, so a deepcopy or an unpickled copy of
    the model publishes to its own processors.
    """
    hidden_states = args[0] if args else kwargs["hidden_states"]
    module._mhla_token_grid.grid = token_grid(module, hidden_states)


def build_processors(transformer, config: MHLAConfig) -> dict:
    """MHLA processors for the layers `config` converts, by module path; makes `transformer` an
    instance of its MHLA model class, with the grid hook and `config` in its config."""
    from .models import mhla_class

    family = family_of(transformer)
    attns = self_attentions(transformer)
    layers = config.converted_layers(len(attns))  # checks the indices before anything changes
    transformer.__class__ = mhla_class(type(transformer))
    if getattr(transformer, "_mhla_token_grid", None) is None:
        transformer._mhla_token_grid = TokenGrid()
        transformer.register_forward_pre_hook(publish_grid, with_kwargs=True)
        rope = family.rope_module(transformer)
        if isinstance(rope, torch.nn.Module):  # its tables rounded for the kernels once a forward, not once a layer
            rope.register_forward_hook(share_rope_tables)
    names = {id(m): n for n, m in transformer.named_modules()}
    procs = {f"{names[id(attns[i])]}.processor": new_processor(family, attns[i], config, transformer._mhla_token_grid)
             for i in layers}
    transformer.register_to_config(**{CONFIG_KEY: config.to_dict()})
    return procs


def new_processor(family, attn, config: MHLAConfig, grid: TokenGrid) -> MHLAProcessorBase:
    """A fresh MHLA processor for the self-attention module `attn`, on its device and in its dtype."""
    proc = family.processor(config, attn.heads, attn.inner_dim // attn.heads, attn.to_out[0].out_features, grid)
    weight = attn.to_out[0].weight
    return proc.to(device=weight.device, dtype=weight.dtype)


def mhla_processors(transformer, config: MHLAConfig | None = None) -> dict:
    """The dict `transformer.set_attn_processor(...)` takes: fresh MHLA processors for the
    converted self-attention layers, the current processor everywhere else.

    The transformer becomes its MHLA model class and records `config`; the processors' parameters
    exist from here on (the mixing logits serve every resolution: see MHLAConfig.mix_blocks).
    """
    check_unconverted(transformer)
    config = resolve_config(transformer, config or default_config(transformer))
    return {**attn_processors(transformer), **build_processors(transformer, config)}


def check_unconverted(transformer) -> None:
    """Refuse a transformer that is already MHLA: converting again would throw its MHLA weights away."""
    family_of(transformer)
    if is_converted(transformer):
        raise ValueError(f"this transformer is already converted to MHLA (layers {converted_indices(transformer)}); "
                         "converting more layers later is not supported: convert the original model with every layer "
                         "you want, or reload a converted one with mhla_diffusion.from_pretrained")


def transformers_of(model_or_pipeline) -> dict:
    """The supported transformers of a pipeline by component name (Wan2.2: `transformer` and
    `transformer_2`), or {"": model} for a model."""
    components = getattr(model_or_pipeline, "components", None)
    if components is None:
        family_of(model_or_pipeline)
        return {"": model_or_pipeline}
    found = {}
    for name, component in components.items():
        try:
            family_of(component)
        except ValueError:
            continue
        found[name] = component
    if not found:
        raise ValueError(f"{type(model_or_pipeline).__name__} has no supported transformer component")
    return found


def convert(model_or_pipeline, config: MHLAConfig | None = None):
    """Convert a transformer, or every transformer of a pipeline, in place; returns what it was given.

    A pipeline's `model_index.json` then names the MHLA model classes, so plain
    `DiffusionPipeline.from_pretrained` of its `save_pretrained` dir loads MHLA.
    """
    models = transformers_of(model_or_pipeline)
    for model in models.values():  # all or none
        check_unconverted(model)
    for name, model in models.items():
        set_attn_processor(model, mhla_processors(model, config))
        if name:
            setattr(model_or_pipeline, name, model)  # the pipeline's config records the component's new class
    return model_or_pipeline


def mhla_modules(transformer) -> dict:
    """The MHLA processors of a converted transformer, by module path."""
    return {n: m for n, m in transformer.named_modules() if isinstance(m, MHLAProcessorBase)}


def converted_indices(transformer) -> list[int]:
    """Indices of the self-attention layers that run MHLA now."""
    return [i for i, attn in enumerate(self_attentions(transformer)) if isinstance(attn.processor, MHLAProcessorBase)]


def is_converted(transformer) -> bool:
    return bool(mhla_modules(transformer))


def mhla_parameters(transformer):
    """Parameters MHLA added (mixing logits, output norm/gate), e.g. to re-enable them under LoRA."""
    return [p for m in mhla_modules(transformer).values() for p in m.parameters()]


def sync_config(transformer) -> None:
    """Keep the stored config true to the processors after they were replaced.

    No MHLA processor left: the model is its original diffusers class again, with no MHLA config.
    Some left: the config's layers are the converted ones. MHLA processors of different configs in
    one model are refused: one config.json entry describes them all.
    """
    procs = [attn.processor for attn in self_attentions(transformer) if isinstance(attn.processor, MHLAProcessorBase)]
    base = getattr(type(transformer), "_mhla_base", None)
    if base is None:
        return
    if not procs:
        transformer.__class__ = base
        internal = dict(transformer._internal_dict)
        internal.pop(CONFIG_KEY, None)
        transformer._internal_dict = type(transformer._internal_dict)(internal)
        return
    configs = [replace(p.config, layers="all") for p in procs]
    if any(c != configs[0] for c in configs):
        raise ValueError("the MHLA processors of this model were built with different configs; build them all with "
                         "one mhla_processors(model, config) call")
    config = procs[0].config
    layers = converted_indices(transformer)
    if config.converted_layers(len(self_attentions(transformer))) != layers:
        config = replace(config, layers=layers)
    transformer.register_to_config(**{CONFIG_KEY: config.to_dict()})
