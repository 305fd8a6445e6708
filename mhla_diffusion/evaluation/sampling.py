"""Deterministic sample generation from any supported pipeline (DiT, PixArt, SANA, Wan).

Sample i always gets seed `seed + i` (its own CPU generator), DiT class `i % num_classes`
(balanced) or prompt `i % len(prompts)`, so a sample does not depend on batching, the
number of GPUs, or which run of a resumed evaluation made it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..families import family_of
from ..persistence import checkpoint_kind, from_pretrained, load, stored_config

DIT_NULL_CLASS = 1000  # DiTPipeline's classifier-free guidance uses class id 1000 as the null class


@dataclass
class SamplingSettings:
    """What fixes the samples (batch size and device do not, up to rounding)."""

    seed: int = 0
    steps: int | None = None  # None: the pipeline's default
    guidance_scale: float | None = None  # None: the pipeline's default
    prompts: list[str] | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def read_prompts(path) -> list[str]:
    """One prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts (one per line)")
    return prompts


def load_pipeline(path, torch_dtype=None):
    """A pipeline dir, converted (MHLA restored) or original."""
    if checkpoint_kind(path) != "pipeline":
        raise ValueError(f"{path} is a transformer dir; sampling needs a pipeline dir (with model_index.json)")
    return from_pretrained(path, torch_dtype=torch_dtype) if stored_config(path) is not None else load(path, torch_dtype=torch_dtype)


def family_name(pipe) -> str:
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ValueError(f"{type(pipe).__name__} has no transformer; supported pipelines: DiT, PixArt, SANA, Wan")
    return family_of(transformer).name


def call_kwargs(pipe, indices, settings: SamplingSettings) -> dict:
    """Pipeline arguments for the samples `indices`."""
    family = family_name(pipe)
    s = settings
    kwargs = {"generator": [torch.Generator("cpu").manual_seed(s.seed + i) for i in indices], "output_type": "np"}
    if s.steps is not None:
        kwargs["num_inference_steps"] = s.steps
    if s.guidance_scale is not None:
        kwargs["guidance_scale"] = s.guidance_scale
    if family == "dit":
        num_classes = pipe.transformer.config.num_embeds_ada_norm
        guided = (s.guidance_scale if s.guidance_scale is not None else 4.0) > 1  # 4.0: DiTPipeline's default
        if guided and num_classes != DIT_NULL_CLASS:
            raise ValueError(f"DiTPipeline's guidance uses null class {DIT_NULL_CLASS} but this model has {num_classes} classes; pass guidance scale 1")
        if s.prompts or s.height or s.width or s.num_frames:
            raise ValueError("DiT is class-conditional at its trained size: prompts, height, width and frames do not apply")
        kwargs["class_labels"] = [i % num_classes for i in indices]
        return kwargs
    if not s.prompts:
        raise ValueError(f"{family} samples need prompts (a prompts file, one per line)")
    kwargs["prompt"] = [s.prompts[i % len(s.prompts)] for i in indices]
    kwargs.update(family_of(pipe.transformer).any_size)  # the asked size, not a trained aspect-ratio bin
    kwargs.update({k: v for k, v in (("height", s.height), ("width", s.width)) if v is not None})
    if s.num_frames is not None:
        if family != "wan":
            raise ValueError(f"{family} makes images; frames apply to Wan only")
        kwargs["num_frames"] = s.num_frames
    return kwargs


def generate(pipe, indices, settings: SamplingSettings) -> np.ndarray:
    """Samples `indices` as floats in [0, 1]: (B, H, W, 3), or (B, F, H, W, 3) for video."""
    with torch.inference_mode():
        out = pipe(**call_kwargs(pipe, list(indices), settings))
    return np.asarray(out[0], dtype=np.float32)
