"""The MHLA operator: `mhla_attention`, and the backends behind it.

- `dispatch`: the backend choice and its capability checks; `mhla_op`, the entry processors use.
- `options`: `MHLAOptions`, what a layer computes beyond its tensors; `feature_maps`: the maps phi.
- `naive`: the PyTorch reference operator and the per-stage references of the Triton launchers.
- `context_parallel`: the operator on one rank's token slice.
- `norms`: a layer's RMSNorms around the op (Wan's q/k across heads, the output norm), which the kernels apply on
  the way in inference.
- `check`: the Triton kernels against the reference at real sizes on a GPU (`bench op --check`).
The Triton kernels themselves are `mhla_diffusion.kernels` (the repo's top-level kernels/).
"""

from __future__ import annotations

import torch

from ..blocks import block_geometry
from .dispatch import mhla_op
from .options import MHLAOptions


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mix: torch.Tensor,
    grid,
    blocks,
    *,
    normalize: bool = True,
    eps: float = 1e-6,
    feature: str = "relu",
    rope=None,
    backend: str = "auto",
    group=None,
    mix_logits: bool = False,
) -> torch.Tensor:
    """Multi-head linear attention over token blocks (docs/MHLA.md, sections 1 to 5).

    q, k, v: (B, N, heads, D), raster order over `grid` = (T, H, W) (or (H, W)), N = T*H*W.
    mix: (M, M), row i weighs the key-block summaries seen by query block i; with mix_logits, the logits of that
    matrix instead, whose rows' softmax (fp32) is the matrix: the kernels softmax them as they read them, where a
    converted layer's own softmax would be a launch of its own each call.
    blocks: (bt, bh, bw) (or (bh, bw)), or "auto" (M^2 <= N); ragged blocks are exact.
    normalize: divide by phi(q) . (mixed key sums) + eps; otherwise return the numerator.
    feature: the feature map phi, a name in `feature_maps.FEATURE_MAPS`.
    rope: optional (cos, sin) broadcastable to q, rotating phi(q), phi(k) in the numerator only.
    backend: "torch" (reference), "triton" (fused kernels: CUDA, or CPU under TRITON_INTERPRET=1),
    "auto" (the kernels for calls they support, the reference otherwise). A backend asked for by name
    that cannot take the call raises a ValueError saying why.
    group: a process group whose ranks each hold a contiguous slice of the N tokens (context parallel);
    q, k, v (and rope) are then this rank's slice, and every rank must call together.
    Returns (B, N, heads, D_v) in v's dtype (under autocast, as SDPA: q, k, v but fp64 ones in autocast's type);
    accumulation is fp32 (fp64 for fp64 inputs).
    """
    return mhla_op(q, k, v, mix, block_geometry(grid, blocks), MHLAOptions(normalize, eps, feature), rope=rope,
                   backend=backend, group=group, mix_logits=mix_logits)


__all__ = ["MHLAOptions", "mhla_attention", "mhla_op"]
