"""The model side of a recipe: load, convert, decide what trains, and fold LoRA back in.

LoRA goes in through peft's `inject_adapter_in_model` for every family (DiT has no
`add_adapter`), so there is one code path; the final save merges it into the base weights so
`mhla_diffusion.from_pretrained` loads a plain converted model.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import torch

from .. import persistence
from ..blocks import auto_blocks
from ..config import MHLAConfig, parse_blocks
from ..conversion import convert, converted_indices, default_config, mhla_modules, mhla_parameters, transformers_of
from ..families import family_of, latent_grid, self_attentions
from .checkpoint import partial, publish
from .train_config import check_family

log = logging.getLogger(__name__)

ATTN_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def load_model(config):
    """(pipeline or None, transformer, its Family) from `config.pretrained`, unconverted, with the model's own
    conditioning dropout off (`conditioning.drop_conditioning` chooses the unconditional samples instead)."""
    src = config.pretrained
    converted = persistence.converted_components(src) if Path(src).exists() else {}
    if "" in converted or config.component in converted:  # another expert converted before (Wan2.2) is fine
        raise ValueError(f"{src} is already converted to MHLA; recipes start from the original model "
                         "(the recipe converts it, and distillation needs the original attention)")
    obj = persistence.load(src)
    pipe = obj if hasattr(obj, "components") else None
    if pipe is None and config.component != "transformer":
        raise ValueError(f"component {config.component!r} names a pipeline's transformer but {src} is a bare transformer")
    transformer = getattr(pipe, config.component, None) if pipe is not None else obj
    if transformer is None:
        raise ValueError(f"{src} has no {config.component!r} (its components: {', '.join(pipe.components)})")
    family = family_of(transformer)
    check_family(config, family, src)
    family.stop_conditioning_dropout(transformer)
    return pipe, transformer, family


def expert_sigmas(pipe, config) -> tuple[float, float] | None:
    """The flow sigmas the trained transformer denoises in sampling, when its pipeline splits the noise
    levels between experts (Wan2.2 A14B: its family says how); None when it runs them all."""
    if pipe is None:
        return None
    return family_of(getattr(pipe, config.component)).expert_sigmas(pipe, config.component)


def mhla_config(transformer, config, latent_shape) -> MHLAConfig:
    """The family's released MHLA variant with the recipe's overrides and explicit blocks.

    "auto" blocks are resolved from the training latent's token grid now, so every mixing
    matrix exists before the optimizer is built (no parameters appear at the first forward).
    """
    blocks = parse_blocks(config.mhla_blocks)
    if blocks == "auto":
        blocks = auto_blocks(latent_grid(transformer, latent_shape))
    options = {**config.mhla_options, "blocks": blocks, "layers": config.mhla_layers}
    return default_config(transformer, **options)


def _self_attention_projection_names(transformer) -> list[str]:
    names = {id(m): n for n, m in transformer.named_modules()}
    return [f"{names[id(attn)]}.{p}" for attn in self_attentions(transformer) for p in ATTN_PROJECTIONS]


def set_trainable(transformer, config) -> list[torch.nn.Parameter]:
    """Apply train_mode and return the parameters to optimize (MHLA parameters always train)."""
    if config.train_mode == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        targets = _self_attention_projection_names(transformer)
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, init_lora_weights="gaussian", target_modules=targets)
        inject_adapter_in_model(lora, transformer)
    transformer.requires_grad_(config.train_mode == "full")
    if config.train_mode == "lora":
        for name, p in transformer.named_parameters():
            p.requires_grad_("lora_" in name)
    if config.train_mode == "mhla" and config.train_qkv:
        for name in _self_attention_projection_names(transformer):
            transformer.get_submodule(name).requires_grad_(True)
    for proc in mhla_modules(transformer).values():
        proc.requires_grad_(True)
    return [p for p in transformer.parameters() if p.requires_grad]


def param_groups(transformer, params: list, lr: float, mhla_lr: float | None = None) -> list[dict]:
    """The optimizer's groups: the MHLA parameters (mixing logits, output norm/gate) at `mhla_lr`; without it
    each layer's mixing logits at M x `lr` (M: its blocks) and the rest at `lr`. The paper trains Mc directly,
    entries ~1/M, where an AdamW step is a relative change of ~M x lr; on our row-softmax logits the same change
    takes M x lr (an argument about the logits only: a dense output gate stays at `lr`). Measured
    (recipes/experiments/results/mosaic-random-1024, 1,024 tokens, M = 16, 600 steps at 3e-4): at `lr` the
    matrices moved 4 % and cell FID stayed at 191; at 16 x `lr` they moved 70 % and it fell to 98."""
    if mhla_lr:
        special = {id(p): mhla_lr for p in mhla_parameters(transformer)}
    else:
        special = {id(p): math.prod(proc.mixing.mix_blocks) * lr
                   for proc in mhla_modules(transformer).values() for p in proc.mixing.parameters()}
    by_rate: dict[float, list] = {}
    for p in params:
        by_rate.setdefault(special.get(id(p), lr), []).append(p)
    return [{"params": ps, "lr": rate} for rate, ps in by_rate.items()]


def mixing_drift(transformer) -> dict:
    """Mean over converted layers of how far each mixing matrix moved from its init (`MixingMatrices.drift`)."""
    drifts = [m.mixing.drift() for m in mhla_modules(transformer).values()]
    return {f"mhla/mixing_{k}": sum(d[k] for d in drifts) / len(drifts) for k in drifts[0]} if drifts else {}


def frozen_parameter_ids(transformer, config) -> set[int]:
    """Parameters of the *unconverted* transformer that `config` leaves untouched (shareable with a teacher)."""
    if config.train_mode == "full":
        return set()
    trained = set()
    if config.train_mode == "mhla" and config.train_qkv:
        trained = {id(p) for n in _self_attention_projection_names(transformer) for p in transformer.get_submodule(n).parameters()}
    return {id(p) for p in transformer.parameters() if id(p) not in trained}


def merge_lora(transformer) -> None:
    """Fold LoRA adapters into the base weights and put the base layers back, in place."""
    from peft.tuners.lora import LoraLayer

    lora_layers = [(n, m) for n, m in transformer.named_modules() if isinstance(m, LoraLayer)]
    for name, module in lora_layers:
        module.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(transformer.get_submodule(parent_name) if parent_name else transformer, child, module.get_base_layer())


def convert_model(transformer, mhla: MHLAConfig):
    convert(transformer, mhla)
    log.info("converted %d of %d self-attention layers to MHLA (blocks %s)",
             len(converted_indices(transformer)), len(self_attentions(transformer)), mhla.blocks)
    return transformer


def other_experts(pipe, config) -> list:
    """The pipeline's transformers besides the trained one (Wan2.2's other expert), which sampling also runs."""
    if pipe is None:
        return []
    return [m for name, m in transformers_of(pipe).items() if name != config.component]


def save_trained(out: Path, transformer, state_dict: dict, pipe=None, component: str = "transformer") -> None:
    """Write the trained model where `mhla_diffusion.from_pretrained` loads it: the whole
    pipeline when there is one, the transformer from `state_dict` (gathered under FSDP). It is
    written under a .partial name first, so an interrupted save leaves no half model at `out`.
    `component`: the pipeline's name of the trained transformer (`transformer_2`: a Wan2.2 expert)."""
    out = Path(out)
    tmp = partial(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    if pipe is None:
        save_weights(transformer, state_dict, tmp)
    else:
        pipe.register_modules(**{component: transformer})  # model_index.json names its MHLA class: plain diffusers loads MHLA
        pipe.save_config(tmp)
        for name, module in pipe.components.items():
            if name == component:
                save_weights(transformer, state_dict, tmp / name)
            elif hasattr(module, "save_pretrained"):
                module.save_pretrained(tmp / name)
    publish(out)


def save_weights(transformer, state_dict: dict, path: Path) -> None:
    """`transformer.save_pretrained(path)` with the tensors of `state_dict`. diffusers' save_pretrained takes no
    state dict (it would ignore one and write the module's own tensors, this rank's shards under FSDP), so a
    weightless copy of the model (meta device) takes the given tensors and is saved instead; a missing or
    unexpected key is an error."""
    with torch.device("meta"):
        shell = type(transformer).from_config(transformer.config)
    shell.load_state_dict(state_dict, strict=True, assign=True)
    shell.save_pretrained(path)
