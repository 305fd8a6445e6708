"""The op's one backend choice: each backend lists the calls it can take, and says why not for the others.

A backend is a function of (q, k, v, mix, geometry, options, rope, group, mix_logits) and its constraints, each a
check of one capability (device, dtype, head dims, feature map, block length) returning
why the call is out of reach, or None. "auto" takes the first backend in `BACKENDS` whose constraints all
pass; an explicit backend whose constraint fails raises that reason. (diffusers' attention_dispatch.py
registers its attention backends with constraint checks the same way.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..blocks import BlockGeometry, eager_cache
from ..kernels import capabilities as triton_caps
from ..mixing import mixing_matrix
from .context_parallel import mhla_sharded, mhla_sharded_triton
from .naive import mhla_blocked
from .norms import Norms
from .options import MHLAOptions


@dataclass(frozen=True)
class Backend:
    """`run(q, k, v, mix, geometry, options, rope, group, mix_logits)` (mix_logits: mix holds the mixing matrix's
    logits, `mixing.mixing_matrix`), and the constraints a call must meet for it; `run_with_norms(q, k, v, mix,
    geometry, options, rope, norms, mix_logits)`, where the backend applies a layer's RMSNorms (`ops.norms`) itself
    on the way;
    `rms_norm(x, weight, groups, eps)`, where it has its own kernels for those norms around the op."""

    run: Callable
    constraints: tuple = ()
    run_with_norms: Optional[Callable] = None
    rms_norm: Optional[Callable] = None

    def refusal(self, q, k, v, geometry, options) -> Optional[str]:
        """The first failed constraint's reason, or None when the backend takes the call."""
        for check in self.constraints:
            reason = check(q, k, v, geometry, options)
            if reason is not None:
                return reason
        return None


def _run_torch(q, k, v, mix, geometry, options, rope, group, mix_logits):
    mix = mixing_matrix(mix, mix_logits)
    if group is None:
        return mhla_blocked(q, k, v, mix, geometry.layout(q.device), options, rope)
    return mhla_sharded(q, k, v, mix, geometry, options, rope, group)


def _run_triton(q, k, v, mix, geometry, options, rope, group, mix_logits):
    if group is not None:
        return mhla_sharded_triton(q, k, v, mixing_matrix(mix, mix_logits), geometry, options, rope, group)
    # imported on first use, so the library imports without triton's start-up cost; a plain import
    # statement, which torch.compile traces (import_module it refuses)
    from ..kernels import op

    return op.mhla_attention_triton(q, k, v, mix, geometry, options, rope, mix_logits=mix_logits)


def _run_triton_with_norms(q, k, v, mix, geometry, options, rope, norms, mix_logits):
    from ..kernels import op

    return op.mhla_attention_triton(q, k, v, mix, geometry, options, rope, norms=norms, mix_logits=mix_logits)


def _triton_rms_norm(x, weight, groups, eps):
    from ..kernels import op

    return op.grouped_rms_norm(x, weight, groups, eps)


def _triton_device(q, k, v, geometry, options):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if q.device.type != triton_caps.DEVICE:
        return f"tensors are on {q.device.type}; the Triton kernels need CUDA (or TRITON_INTERPRET=1 on CPU)"
    if torch.version.hip is not None:
        return "this is a ROCm build of PyTorch; the Triton kernels are built and checked for NVIDIA GPUs only"
    return _card_refusal(q.device)


@eager_cache(maxsize=16)
def _card_refusal(device: torch.device) -> Optional[str]:
    """Why the card at `device` cannot run the kernels, or None. Read once a device in eager calls: a card's
    properties do not change, and reading them took 31 of an eager DiT layer's 626 us of host time (GPU host,
    cProfile, session 42); torch.compile traces the read and folds it to a constant."""
    card = torch.cuda.get_device_properties(device)
    if (card.major, card.minor) < triton_caps.MIN_CAPABILITY:
        major, minor = triton_caps.MIN_CAPABILITY
        return (f"{card.name} has compute capability {card.major}.{card.minor}; the Triton kernels need "
                f"{major}.{minor} (Ampere) or newer, as Triton does")
    return None


def _triton_dtype(q, k, v, geometry, options):
    if q.dtype == k.dtype == v.dtype and q.dtype in triton_caps.DTYPES:
        return None
    return f"q, k, v must share one dtype of {triton_caps.DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"


def _triton_head_dims(q, k, v, geometry, options):
    step, top = triton_caps.HEAD_DIM_MULTIPLE, triton_caps.MAX_HEAD_DIM
    low = triton_caps.MIN_HEAD_DIM_16BIT if q.element_size() == 2 else step
    for name, dim in (("D", q.shape[-1]), ("D_v", v.shape[-1])):
        if dim % step or dim > top:
            return f"head dim {name} = {dim} must be a multiple of {step} up to {top}"
        if dim < low:
            return f"head dim {name} = {dim} must be at least {low} in {str(q.dtype).replace('torch.', '')} (16-bit tensor-core products)"
    return None


def _triton_feature(q, k, v, geometry, options):
    if options.feature in triton_caps.FEATURES:
        return None
    return f"the Triton kernels compute the feature maps {triton_caps.FEATURES}, not {options.feature!r}"


