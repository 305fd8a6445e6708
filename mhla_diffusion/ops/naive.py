"""Plain PyTorch MHLA: the readable reference every fast path is tested against (docs/MHLA.md, section 1).

Tokens are gathered into a zero-padded block-major layout (B, heads, M, Lmax, D), so each
block summary is one einsum; padding slots hold zeros and contribute nothing. Memory is
O(N D + M D^2) per head: nothing is N x N. The op's "torch" backend is `mhla_blocked`.

Below it, `reference_*`: the plain meaning of each Triton launcher of `kernels/mhla.py`, in fp64, which
tests/kernels_interp.py compares stage by stage (as flash-linear-attention keeps naive.py beside its kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..blocks import BlockLayout, block_layout
from .feature_maps import feature_map


def apply_rope(x: torch.Tensor, rope) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the angles in (cos, sin), Wan's convention.

    cos and sin broadcast to x (B, N, heads, D) and hold each angle twice (repeat-interleaved).
    """
    cos, sin = (t.to(x.dtype) for t in rope)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _gather(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """(B, N, h, C) -> (B, h, M, Lmax, C), zeros in padding slots."""
    return F.pad(x.transpose(1, 2), (0, 0, 0, 1))[:, :, layout.slot_index]


def mhla_blocked(q, k, v, mix, layout: BlockLayout, options, rope=None, combine=None):
    """MHLA of the tokens `layout` packs into blocks: all of the grid, or one rank's slice of it.

    mix: the mixing rows of the layout's blocks (all M rows when the layout holds every block).
    options: an `MHLAOptions`. combine: turns the partial summaries of the layout's blocks, a list of
    (B, h, M_layout, ...), into the summaries of all M blocks (context parallel: scatter, then sum over ranks).
    """
    phi = feature_map(options.feature)
    dt = torch.promote_types(q.dtype, torch.float32)

    def to_blocks(x):
        return _gather(x, layout)

    fq, fk = phi(q.to(dt)), phi(k.to(dt))
    rq, rk = (apply_rope(fq, rope), apply_rope(fk, rope)) if rope is not None else (fq, fk)
    mix = mix.to(dt)

    sums = [torch.einsum("bhmld,bhmle->bhmde", to_blocks(rk), to_blocks(v.to(dt)))]
    if options.normalize:
        sums.append(to_blocks(fk).sum(dim=3))
    if combine is not None:
        sums = combine(sums)
    mixed = torch.einsum("im,bhmde->bhide", mix, sums[0])
    out = torch.einsum("bhmld,bhmde->bhmle", to_blocks(rq), mixed)
    if options.normalize:
        z = torch.einsum("im,bhmd->bhid", mix, sums[1])
        den = torch.einsum("bhmld,bhmd->bhml", to_blocks(fq), z)
        out = out / (den.unsqueeze(-1) + options.eps)
    out = out.flatten(2, 3)[:, :, layout.token_slot]  # back to raster order: (B, h, N, D)
    return out.transpose(1, 2).to(v.dtype)


# ----------------------------------------------------------------------------- plain meaning of each launcher
# `g` is the launchers' `kernels.mhla.Geometry` (B, heads, grid, blocks); summaries are block-major (M, B*h, ...).


def _to_blocks(x, g):
    """(B, N, h, C) -> (B*h, M, Lmax, C), zeros in padding slots."""
    return _gather(x, block_layout(g.grid, g.blocks, x.device)).flatten(0, 1)


def _from_blocks(xb, g):
    """(B*h, M, Lmax, C) -> (B, N, h, C)."""
    lay = block_layout(g.grid, g.blocks, xb.device)
    return xb.flatten(1, 2)[:, lay.token_slot].unflatten(0, (g.B, g.heads)).transpose(1, 2)


def _per_token(t, g):
    """A (B*h, N) per-token scalar as a (B, N, h, 1) tensor."""
    return t.unflatten(0, (g.B, g.heads)).transpose(1, 2).unsqueeze(-1)


def _ref_features(x, rope, elu: bool):
    fx = feature_map("elu" if elu else "relu")(x.double())
    return fx, (apply_rope(fx, rope) if rope is not None else fx)


def reference_summaries(x, y, rope, g, *, elu: bool, y_scale=None, z_weight=None):
    fx, rx = _ref_features(x, rope, elu)
    y = y.double() * (_per_token(y_scale, g) if y_scale is not None else 1)
    fx = fx * (_per_token(z_weight, g) if z_weight is not None else 1)
    s = torch.einsum("bmld,bmle->mbde", _to_blocks(rx, g), _to_blocks(y, g))
    return s, _to_blocks(fx, g).sum(2).transpose(0, 1)


def reference_output(q, mixed_s, mixed_z, rope, g, *, elu: bool, normalize: bool, eps: float):
    fq, rq = _ref_features(q, rope, elu)
    out = torch.einsum("bmld,mbde->bmle", _to_blocks(rq, g), mixed_s.double())
    if normalize:
        out = out / (torch.einsum("bmld,mbd->bml", _to_blocks(fq, g), mixed_z.double()).unsqueeze(-1) + eps)
    return _from_blocks(out, g)


def reference_grad(x, y, mat, vec, rope, g, *, elu: bool, stats: bool, use_vec: bool, eps: float):
    """(dx, dy, rden, c) as `mhla.block_grad` defines them, by autograd through the block products."""
    x = x.double().requires_grad_()
    fx, rx = _ref_features(x, rope, elu)
    mat, vec = mat.double().transpose(0, 1), vec.double().transpose(0, 1)  # block-major -> (B*h, M, ...)
    p = _from_blocks(torch.einsum("bmle,bmde->bmld", _to_blocks(y.double(), g), mat), g)
    dy = _from_blocks(torch.einsum("bmld,bmde->bmle", _to_blocks(rx.detach(), g), mat), g)
    zvec = _from_blocks(vec.unsqueeze(2).expand(-1, -1, _to_blocks(x, g).shape[2], -1), g)
    rden = c = None
    weight = 1.0
    if stats:
        rden = 1.0 / ((fx.detach() * zvec).sum(-1, keepdim=True) + eps)
        c = -(rx.detach() * p).sum(-1, keepdim=True) * rden**2
        p, weight = p * rden, c
    loss = (rx * p).sum() + ((fx * zvec * weight).sum() if use_vec else 0)
    (dx,) = torch.autograd.grad(loss, x)
    flat = lambda t: t.squeeze(-1).transpose(1, 2).flatten(0, 1) if t is not None else None  # noqa: E731
    return dx, dy, flat(rden), flat(c)
