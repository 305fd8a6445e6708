"""The MHLA processor core, and the processor of diffusers' generic `Attention` (DiT, PixArt).

Family-specific processors (SANA's, Wan's) live in their family modules (`families/`).

Each processor is an nn.Module (one instance per converted layer) so its mixing matrix and
optional output norm/gate reach `named_parameters()`, optimizers and `save_pretrained`. It
reuses the layer's own q/k/v/out projections and q/k norms. The token grid of each call comes
from a `TokenGrid` that a forward pre-hook on the transformer fills in (models pass no grid).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import block_geometry
from .config import MHLAConfig
from .mixing import MixingMatrices
from .ops import MHLAOptions, mhla_op
from .ops.norms import layer_norms
from .ops.context_parallel import context_group

# silu(b) = 1 at b = 1 + W(1/e): a zero-weight gate with this bias starts fully open.
GATE_OPEN_BIAS = 1.278464542761074


class TokenGrid:
    """The post-patch (T, H, W) token grid of the transformer call in flight.

    One per converted transformer, held by the model and its processors alike (plain attributes),
    so `copy.deepcopy` and pickling give the copy its own grid, shared by its own processors.
    """

    def __init__(self):
        self.grid: tuple[int, int, int] | None = None


class MHLAProcessorBase(nn.Module):
    """Shared state and the MHLA core; subclasses map a layer's projections onto it."""

    _parallel_config = None  # set by diffusers' enable_parallelism: q, k, v then hold one rank's token slice

    def __init__(self, config: MHLAConfig, heads: int, head_dim: int, dim: int, token_grid: TokenGrid):
        super().__init__()
        self.config = config
        self.options = MHLAOptions.from_config(config)
        self.heads, self.head_dim = heads, head_dim
        if config.mix_blocks is None:
            raise ValueError("MHLAConfig.mix_blocks is unset: build processors with mhla_diffusion.mhla_processors")
        self.mixing = MixingMatrices(config.mix_init, config.mix_blocks)
        self.norm_gain = nn.Parameter(torch.ones(heads, head_dim)) if config.output_norm else None
        self.gate = None
        if config.output_gate:
            self.gate = nn.Linear(dim, heads * head_dim)
            nn.init.zeros_(self.gate.weight)
            nn.init.constant_(self.gate.bias, GATE_OPEN_BIAS)
        self.token_grid = token_grid  # plain object, not a submodule

    def extra_repr(self) -> str:
        c = self.config
        return f"blocks={c.blocks}, feature={c.feature}, normalize={c.normalize}, heads={self.heads}"

    def current_grid(self, num_tokens: int) -> tuple[int, int, int]:
        grid = self.token_grid.grid
        if grid is None:
            raise RuntimeError(
                "MHLA processor called outside a transformer forward: the token grid is unknown. "
                "Call the transformer (its pre-hook publishes the grid), or set processor.token_grid.grid."
            )
        if self._parallel_config is None and math.prod(grid) != num_tokens:  # a rank's slice is checked when sharded
            raise RuntimeError(f"self-attention got {num_tokens} tokens but the transformer's token grid {grid} holds {math.prod(grid)}")
        return grid

    def attend(self, q, k, v, layer_input, rope=None, qk_norm=None) -> torch.Tensor:
        """q, k, v: (B, N, heads, D) after the layer's projections -> (B, N, heads*D). qk_norm: the layer's
        `torch.nn.RMSNorm` modules across heads for q and k, still to apply (the kernels can, on the way); any other
        q/k norm the processor applies before. The output norm goes into the op too (`ops.norms`)."""
        geometry = block_geometry(self.current_grid(q.shape[1]), self.config.blocks)
        rope = rope if self.config.rope == "numerator" else None
        group = None if self._parallel_config is None else context_group(self._parallel_config)
        q, k, norms = layer_norms(q, k, qk_norm, self.norm_gain)
        mix, logits = self.mixing.for_op(geometry.blocks)
        out = mhla_op(q, k, v, mix, geometry, self.options, rope=rope, group=group, norms=norms, mix_logits=logits)
        out = out.flatten(2)
        if self.gate is not None:
            out = out * F.silu(self.gate(layer_input)).to(out.dtype)
        return out


class MHLAAttnProcessor(MHLAProcessorBase):
    """Self-attention of diffusers' legacy `Attention` (DiT and PixArt `attn1`)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("MHLAAttnProcessor is for unmasked self-attention; cross-attention keeps its own processor")
        residual = hidden_states
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        b, n, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(b, n, attn.heads, -1) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        out = self.attend(q, k, v, hidden_states).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor
