"""Per-layer mixing matrices, non-negative and row-normalized by construction."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import as_blocks, locality_mix

FLOOR = 1e-4  # zeros of the init become this before the log: softmax rows are strictly positive


def initial_mix(blocks, mix_init: str) -> torch.Tensor:
    """The (M, M) matrix a new layer starts from (float64)."""
    bt, bh, bw = as_blocks(blocks)
    m = bt * bh * bw
    if mix_init == "locality":
        return locality_mix(blocks)
    if mix_init == "uniform":
        return torch.full((m, m), 1.0 / m, dtype=torch.float64)
    if mix_init == "identity":
        return torch.eye(m, dtype=torch.float64)
    raise ValueError(f"unknown mix_init {mix_init!r}")


def initial_logits(blocks, mix_init: str) -> torch.Tensor:
    """fp32 logits whose row-softmax is the init (up to FLOOR)."""
    return initial_mix(blocks, mix_init).clamp_min(FLOOR).log().float()


def mixing_matrix(mix: torch.Tensor, logits: bool) -> torch.Tensor:
    """The mixing matrix from what an op call was given: `mix` itself, or with `logits` the row softmax of that logit
    matrix, in fp32 (fp64 for fp64 logits): the matrix `MixingMatrices` makes."""
    if not logits:
        return mix
    return mix.to(torch.promote_types(mix.dtype, torch.float32)).softmax(dim=-1)


def resample_logits(logits: torch.Tensor, src, dst) -> torch.Tensor:
    """(M_src, M_src) logits over block grid `src` -> (M_dst, M_dst) over `dst`.

    Row i, column j hold the logit of query block i for key block j; both indices are points of a
    3-D block grid, so the matrix is resampled like a pair of position embeddings: trilinearly at
    block centres (align_corners=False), first along the key blocks, then along the query blocks.
    """
    src, dst = as_blocks(src), as_blocks(dst)
    if src == dst:
        return logits
    m_src, m_dst = math.prod(src), math.prod(dst)
    x = logits.float().reshape(m_src, 1, *src)
    x = F.interpolate(x, size=dst, mode="trilinear", align_corners=False).reshape(m_src, m_dst)
    x = x.t().reshape(m_dst, 1, *src)
    return F.interpolate(x, size=dst, mode="trilinear", align_corners=False).reshape(m_dst, m_dst).t()


class MixingMatrices(nn.Module):
    """Row-softmax of one learned logit matrix, defined on the block grid `mix_blocks`.

    The logits start at log(max(Mc0, FLOOR)), so at `mix_blocks` the first forward reproduces the
    init up to the floor; rows stay in (0, 1) and sum to 1 through any optimizer step
    (docs/MHLA.md, section 2). Calls on another block grid read the logits resampled to it
    (`resample_logits`): one parameter for every resolution, created here and never later.
    """

    def __init__(self, mix_init: str, mix_blocks):
        super().__init__()
        self.mix_init, self.mix_blocks = mix_init, as_blocks(mix_blocks)
        self.logits = nn.Parameter(initial_logits(self.mix_blocks, mix_init))
        self._reused = None  # (what it was computed from, the matrix): `for_op` without gradients

    def extra_repr(self) -> str:
        return f"mix_blocks={self.mix_blocks}"

    def forward(self, blocks) -> torch.Tensor:
        """The (M, M) fp32 mixing matrix for the block grid `blocks` of one call (`for_op`'s, softmaxed where it
        hands the logits)."""
        return mixing_matrix(*self.for_op(blocks))

    def for_op(self, blocks) -> tuple[torch.Tensor, bool]:
        """(mix, whether it holds logits) for one op call on the block grid `blocks` (`mhla_op(..., mix_logits=)`).

        Where no gradient reaches the logits (inference, a frozen matrix), the matrix, the last one reused while the
        logits are the same tensor at the same version (an optimizer step, `load_state_dict` or `.to()` each make a
        new one): resampling costs two interpolation kernels a layer, 13 us against the op's 22 at DiT-XL/2 512 px
        (H100, session 40). Elsewhere (with gradients; inside torch.compile, where a traced cache would be guarded on
        every call) the logits at `blocks`, which the kernels softmax where they read them: in a compiled DiT-XL/2
        512 px model that softmax was a launch of its own, 1.4 us a layer beside the op's 21 (H100, session 42)."""
        logits = self.logits  # once: each attribute read of a parameter goes through nn.Module.__getattr__
        if (torch.is_grad_enabled() and logits.requires_grad) or torch.compiler.is_compiling():
            return resample_logits(logits, self.mix_blocks, blocks), True
        # `blocks` as the caller spelled it (a grid spelled another way recomputes, as it should give the same matrix)
        source = (blocks, logits.data_ptr(), logits._version, logits.dtype, logits.device,
                  torch.is_inference_mode_enabled())
        reused = self._reused
        if reused is None or reused[0] != source:
            self._reused = reused = (source, self._matrix(blocks))
        return reused[1], False

    def _matrix(self, blocks) -> torch.Tensor:
        return mixing_matrix(resample_logits(self.logits, self.mix_blocks, blocks), logits=True)

    @torch.no_grad()
    def drift(self) -> dict:
        """How far training moved the matrix at `mix_blocks`: mean |Mc - Mc0| / mean Mc0, and the mean
        row entropy of Mc and of Mc0 (nats; log M is uniform, 0 one block only)."""
        mc = self(self.mix_blocks).double().cpu()  # beside the init, wherever the model lives
        mc0 = initial_logits(self.mix_blocks, self.mix_init).double().softmax(dim=-1)
        entropy = lambda m: -(m * m.clamp_min(1e-300).log()).sum(-1).mean().item()  # noqa: E731
        return {"change": ((mc - mc0).abs().mean() / mc0.mean()).item(), "entropy": entropy(mc), "init_entropy": entropy(mc0)}
