"""What one MHLA layer computes beyond its tensors and block geometry, in one frozen object."""

from __future__ import annotations

from dataclasses import dataclass

from .feature_maps import feature_map


@dataclass(frozen=True)
class MHLAOptions:
    """normalize, eps: docs/MHLA.md, section 1; feature: a name in `FEATURE_MAPS` (section 4).

    Processors build it once from their `MHLAConfig`; the dispatch checks it against each backend and
    hands it to the one that runs (the Triton custom ops take it flattened, `kernels.op.op_args`).
    """

    normalize: bool = True
    eps: float = 1e-6
    feature: str = "relu"

    def __post_init__(self):
        feature_map(self.feature)  # an unknown name fails here, with the names there are

    @classmethod
    def from_config(cls, config) -> "MHLAOptions":
        return cls(normalize=config.normalize, eps=config.eps, feature=config.feature)
