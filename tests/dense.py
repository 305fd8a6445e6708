"""The dense O(N^2) MHLA formula and random inputs, shared by the numerics tests."""

import math

import torch

from mhla_diffusion.blocks import block_layout
from mhla_diffusion.ops.feature_maps import FEATURE_MAPS
from mhla_diffusion.ops.naive import apply_rope


def dense_mhla(q, k, v, mix, grid, blocks, normalize=True, eps=1e-6, feature="relu", rope=None):
    """A[n, j] = Mc[b(n), b(j)] phi(q_n).phi(k_j); o = A v / (sum_j A + eps), written out in full."""
    phi = FEATURE_MAPS[feature]
    b = block_layout(grid, blocks).token_block
    w = mix[b][:, b]  # (N, N) block weights
    fq, fk = phi(q), phi(k)
    rq, rk = (apply_rope(fq, rope), apply_rope(fk, rope)) if rope is not None else (fq, fk)
    a_num = w * torch.einsum("bnhd,bjhd->bhnj", rq, rk)
    out = torch.einsum("bhnj,bjhe->bnhe", a_num, v)
    if normalize:
        a_den = w * torch.einsum("bnhd,bjhd->bhnj", fq, fk)
        out = out / (a_den.sum(-1).transpose(1, 2)[..., None] + eps)
    return out


def random_inputs(grid, blocks, heads=2, d=4, dv=None, batch=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, m = math.prod(grid), math.prod(blocks)
    q, k = (torch.randn(batch, n, heads, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, n, heads, dv or d, generator=g, dtype=dtype)
    mix = torch.rand(m, m, generator=g, dtype=dtype)
    return q, k, v, mix / mix.sum(1, keepdim=True)


def random_rope(n, d, seed=0):
    angles = torch.rand(n, d // 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 6.28
    angles = angles.repeat_interleave(2, dim=-1)[None, :, None, :]  # (1, N, 1, D), Wan's layout
    return angles.cos(), angles.sin()
