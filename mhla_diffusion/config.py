"""MHLAConfig: what a conversion does, stored in the transformer's config.json under "mhla"."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .blocks import as_blocks
from .ops.feature_maps import FEATURE_MAPS

MIX_INITS = ("locality", "uniform", "identity")


@dataclass
class MHLAConfig:
    """How self-attention layers are converted to MHLA.

    blocks: (bt, bh, bw) (or (bh, bw)) used at every resolution, or "auto": chosen per call
        from the token grid with M^2 <= N.
    mix_blocks: the block grid the mixing logits are defined on (one free M x M matrix per layer);
        a call whose block grid differs reads them resampled to its grid (trilinear in query and key
        block coordinates), so what was learned at one size carries to every other. None (default):
        `blocks` when fixed, else the "auto" grid of the model's default size; set at conversion.
    layers: "all", a list of self-attention layer indices, or "hybrid:K" (every K-th layer,
        counting from 1, keeps softmax; the released MHLA-H uses K = 3).
    feature: feature map phi ("relu" or "elu" = elu + 1).
    normalize: divide by phi(q) . z~ (the paper's image models); off in the released Wan recipe.
    output_norm: per-head RMSNorm on the attention output (learned gain, init 1).
    output_gate: SiLU output gate from the layer input (initialised to pass everything).
    rope: for models with RoPE (Wan): "numerator" rotates phi(q), phi(k) in the numerator only;
        "none" drops RoPE from converted layers.
    mix_init: "locality" (the paper's), "uniform" (equals plain linear attention), "identity".
    """

    blocks: tuple[int, int, int] | str = "auto"
    mix_blocks: tuple[int, int, int] | None = None
    layers: list[int] | str = "all"
    feature: str = "relu"
    normalize: bool = True
    eps: float = 1e-6
    output_norm: bool = False
    output_gate: bool = False
    rope: str = "numerator"
    mix_init: str = "locality"

    def __post_init__(self):
        if isinstance(self.blocks, str):
            if self.blocks != "auto":
                self.blocks = parse_blocks(self.blocks)
        else:
            self.blocks = as_blocks(self.blocks)
        if self.mix_blocks is not None:
            self.mix_blocks = as_blocks(self.mix_blocks)
        self.layers = parse_layers(self.layers)
        if self.feature not in FEATURE_MAPS:
            raise ValueError(f"unknown feature map {self.feature!r}; choose one of {sorted(FEATURE_MAPS)}")
        if self.mix_init not in MIX_INITS:
            raise ValueError(f"unknown mix_init {self.mix_init!r}; choose one of {list(MIX_INITS)}")
        if self.rope not in ("numerator", "none"):
            raise ValueError(f"rope must be 'numerator' or 'none', got {self.rope!r}")

    def converted_layers(self, num_layers: int) -> list[int]:
        """Indices of the self-attention layers this config converts, out of `num_layers`."""
        if self.layers == "all":
            return list(range(num_layers))
        if isinstance(self.layers, str):  # "hybrid:K"
            k = int(self.layers.split(":")[1])
            return [i for i in range(num_layers) if (i + 1) % k != 0]
        bad = [i for i in self.layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range: the model has {num_layers} self-attention layers (0..{num_layers - 1})")
        return sorted(set(self.layers))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocks"] = self.blocks if isinstance(self.blocks, str) else list(self.blocks)
        d["mix_blocks"] = None if self.mix_blocks is None else list(self.mix_blocks)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MHLAConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown MHLAConfig keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)


def parse_blocks(text) -> tuple[int, int, int] | str:
    """'auto', 'bt,bh,bw' or 'bh,bw' (as typed on the command line)."""
    if isinstance(text, str):
        text = text.strip()
        if text == "auto":
            return "auto"
        try:
            text = [int(x) for x in text.replace("x", ",").split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"blocks must be 'auto' or 'bt,bh,bw' (e.g. 3,5,10), got {text!r}") from None
    return as_blocks(text)


def parse_layers(value) -> list[int] | str:
    """'all', 'hybrid:K', '0,1,5' or a list of ints."""
    if isinstance(value, str):
        text = value.strip()
        if text == "all":
            return "all"
        if text.startswith("hybrid"):
            _, _, k = text.partition(":")
            if not k.isdigit() or int(k) < 2:
                raise ValueError(f"hybrid layers must be 'hybrid:K' with K >= 2 (every K-th layer keeps softmax), got {value!r}")
            return f"hybrid:{int(k)}"
        try:
            value = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"layers must be 'all', 'hybrid:K' or comma-separated indices, got {value!r}") from None
    try:
        layers = [int(i) for i in value]
    except (TypeError, ValueError):
        raise ValueError(f"layers must be 'all', 'hybrid:K' or a list of indices, got {value!r}") from None
    if not layers:
        raise ValueError("layers is empty: name at least one layer, or 'all'")
    return layers
