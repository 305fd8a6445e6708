"""The feature maps phi of MHLA (docs/MHLA.md, section 4), by the name `MHLAConfig.feature` gives.

The PyTorch reference computes any map registered here; the Triton kernels declare the ones they compute
(`kernels/capabilities.py: FEATURES`), and the dispatch sends other maps to the reference.
"""

from __future__ import annotations

import torch.nn.functional as F

FEATURE_MAPS = {
    "relu": F.relu,
    "elu": lambda x: F.elu(x) + 1.0,
}


def feature_map(name: str):
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}") from None
