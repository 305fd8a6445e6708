"""The public MHLA operator and its backend choice."""

from __future__ import annotations

import torch

from .reference import check_inputs, feature_map, mhla_attention_reference

BACKENDS = ("auto", "torch", "triton")


def _kernels():
    """The Triton entry points (`mhla_diffusion.kernels.op`), imported on first use.

    kernels/ has no __init__.py on purpose: a source checkout on sys.path must not expose a
    top-level `kernels` package, which transformers and diffusers would take for the hub's.
    """
    from .kernels import op  # a plain import statement: torch.compile traces it, import_module it refuses

    return op


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
) -> torch.Tensor:
    """Multi-head linear attention over token blocks (MHLA_SPEC.md, section 1).

    q, k, v: (B, N, heads, D), raster order over `grid` = (T, H, W) (or (H, W)), N = T*H*W.
    mix: (M, M), row i weighs the key-block summaries seen by query block i.
    blocks: (bt, bh, bw) (or (bh, bw)), or "auto" (M^2 <= N); ragged blocks are exact.
    normalize: divide by phi(q) . (mixed key sums) + eps; otherwise return the numerator.
    rope: optional (cos, sin) broadcastable to q, rotating phi(q), phi(k) in the numerator only.
    backend: "torch" (reference), "triton" (fused kernels: CUDA, or CPU under TRITON_INTERPRET=1),
    "auto" (Triton for CUDA inputs it supports, the reference otherwise).
    Returns (B, N, heads, D_v) in v's dtype; accumulation is fp32 (fp64 for fp64 inputs).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and _kernels().unsupported_reason(q, k, v) is None else "torch"
    if backend == "torch":
        return mhla_attention_reference(
            q, k, v, mix, grid, blocks, normalize=normalize, eps=eps, feature=feature, rope=rope
        )
    grid, blocks = check_inputs(q, k, v, mix, grid, blocks)
    feature_map(feature)  # validates the name
    return _kernels().mhla_attention_triton(
        q, k, v, mix, grid, blocks, normalize=normalize, eps=eps, feature=feature, rope=rope
    )
