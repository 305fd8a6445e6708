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
    # the latent (frames, height, width) of the size the released models run at, for models whose config
    # declares none (Wan has no sample_size); image models use their config's sample_size
    default_latent: tuple[int, int, int] | None = None
    default_size_name: str = ""


FAMILIES = (
    Family("dit", ("DiTTransformer2DModel",), "transformer_blocks", MHLAAttnProcessor),
    Family("pixart", ("PixArtTransformer2DModel",), "transformer_blocks", MHLAAttnProcessor,
           any_size={"use_resolution_binning": False}),
    # eps as SANA's own linear attention, so blocks=(1,1,1) reproduces the original exactly.
    Family("sana", ("SanaTransformer2DModel",), "transformer_blocks", MHLASanaAttnProcessor, {"eps": 1e-15},
           any_size={"use_resolution_binning": False}),
    # The released Wan2.1 MHLA: no normalizer, per-head RMSNorm on the output, RoPE on the numerator.
    # 480p x 81 frames: the VAE's latent is 21 frames of 60 x 104.
    Family("wan", ("WanTransformer3DModel",), "blocks", MHLAWanAttnProcessor, {"normalize": False, "output_norm": True},
           default_latent=(21, 60, 104), default_size_name="480p x 81 frames"),
)

SUPPORTED = ", ".join(c for f in FAMILIES for c in f.class_names)


def family_of(transformer) -> Family:
    """The family of a transformer (an MHLA model class counts as the diffusers class it extends)."""
    for cls in type(transformer).__mro__:
        for fam in FAMILIES:
            if cls.__name__ in fam.class_names:
                return fam
    raise ValueError(f"unsupported model class {type(transformer).__name__}; supported: {SUPPORTED}")


def family_by_name(name: str) -> Family:
    for fam in FAMILIES:
        if name == fam.name or name in fam.class_names:
            return fam
    raise ValueError(f"unknown model family {name!r}; supported: {', '.join(f.name for f in FAMILIES)}")


def self_attentions(transformer) -> list:
    """The self-attention modules (`attn1`) of the transformer, in layer order."""
    blocks = getattr(transformer, family_of(transformer).block_list)
    return [block.attn1 for block in blocks]


def default_grid(transformer) -> tuple[tuple[int, int, int], str]:
    """The token grid at the model's default size, and that size in words (for messages)."""
    fam = family_of(transformer)
    if fam.default_latent is not None:
        return _patched(transformer.config.patch_size, fam.default_latent), fam.default_size_name
    size = transformer.config.sample_size
    size = (size, size) if isinstance(size, int) else tuple(size)
    return _patched(transformer.config.patch_size, (1, *size)), f"its sample_size {size[0]} x {size[1]} latent"


def token_grid(transformer, hidden_states) -> tuple[int, int, int]:
    """Post-patch (T, H, W) grid of a transformer input (B, C, H, W) or (B, C, F, H, W)."""
    spatial = tuple(hidden_states.shape[2:])
    return _patched(transformer.config.patch_size, spatial if len(spatial) == 3 else (1, *spatial))


def _patched(patch, latent) -> tuple[int, int, int]:
    """(T, H, W) tokens of a latent (frames, height, width) under the model's patch size."""
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1, patch, patch)
    return tuple(s // p for s, p in zip(latent, patch))
