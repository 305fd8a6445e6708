"""The RMSNorms around an MHLA call, which the Triton kernels can apply on the way instead of as passes of their own.

Wan's self-attention normalizes q and k across all heads before attention (`norm_q`, `norm_k`: `torch.nn.RMSNorm`
over heads*D) and MHLA's output norm normalizes each head's output (gain (heads, Dv)). Each is a pass over a
(B, N, heads*D) tensor: at Wan2.1-1.3B 480p about as much GPU time per layer as the MHLA op itself. `Norms` carries
them into the op; where the kernels cannot fuse them (gradients, the reference, a context-parallel slice) `inputs`
and `output` apply them in PyTorch, exactly as the layer's modules do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

OUTPUT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Norms:
    """q_weight, k_weight: RMSNorm weights over heads*D (both or neither), qk_eps their eps; out_gain: the per-head
    output RMSNorm's (heads, Dv) gain, or None."""

    q_weight: Optional[torch.Tensor] = None
    k_weight: Optional[torch.Tensor] = None
    qk_eps: float = 1e-6
    out_gain: Optional[torch.Tensor] = None
    out_eps: float = OUTPUT_NORM_EPS

    @property
    def tensors(self) -> tuple:
        return tuple(t for t in (self.q_weight, self.k_weight, self.out_gain) if t is not None)

    def inputs(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, N, heads, D) normalized across heads, as `torch.nn.RMSNorm(heads * D)` does."""
        if self.q_weight is None:
            return q, k
        return tuple(F.rms_norm(x.flatten(2), (x.shape[2] * x.shape[3],), w, self.qk_eps).view_as(x)
                     for x, w in ((q, self.q_weight), (k, self.k_weight)))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, N, heads, Dv) normalized per head and scaled by the gain (fp32 inside the norm)."""
        if self.out_gain is None:
            return out
        return F.rms_norm(out, (out.shape[-1],), eps=self.out_eps) * self.out_gain.to(out.dtype)


def _bypassable(norm: nn.Module) -> bool:
    """A plain affine `torch.nn.RMSNorm` without hooks: its weight is all there is to it (an offloading hook, as
    accelerate's, moves the weight onto the device in the module's own forward)."""
    return (type(norm) is nn.RMSNorm and norm.weight is not None and not norm._forward_hooks
            and not norm._forward_pre_hooks and getattr(norm, "_hf_hook", None) is None)


def apply_qk_norm(q, k, qk_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, N, heads, D) through the layer's (norm_q, norm_k) modules across heads, as the layer calls them."""
    if qk_norm is None:
        return q, k
    return tuple(m(x.flatten(2)).view_as(x) for m, x in zip(qk_norm, (q, k)))


def layer_norms(q, k, qk_norm, out_gain) -> tuple[torch.Tensor, torch.Tensor, Optional[Norms]]:
    """(q, k, norms) for a layer whose q, k (B, N, heads, D) are still to be normalized by `qk_norm` = (norm_q,
    norm_k) across heads (or None) and whose output by `out_gain`: the norms the op can apply go into `norms`;
    modules it cannot bypass run here, on q and k."""
    if qk_norm is not None and not (all(_bypassable(m) for m in qk_norm) and qk_norm[0].eps == qk_norm[1].eps):
        q, k, qk_norm = *apply_qk_norm(q, k, qk_norm), None
    if qk_norm is None and out_gain is None:
        return q, k, None
    if qk_norm is None:
        return q, k, Norms(out_gain=out_gain)
    norm_q, norm_k = qk_norm
    eps = norm_q.eps if norm_q.eps is not None else torch.finfo(q.dtype).eps
    return q, k, Norms(norm_q.weight, norm_k.weight, float(eps), out_gain)
