"""RMSNorms of the rows of a (rows, groups * width) tensor, each group of `width` features normalized on its own and
scaled by its slice of an fp32 weight: one read of x and one write of y forward, one read of x and dy and one write of
dx backward (with per-program partial sums of the weight's gradient).

Why: a Wan layer's q/k norms across heads (one group of heads * D) and MHLA's per-head output norm (heads groups of
Dv) run around the op in training, where the kernels cannot apply them on the way (the fused norms are forward only).
As PyTorch passes under autocast (bf16 x, fp32 weight: torch's fused rms_norm takes matching types only) a q/k norm
at Wan2.1-1.3B 480p took 0.675 ms forward and 2.21 ms forward+backward on an H200; these kernels 0.078 / 0.770, both
timed eagerly (the 0.770 mostly host time: the training step's profile puts the backward kernel under 0.18 ms a
call). The PyTorch formula is `ops.norms.Norms`' own, which the tests hold these kernels to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compiled
from .sizes import cdiv, pow2

# tile: elements (rows x padded row) per program (forward) and per step of a program's walk (backward, whose
# programs_per_sm programs per SM each sum their share of the weight's gradient), at least one row
CONFIG = {"forward": dict(tile=8192, num_warps=8),
          "backward": dict(tile=8192, num_warps=8, programs_per_sm=4)}


@triton.jit
def _tile(x_ptr, r, rows, g, groups, s, width):
    """Offsets and mask of the (ROWS, groups, width) tile of rows r."""
    offs = r.to(tl.int64)[:, None, None] * (groups * width) + (g * width)[None, :, None] + s[None, None, :]
    mask = (r < rows)[:, None, None] & (g < groups)[None, :, None] & (s < width)[None, None, :]
    return x_ptr + offs, mask


@triton.jit
def _forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, groups, width, eps,
                    ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_S)
    x_at, mask = _tile(x_ptr, r, rows, g, groups, s, width)
    x = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=2) / width + eps)
    w_at, w_mask = _tile(w_ptr, tl.zeros((1,), tl.int32), 1, g, groups, s, width)
    w = tl.load(w_at, mask=w_mask, other=0.0).to(tl.float32)
    y_at, _ = _tile(y_ptr, r, rows, g, groups, s, width)
    tl.store(y_at, (x * rstd[:, :, None] * w).to(y_ptr.dtype.element_ty), mask=mask)
    rstd_at = r.to(tl.int64)[:, None] * groups + g[None, :]
    tl.store(rstd_ptr + rstd_at, rstd, mask=(r < rows)[:, None] & (g < groups)[None, :])


@triton.jit
def _backward_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, groups, width,
                     ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """dx = rstd (w dy - x^ mean(w dy x^)) per group, x^ = x rstd; this program's rows' sum of dy x^ into its row
    of dw (the launcher sums the programs' rows)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    g, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_S)
    w_at, w_mask = _tile(w_ptr, tl.zeros((1,), tl.int32), 1, g, groups, s, width)
    w = tl.load(w_at, mask=w_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((1, BLOCK_G, BLOCK_S), tl.float32)
    for start in range(pid * ROWS, rows, programs * ROWS):
        r = start + tl.arange(0, ROWS)
        x_at, mask = _tile(x_ptr, r, rows, g, groups, s, width)
        dy_at, _ = _tile(dy_ptr, r, rows, g, groups, s, width)
        x = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_at, mask=mask, other=0.0).to(tl.float32)
        rstd_at = r.to(tl.int64)[:, None] * groups + g[None, :]
        rstd = tl.load(rstd_ptr + rstd_at, mask=(r < rows)[:, None] & (g < groups)[None, :], other=0.0)
        xhat = x * rstd[:, :, None]
        wdy = w * dy
        mean = tl.sum(wdy * xhat, axis=2) / width
        dx_at, _ = _tile(dx_ptr, r, rows, g, groups, s, width)
        tl.store(dx_at, ((wdy - xhat * mean[:, :, None]) * rstd[:, :, None]).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)[None, :, :]
    dw_at, _ = _tile(dw_ptr, tl.full((1,), pid, tl.int32), programs, g, groups, s, width)
    tl.store(dw_at, dw, mask=w_mask)


def _launch(kernel: str, groups: int, width: int) -> dict:
    cfg = CONFIG[kernel]
    block_g, block_s = pow2(groups), pow2(width)
    return dict(ROWS=max(1, cfg["tile"] // (block_g * block_s)), BLOCK_G=block_g, BLOCK_S=block_s,
                num_warps=cfg["num_warps"])


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float):
    """(y, rstd) of x (rows, groups * width), contiguous: y in x's dtype, rstd (rows, groups) fp32."""
    rows, features = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty((rows, groups), device=x.device, dtype=torch.float32)
    settings = _launch("forward", groups, features // groups)
    compiled.launch(_forward_kernel, (cdiv(rows, settings["ROWS"]),), x, weight, y, rstd, rows, groups,
                    features // groups, eps, **settings)
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, groups: int):
    """(dx, dweight) of `rms_norm_forward`'s y = f(x, weight) for dy (rows, groups * width), contiguous."""
    rows, features = x.shape
    settings = _launch("backward", groups, features // groups)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    programs = max(1, min(cdiv(rows, settings["ROWS"]), CONFIG["backward"]["programs_per_sm"] * sms))
    dx = torch.empty_like(x)
    dw = torch.empty((programs, features), device=x.device, dtype=torch.float32)
    compiled.launch(_backward_kernel, (programs,), x, weight, dy, rstd, dx, dw, rows, groups, features // groups,
                    **settings)
    return dx, dw.sum(0).to(weight.dtype)
