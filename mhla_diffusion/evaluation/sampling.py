"""Deterministic sample generation from any supported pipeline.

Sample i always gets seed `seed + i` (its own CPU generator), DiT class `i % num_classes`
(balanced) or prompt `i % len(prompts)`, so a sample does not depend on batching, the
number of GPUs, or which run of a resumed evaluation made it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..families import SUPPORTED, family_of
from ..persistence import checkpoint_kind, from_pretrained, load, stored_config


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


def pipe_family(pipe):
    """The family of the pipeline's transformer."""
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ValueError(f"{type(pipe).__name__} has no transformer; supported transformers: {SUPPORTED}")
    return family_of(transformer)


def family_name(pipe) -> str:
    return pipe_family(pipe).name


def call_kwargs(pipe, indices, settings: SamplingSettings) -> dict:
    """Pipeline arguments for the samples `indices`."""
    family = pipe_family(pipe)
    s = settings
    kwargs = {"generator": [torch.Generator("cpu").manual_seed(s.seed + i) for i in indices], "output_type": "np"}
    if s.steps is not None:
        kwargs["num_inference_steps"] = s.steps
    if s.guidance_scale is not None:
        kwargs["guidance_scale"] = s.guidance_scale
    return {**kwargs, **family.call_kwargs(pipe, list(indices), s)}


def generate(pipe, indices, settings: SamplingSettings) -> np.ndarray:
    """Samples `indices` as floats in [0, 1]: (B, H, W, 3), or (B, F, H, W, 3) for video."""
    with torch.inference_mode():
        out = pipe(**call_kwargs(pipe, list(indices), settings))
    return np.asarray(out[0], dtype=np.float32)
