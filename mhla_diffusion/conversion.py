"""Turn a diffusers transformer's self-attention into MHLA, in place."""

from __future__ import annotations

from .config import MHLAConfig
from .blocks import auto_blocks, check_blocks
from .families import default_grid, family_of, self_attentions, token_grid
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


def _grid_hook(transformer) -> TokenGrid:
    """Install (once) the pre-hook that publishes each call's token grid to the processors."""
    grid = getattr(transformer, "_mhla_token_grid", None)
    if grid is None:
        grid = TokenGrid()

        def publish(module, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            grid.grid = token_grid(module, hidden_states)

        transformer.register_forward_pre_hook(publish, with_kwargs=True)
        transformer._mhla_token_grid = grid
    return grid


def mhla_processors(transformer, config: MHLAConfig | None = None) -> dict:
    """The dict `transformer.set_attn_processor(...)` takes: fresh MHLA processors for the
    converted self-attention layers, the current processor everywhere else.

    It also installs the token-grid pre-hook and records `config` in the transformer's config.
    """
    family = family_of(transformer)
    config = config or default_config(transformer)
    if is_converted(transformer):
        raise ValueError("this transformer is already converted to MHLA; convert the original model, or reload with mhla_diffusion.from_pretrained")
    native = default_grid(transformer)
    if native is not None and config.blocks != "auto":
        check_blocks(native, config.blocks)  # image models: bt must be 1, bh/bw fit the native grid
    grid = _grid_hook(transformer)
    procs = attn_processors(transformer)
    names = {id(m): n for n, m in transformer.named_modules()}
    attns = self_attentions(transformer)
    for i in config.converted_layers(len(attns)):
        attn = attns[i]
        heads = attn.heads
        inner = attn.inner_dim
        dim = attn.to_out[0].out_features
        proc = family.processor(config, heads, inner // heads, dim, grid)
        if native is not None and config.blocks == "auto":
            proc.mixing.add(auto_blocks(native))  # the native resolution's matrix exists from the start
        weight = attn.to_out[0].weight
        procs[f"{names[id(attn)]}.processor"] = proc.to(device=weight.device, dtype=weight.dtype)
    transformer.register_to_config(**{CONFIG_KEY: config.to_dict()})
    return procs


def convert(model_or_pipeline, config: MHLAConfig | None = None):
    """Convert a transformer, or a pipeline's `transformer`, in place; returns the transformer."""
    transformer = getattr(model_or_pipeline, "transformer", model_or_pipeline)
    set_attn_processor(transformer, mhla_processors(transformer, config))
    return transformer


def mhla_modules(transformer) -> dict:
    """The MHLA processors of a converted transformer, by module path."""
    return {n: m for n, m in transformer.named_modules() if isinstance(m, MHLAProcessorBase)}


def is_converted(transformer) -> bool:
    return bool(mhla_modules(transformer))


def mhla_parameters(transformer):
    """Parameters MHLA added (mixing logits, output norm/gate), e.g. to re-enable them under LoRA."""
    return [p for m in mhla_modules(transformer).values() for p in m.parameters()]