def _triton_block_length(q, k, v, geometry, options):
    if geometry.max_len < triton_caps.MAX_BLOCK_TOKENS:
        return None
    return (f"blocks {geometry.blocks} of grid {geometry.grid} hold up to {geometry.max_len} tokens; the Triton kernels "
            f"index blocks of fewer than {triton_caps.MAX_BLOCK_TOKENS} (use more blocks)")


# In "auto" order: the fused kernels where they apply, the reference (which takes every call) otherwise.
BACKENDS = {
    "triton": Backend(_run_triton, (_triton_device, _triton_dtype, _triton_head_dims, _triton_feature,
                                    _triton_block_length), _run_triton_with_norms, _triton_rms_norm),
    "torch": Backend(_run_torch),
}


def check_inputs(q, k, v, mix, geometry: BlockGeometry, sharded: bool) -> None:
    """Shapes of one call against its geometry (a sharded call's token slice is checked by `mhla_sharded`)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k, v must be (B, N, heads, D) with matching B, N, heads; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not sharded and q.shape[1] != geometry.num_tokens:
        raise ValueError(f"token grid {geometry.grid} holds {geometry.num_tokens} tokens but q has N = {q.shape[1]}")
    m = geometry.num_blocks
    if tuple(mix.shape) != (m, m):
        raise ValueError(f"mix must be ({m}, {m}) for block grid {geometry.blocks}, got {tuple(mix.shape)}")


def choose(backend: str, q, k, v, geometry, options) -> Backend:
    """The backend that runs this call: `backend` itself if it takes it, for "auto" the first that does."""
    if backend == "auto":
        for candidate in BACKENDS.values():
            if candidate.refusal(q, k, v, geometry, options) is None:
                return candidate
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
    reason = BACKENDS[backend].refusal(q, k, v, geometry, options)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this call: {reason}; backend='auto' falls back to "
                         "the PyTorch reference")
    return BACKENDS[backend]


def _fuses(chosen: Backend, norms: Norms, q, k, v, mix, rope, group) -> bool:
    """Whether `chosen` applies `norms` itself (asked outside autocast only): kernels that do, an unsharded call,
    weights on q's device, and no gradient wanted (the fused norms are forward only)."""
    tensors = (q, k, v, mix, *norms.tensors, *(rope or ()))
    return (chosen.run_with_norms is not None and group is None and all(t.device == q.device for t in norms.tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


# Device types with an autocast, read once here: torch 2.11's Dynamo cannot trace torch.amp.is_autocast_available, and
# asked in each call it broke a compiled model's graph at every converted layer (DiT-XL/2 512 px with CUDA graphs:
# 4.83 ms original, 21.6 ms converted; H100, session 40).
AUTOCAST_DEVICE_TYPES = frozenset(kind for kind in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla",
                                                    torch._C._get_privateuse1_backend_name())
                                  if torch.amp.is_autocast_available(kind))


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The type autocast runs attention in on `device`, or None where it is off (or has no autocast: meta)."""
    kind = device.type
    if kind not in AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _autocast_inputs(q, k, v, dtype: Optional[torch.dtype]):
    """q, k, v as autocast hands SDPA its inputs: floating tensors but fp64 in autocast's type, so the output is in
    that type too. A layer whose q, k come out fp32 beside bf16 v (a norm that returns fp32) ran the PyTorch
    reference, as the Triton path takes one dtype only. (torch 2.11's rms_norm returns bf16 under bf16 autocast,
    on CPU and CUDA alike.)"""
    if dtype is None:
        return q, k, v
    return tuple(t if t.dtype == torch.float64 else t.to(dtype) for t in (q, k, v))


def mhla_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mix: torch.Tensor, geometry: BlockGeometry,
            options: MHLAOptions, *, rope=None, backend: str = "auto", group=None,
            norms: Optional[Norms] = None, mix_logits: bool = False) -> torch.Tensor:
    """`mhla_attention` with the block geometry and options already resolved (processors build both once).
    norms: RMSNorms of the layer around the op (q, k before it, its output after), applied by the kernels on the
    way where they can (`_fuses`), in PyTorch before and after otherwise. mix_logits: as `mhla_attention`'s."""
    sharded = group is not None
    check_inputs(q, k, v, mix, geometry, sharded)
    autocast = _autocast_dtype(q.device)
    q, k, v = _autocast_inputs(q, k, v, autocast)  # under autocast the norms and the op run in autocast's type
    chosen = choose(backend, q, k, v, geometry, options)
    if norms is None:
        return chosen.run(q, k, v, mix, geometry, options, rope, group, mix_logits)
    if autocast is None and _fuses(chosen, norms, q, k, v, mix, rope, group):
        return chosen.run_with_norms(q, k, v, mix, geometry, options, rope, norms, mix_logits)
    fused = chosen.rms_norm if all(t.device == q.device for t in norms.tensors) else None
    q, k = norms.inputs(q, k, fused)
    if fused is None:  # PyTorch's passes may return another type than they were given (session 28 assumed
        # autocast's rms_norm returns fp32): the op runs in autocast's type, or is chosen for what they returned
        q, k, v = _autocast_inputs(q, k, v, autocast)
        chosen = choose(backend, q, k, v, geometry, options)
    return norms.output(chosen.run(q, k, v, mix, geometry, options, rope, group, mix_logits), fused)
