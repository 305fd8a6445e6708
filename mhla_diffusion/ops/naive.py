"""Plain PyTorch MHLA: the readable reference every fast path is tested against.

Tokens are gathered into a zero-padded block-major layout (B, heads, M, Lmax, D), so each
block summary is one einsum; padding slots hold zeros and contribute nothing. Memory is
O(N D + M D^2) per head: nothing is N x N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import as_grid, block_layout, resolve_blocks

FEATURE_MAPS = {
    "relu": F.relu,
    "elu": lambda x: F.elu(x) + 1.0,
}


def feature_map(name: str):
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}") from None


def apply_rope(x: torch.Tensor, rope) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the angles in (cos, sin), Wan's convention.

    cos and sin broadcast to x (B, N, heads, D) and hold each angle twice (repeat-interleaved).
    """
    cos, sin = (t.to(x.dtype) for t in rope)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def check_inputs(q, k, v, mix, grid, blocks):
    """Shapes and the block grid of one call; returns the resolved block grid."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k, v must be (B, N, heads, D) with matching B, N, heads; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    grid = as_grid(grid)
    n = grid[0] * grid[1] * grid[2]
    if q.shape[1] != n:
        raise ValueError(f"token grid {grid} holds {n} tokens but q has N = {q.shape[1]}")
    blocks = resolve_blocks(grid, blocks)
    m = blocks[0] * blocks[1] * blocks[2]
    if tuple(mix.shape) != (m, m):
        raise ValueError(f"mix must be ({m}, {m}) for block grid {blocks}, got {tuple(mix.shape)}")
    return grid, blocks


def mhla_attention_reference(q, k, v, mix, grid, blocks, *, normalize=True, eps=1e-6, feature="relu", rope=None):
    """MHLA as the spec writes it; see `mhla_diffusion.mhla_attention` for the arguments."""
    grid, blocks = check_inputs(q, k, v, mix, grid, blocks)
    layout = block_layout(grid, blocks, q.device)
    return mhla_blocked(q, k, v, mix, layout, normalize=normalize, eps=eps, feature=feature, rope=rope)


def mhla_blocked(q, k, v, mix, layout, *, normalize, eps, feature, rope, combine=None):
    """MHLA of the tokens `layout` packs into blocks: all of the grid, or one rank's slice of it.

    mix: the mixing rows of the layout's blocks (all M rows when the layout holds every block).
    combine: turns the partial summaries of the layout's blocks, a list of (B, h, M_layout, ...),
    into the summaries of all M blocks (sequence parallel: scatter, then sum over ranks).
    """
    phi = feature_map(feature)
    dt = torch.promote_types(q.dtype, torch.float32)

    def to_blocks(x):  # (B, N, h, D) -> (B, h, M, Lmax, D), zeros in padding slots
        x = F.pad(x.transpose(1, 2), (0, 0, 0, 1))
        return x[:, :, layout.slot_index]

    fq, fk = phi(q.to(dt)), phi(k.to(dt))
    rq, rk = (apply_rope(fq, rope), apply_rope(fk, rope)) if rope is not None else (fq, fk)
    mix = mix.to(dt)

    sums = [torch.einsum("bhmld,bhmle->bhmde", to_blocks(rk), to_blocks(v.to(dt)))]
    if normalize:
        sums.append(to_blocks(fk).sum(dim=3))
    if combine is not None:
        sums = combine(sums)
    mixed = torch.einsum("im,bhmde->bhide", mix, sums[0])
    out = torch.einsum("bhmld,bhmde->bhmle", to_blocks(rq), mixed)
    if normalize:
        z = torch.einsum("im,bhmd->bhid", mix, sums[1])
        den = torch.einsum("bhmld,bhmd->bhml", to_blocks(fq), z)
        out = out / (den.unsqueeze(-1) + eps)
    out = out.flatten(2, 3)[:, :, layout.token_slot]  # back to raster order: (B, h, N, D)
    return out.transpose(1, 2).to(v.dtype)
