"""The model families MHLA supports, one module each (`dit`, `pixart`, `sana`, `wan`, ...).

Each module defines `FAMILY`, a `base.Family`; the registry is every module of this package,
so adding a family is adding a module (README: "How to add a model family").
"""

from __future__ import annotations

import importlib
import pkgutil

import torch

from .base import Family, RealModel, Variant


def _load() -> tuple[Family, ...]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")
    return tuple(importlib.import_module(f"{__name__}.{name}").FAMILY for name in names)


FAMILIES = _load()

SUPPORTED = ", ".join(c for f in FAMILIES for c in f.class_names)
CLASS_NAMES = frozenset(c for f in FAMILIES for c in f.class_names)


def family_of(transformer) -> Family:
    """The family of a transformer (an MHLA model class counts as the diffusers class it extends)."""
    for cls in type(transformer).__mro__:
        for fam in FAMILIES:
            if cls.__name__ in fam.class_names:
                return fam
    raise ValueError(f"unsupported model class {type(transformer).__name__}; supported: {SUPPORTED}")


def family_by_name(name: str) -> Family:
    """A family by its name or one of its class names."""
    for fam in FAMILIES:
        if name == fam.name or name in fam.class_names:
            return fam
    raise ValueError(f"unknown model family {name!r}; supported: {', '.join(f.name for f in FAMILIES)}")


def tiny_variant(name: str) -> tuple[Family, Variant]:
    """A family's tiny member by its name (a family name: the family's tiny config as it is)."""
    for fam in FAMILIES:
        if name == fam.name:
            return fam, Variant()
        if name in fam.variants:
            return fam, fam.variants[name]
    raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(tiny_names())}")


def tiny_names() -> list[str]:
    """Every tiny model zoo builds: the families, then their named variants."""
    return [f.name for f in FAMILIES] + [v for f in FAMILIES for v in f.variants]


def real_model(name: str) -> tuple[Family, RealModel]:
    """A published checkpoint's config by its `bench model` name (e.g. "wan2.1-1.3b")."""
    for fam in FAMILIES:
        if name in fam.real:
            return fam, fam.real[name]
    raise ValueError(f"unknown model {name!r}; real-size models: {', '.join(real_model_names())}")


def real_model_names() -> list[str]:
    return [name for fam in FAMILIES for name in fam.real]


def self_attentions(transformer) -> list:
    """The self-attention modules MHLA converts, in layer order."""
    return family_of(transformer).self_attentions(transformer)


def token_grid(transformer, hidden_states) -> tuple[int, int, int]:
    """Post-patch (T, H, W) grid of a transformer input (B, C, H, W) or (B, C, F, H, W)."""
    return family_of(transformer).token_grid(transformer, hidden_states)


def latent_grid(transformer, latent: tuple) -> tuple[int, int, int]:
    """`token_grid` of a latent without its batch dimension ((C, H, W) or (C, F, H, W)); nothing is allocated."""
    return token_grid(transformer, torch.empty((1, *latent), device="meta"))


def default_grid(transformer) -> tuple[tuple[int, int, int], str]:
    """The token grid at the model's default size, and that size in words (for messages)."""
    return family_of(transformer).default_grid(transformer)
