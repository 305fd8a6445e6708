"""The diffusers transformers MHLA supports: where their self-attention lives and their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from .processors import MHLAAttnProcessor, MHLASanaAttnProcessor, MHLAWanAttnProcessor


@dataclass(frozen=True)
class Family:
    name: str
    class_names: tuple[str, ...]
    block_list: str  # attribute holding the transformer blocks; self-attention is `<block>.attn1`
    processor: type
    defaults: dict = field(default_factory=dict)  # MHLAConfig fields of the released variant
    # pipeline arguments to sample at the asked height/width (PixArt and SANA snap to aspect-ratio bins)
    any_size: dict = field(default_factory=dict)


FAMILIES = (
    Family("dit", ("DiTTransformer2DModel",), "transformer_blocks", MHLAAttnProcessor),
    Family("pixart", ("PixArtTransformer2DModel",), "transformer_blocks", MHLAAttnProcessor,
           any_size={"use_resolution_binning": False}),
    # eps as SANA's own linear attention, so blocks=(1,1,1) reproduces the original exactly.
    Family("sana", ("SanaTransformer2DModel",), "transformer_blocks", MHLASanaAttnProcessor, {"eps": 1e-15},
           any_size={"use_resolution_binning": False}),
    # The released Wan2.1 MHLA: no normalizer, per-head RMSNorm on the output, RoPE on the numerator.
    Family("wan", ("WanTransformer3DModel",), "blocks", MHLAWanAttnProcessor, {"normalize": False, "output_norm": True}),
)

SUPPORTED = ", ".join(c for f in FAMILIES for c in f.class_names)


def family_of(transformer) -> Family:
    name = type(transformer).__name__
    for fam in FAMILIES:
        if name in fam.class_names:
            return fam
    raise ValueError(f"unsupported model class {name}; supported: {SUPPORTED}")


def family_by_name(name: str) -> Family:
    for fam in FAMILIES:
        if name == fam.name or name in fam.class_names:
            return fam
    raise ValueError(f"unknown model family {name!r}; supported: {', '.join(f.name for f in FAMILIES)}")


def self_attentions(transformer) -> list:
    """The self-attention modules (`attn1`) of the transformer, in layer order."""
    blocks = getattr(transformer, family_of(transformer).block_list)
    return [block.attn1 for block in blocks]


def default_grid(transformer) -> tuple[int, int, int] | None:
    """The token grid at the model's native resolution, for image models that declare one."""
    size = getattr(transformer.config, "sample_size", None)
    patch = transformer.config.patch_size
    if size is None or isinstance(patch, (tuple, list)):
        return None
    size = (size, size) if isinstance(size, int) else tuple(size)
    return (1, size[0] // patch, size[1] // patch)


def token_grid(transformer, hidden_states) -> tuple[int, int, int]:
    """Post-patch (T, H, W) grid of a transformer input (B, C, H, W) or (B, C, F, H, W)."""
    spatial = tuple(hidden_states.shape[2:])
    patch = transformer.config.patch_size
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * len(spatial)
    if len(patch) == 3 and len(spatial) == 2:
        patch = patch[1:]
    grid = tuple(s // p for s, p in zip(spatial, patch))
    return grid if len(grid) == 3 else (1, *grid)
