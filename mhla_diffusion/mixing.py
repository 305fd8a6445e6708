"""Per-layer mixing matrices, non-negative and row-normalized by construction."""

from __future__ import annotations

import torch
from torch import nn

from .blocks import as_blocks, locality_mix

FLOOR = 1e-4  # zeros of the init become this before the log: softmax rows are strictly positive


def block_key(blocks) -> str:
    return "x".join(str(n) for n in as_blocks(blocks))


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


class MixingMatrices(nn.Module):
    """Row-softmax of learned logits, one (M, M) matrix per block grid.

    The logits start at log(max(Mc0, FLOOR)), so the first forward reproduces the init up to
    the floor; rows stay in (0, 1) and sum to 1 through any optimizer step (MHLA_SPEC.md, s. 2).
    With blocks="auto" a matrix is created the first time a block grid is seen.
    """

    def __init__(self, mix_init: str = "locality", blocks=()):
        super().__init__()
        self.mix_init = mix_init
        self.logits = nn.ParameterDict()
        for b in blocks:
            self.add(b)

    def add(self, blocks, device=None) -> nn.Parameter:
        key = block_key(blocks)
        if key not in self.logits:
            self._create(key, blocks, device)
        return self.logits[key]

    @torch.compiler.disable
    def _create(self, key: str, blocks, device) -> None:
        """A new Parameter is a side effect: made eagerly, never traced into a compiled graph
        (torch.compile breaks the graph once here, then recompiles with the matrix in place)."""
        init = initial_mix(blocks, self.mix_init).clamp_min(FLOOR).log()
        self.logits[key] = nn.Parameter(init.to(device=device, dtype=torch.float32))

    def forward(self, blocks, device=None) -> torch.Tensor:
        """The (M, M) fp32 mixing matrix for `blocks`."""
        return self.add(blocks, device).float().softmax(dim=-1)
