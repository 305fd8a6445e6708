"""The public MHLA operator and its backend choice."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from .reference import check_inputs, feature_map, mhla_attention_reference

BACKENDS = ("auto", "torch", "triton")


def _kernels():
    """`mhla_diffusion.kernels`, also from a source checkout that is not installed.

    The package maps the repo's top-level kernels/ to that name (pyproject); with only the
    checkout on sys.path, load kernels/ under the same name so its relative imports work.
    """
    name = f"{__package__}.kernels"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
    path = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


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
