"""`bench op --in-layer`: each attention timed inside a self-attention layer's projections, less the projections alone.

Why: `bench op` replays one call back to back, which is not how a model runs it: there the attention sits between
cuBLAS GEMMs, and an op of several launches fares worse than one kernel. H100, session 58 (CUDA-graph replay, us):
at DiT-XL/2 512 px MHLA's forward took 19.5 replayed alone against cuDNN's 20.1, and 23.1 against 21.4 between the
projections; at 384 px 14.6 against 14.7 alone, 17.7 against 15.4 in the layer.
"""

from __future__ import annotations

import math

import torch

IN_LAYER = ("Each call timed inside a self-attention layer's projections (x W_q, x W_k, x W_v before it, o W_o after: "
            "cuBLAS GEMMs, as a model runs it), less those projections alone, timed the same way (with --versus, in "
            "the same round).")


class PassValues(torch.autograd.Function):
    """The projections-alone baseline's attention: v as it is, no kernel of its own; backward, the output's gradient
    handed to q, k and v alike, so the baseline's backward runs every projection GEMM an attention's backward runs."""

    @staticmethod
    def forward(ctx, q, k, v):
        return v.view_as(v)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad


def projections_only(q, k, v, mix=None):
    return PassValues.apply(q, k, v)


def layer_of(fn, heads: int):
    """`fn(q, k, v, mix)` (B, N, heads, D) as a self-attention layer calls it: q, k, v = x W_q, x W_k, x W_v, then
    o W_o on its output ((B, N, heads * D)); a function of the layer's leaves (`layer_leaves`)."""
    def layer(x, wq, wk, wv, wo, mix):
        q, k, v = ((x @ w).unflatten(-1, (heads, -1)) for w in (wq, wk, wv))
        return fn(q, k, v, mix).flatten(-2) @ wo
    return layer


def layer_leaves(q: torch.Tensor, do: torch.Tensor, mix: torch.Tensor) -> tuple[list, torch.Tensor]:
    """The layer's input x (B, N, heads * D) and four projection weights (random, q's dtype, scaled to keep unit
    variance), with `mix`, as leaves that take gradients, and the output's gradient (B, N, heads * D)."""
    width = q.shape[-2] * q.shape[-1]
    x = torch.randn(*q.shape[:2], width, device=q.device, dtype=q.dtype)
    weights = [torch.randn(width, width, device=q.device, dtype=q.dtype) / math.sqrt(width) for _ in range(4)]
    return [t.requires_grad_() for t in (x, *weights, mix)], do.flatten(-2)


def less_projections(timed: dict, base: dict) -> dict:
    """An attention's timings in the layer less the projections alone's, each against the baseline timed the same way
    (CUDA-graph replay, or queued eager calls; NaN where the baseline has no such time); "layer_ms", the layer's own."""
    same_way = base.get("ms" if timed.get("how") == base.get("how") else "queued_ms", math.nan)
    out = dict(timed, layer_ms=timed["ms"], ms=timed["ms"] - same_way)
    for key in ("eager_ms", "queued_ms"):
        if key in timed:
            out[key] = timed[key] - base.get(key, math.nan)
    return out
