"""The RMSNorms around an MHLA call, which the Triton kernels can apply on the way instead of as passes of their own.

Wan's self-attention normalizes q and k across all heads before attention (`norm_q`, `norm_k`: `torch.nn.RMSNorm`
over heads*D) and MHLA's output norm normalizes each head's output (gain (heads, Dv)). Each is a pass over a
(B, N, heads*D) tensor: at Wan2.1-1.3B 480p about as much GPU time per layer as the MHLA op itself. `Norms` carries
them into the op; where the kernels cannot fuse them (gradients, autocast, the reference, a context-parallel slice)
`inputs` and `output` apply them around it, as the layer's modules do (in the backend's RMSNorm kernels where it
has them: one launch each way, with gradients); a norm module that anything expects to run
(a hook, an offloading hook, a patched forward) or whose eps is left to its dtype runs itself (`layer_norms`).
One case sees both numerics: reentrant gradient checkpointing runs the forward without autograd (fused) and its
recomputation with it (the norms around the op), so the loss and its gradients differ at bf16 rounding (diffusers
checkpoints non-reentrantly, which recomputes the same way twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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

    def inputs(self, q: torch.Tensor, k: torch.Tensor,
               fused: Optional[Callable] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, N, heads, D) normalized across heads, as `torch.nn.RMSNorm(heads * D)` does. fused: a backend's
        `(x, weight, groups, eps) -> y` (`dispatch.Backend.rms_norm`), else PyTorch's passes."""
        if self.q_weight is None:
            return q, k
        if fused is not None:
            return tuple(fused(x.flatten(2), w, 1, self.qk_eps).view_as(x) for x, w in ((q, self.q_weight),
                                                                                    (k, self.k_weight)))
        return tuple(F.rms_norm(x.flatten(2), (x.shape[2] * x.shape[3],), w, self.qk_eps).view_as(x)
                     for x, w in ((q, self.q_weight), (k, self.k_weight)))

    def output(self, out: torch.Tensor, fused: Optional[Callable] = None) -> torch.Tensor:
        """out (B, N, heads, Dv) normalized per head and scaled by the gain (fp32 inside the norm); fused as in
        `inputs`."""
        if self.out_gain is None:
            return out
        if fused is not None:
            return fused(out.flatten(2), self.out_gain, out.shape[2], self.out_eps).view_as(out)
        return F.rms_norm(out, (out.shape[-1],), eps=self.out_eps) * self.out_gain.to(out.dtype)


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _bypassable(norm: nn.Module, width: int) -> bool:
    """A plain affine `torch.nn.RMSNorm` over `width` features with a set eps, and nothing that expects its
    forward to run: no module hook of torch's, accelerate's (`_hf_hook`) or diffusers' (`_diffusers_hook`, group
    offloading: both move the weight onto the device inside that forward), no forward patched on the instance,
    no global module hook."""
    if type(norm) is not nn.RMSNorm or norm.weight is None or norm.eps is None:
        return False
    if tuple(norm.normalized_shape) != (width,) or "forward" in vars(norm):
        return False
    if any(getattr(norm, name) for name in _MODULE_HOOKS):
        return False
    if getattr(norm, "_hf_hook", None) is not None or getattr(norm, "_diffusers_hook", None) is not None:
        return False
    return not any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS)


def apply_qk_norm(q, k, qk_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, N, heads, D) through the layer's (norm_q, norm_k) modules across heads, as the layer calls them."""
    if qk_norm is None:
        return q, k
    return tuple(m(x.flatten(2)).view_as(x) for m, x in zip(qk_norm, (q, k)))


def layer_norms(q, k, qk_norm, out_gain) -> tuple[torch.Tensor, torch.Tensor, Optional[Norms]]:
    """(q, k, norms) for a layer whose q, k (B, N, heads, D) are still to be normalized by `qk_norm` = (norm_q,
    norm_k) across heads (or None) and whose output by `out_gain`: the norms the op can apply go into `norms`;
    modules it cannot bypass run here, on q and k."""
    width = q.shape[2] * q.shape[3]
    if qk_norm is not None and not (all(_bypassable(m, width) for m in qk_norm) and qk_norm[0].eps == qk_norm[1].eps):
        q, k, qk_norm = *apply_qk_norm(q, k, qk_norm), None
    if qk_norm is None and out_gain is None:
        return q, k, None
    if qk_norm is None:
        return q, k, Norms(out_gain=out_gain)
    norm_q, norm_k = qk_norm
    return q, k, Norms(norm_q.weight, norm_k.weight, float(norm_q.eps), out_gain)
