"""How each supported family is trained: objective, conditioning, and the transformer call.

One table instead of per-family scripts: everything else in the recipe is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..families import family_by_name


@dataclass(frozen=True)
class FamilyRecipe:
    objective: str  # "ddpm" (epsilon + learned variance when the model outputs 2x channels) or "flow"
    text: bool  # conditioned on text embeddings (else on class labels)
    video: bool
    pipeline_kwargs: dict = field(default_factory=dict)  # extra arguments for validation sampling


RECIPES = {
    "dit": FamilyRecipe("ddpm", text=False, video=False),
    # PixArt and SANA bin resolutions to their aspect-ratio tables at inference; validation samples
    # at the training size instead. SANA's "complex human instruction" prefix is not used in training.
    "pixart": FamilyRecipe("ddpm", text=True, video=False, pipeline_kwargs=family_by_name("pixart").any_size),
    "sana": FamilyRecipe("flow", text=True, video=False,
                         pipeline_kwargs={**family_by_name("sana").any_size, "complex_human_instruction": None}),
    "wan": FamilyRecipe("flow", text=True, video=True),
}


def recipe_for(family: str) -> FamilyRecipe:
    if family not in RECIPES:
        raise ValueError(f"the training recipe does not support family {family!r}; supported: {', '.join(RECIPES)}")
    return RECIPES[family]


def transformer_inputs(family: str, transformer, latents, timestep, batch: dict) -> dict:
    """Keyword arguments of `transformer(...)` for one training batch."""
    if family == "dit":
        return {"hidden_states": latents, "timestep": timestep, "class_labels": batch["class_label"]}
    kwargs = {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": batch["prompt_embeds"]}
    if family in ("pixart", "sana"):
        kwargs["encoder_attention_mask"] = batch["prompt_attention_mask"]
    if family == "pixart":
        kwargs["added_cond_kwargs"] = pixart_conditions(transformer, latents)
    return kwargs


def pixart_conditions(transformer, latents) -> dict:
    """PixArt-alpha's resolution/aspect-ratio micro-conditions (None for models without them)."""
    if not transformer.config.use_additional_conditions:
        return {"resolution": None, "aspect_ratio": None}
    b, _, h, w = latents.shape
    scale = 8  # PixArt's VAE factor: the conditions are in pixels
    res = torch.tensor([h * scale, w * scale], device=latents.device, dtype=latents.dtype).repeat(b, 1)
    return {"resolution": res, "aspect_ratio": (res[:, :1] / res[:, 1:])}


def model_output(out):
    """The prediction tensor of a diffusers model output."""
    return out.sample if hasattr(out, "sample") else out[0]
