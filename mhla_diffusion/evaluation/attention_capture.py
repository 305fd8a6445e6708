"""Record what each MHLA layer attends with: q, k, token grid, blocks and mixing matrix."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..blocks import resolve_blocks
from ..conversion import mhla_modules
from ..ops.norms import layer_norms
from ..processors import MHLAProcessorBase


@dataclass
class LayerCapture:
    """One layer's inputs for sample 0 of the batch: q, k (N, heads, D), float32 on CPU."""

    q: torch.Tensor
    k: torch.Tensor
    grid: tuple[int, int, int]
    blocks: tuple[int, int, int]
    mix: torch.Tensor  # (M, M)
    rope: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) broadcastable to (N, heads, D)
    feature: str


@contextlib.contextmanager
def record_attention(transformer, call: int = -1):
    """Patch every MHLA processor's `attend` to record its inputs at transformer call `call`
    (0-based; -1: the last call). Yields {layer path: LayerCapture}, filled as calls run."""
    modules = mhla_modules(transformer)
    if not modules:
        raise ValueError("the model has no MHLA layers: convert it first (`mhla-diffusion convert`)")
    captures, calls = {}, dict.fromkeys(modules, 0)

    def patch(path, proc):
        attend = proc.attend

        def recording(q, k, v, layer_input, rope=None, qk_norm=None):
            if call < 0 or calls[path] == call:
                # q, k as attention sees them; norm modules that must run do so here, once, not again in attend
                q, k, norms = layer_norms(q, k, qk_norm, None)
                qn, kn = (q, k) if norms is None else norms.inputs(q, k)
                qk_norm = None if norms is None else qk_norm
                grid = proc.current_grid(q.shape[1])
                blocks = resolve_blocks(grid, proc.config.blocks)
                cpu = lambda t: t[0].detach().float().cpu()  # noqa: E731
                captures[path] = LayerCapture(
                    cpu(qn), cpu(kn), grid, blocks, proc.mixing(blocks).detach().float().cpu(),
                    None if rope is None else tuple(cpu(r.expand(q.shape[0], *r.shape[1:])) for r in rope),
                    proc.config.feature,
                )
            calls[path] += 1
            return attend(q, k, v, layer_input, rope=rope, qk_norm=qk_norm)

        proc.attend = recording

    for path, proc in modules.items():
        patch(path, proc)
    try:
        yield captures
    finally:
        for proc in modules.values():
            del proc.attend


@contextlib.contextmanager
def record_projections(attentions: dict, call: int = -1):
    """Record q, k of any self-attention modules (softmax or MHLA) from their `to_q`, `to_k`
    outputs at call `call` (0-based; -1: the last), so softmax, linear and MHLA models are read
    the same way. `attentions` maps names to diffusers `Attention` modules on a square token grid;
    MHLA layers capture their block grid and mixing matrix, softmax layers one block. Yields
    {name: LayerCapture}, filled as calls run."""
    captures, calls, handles = {}, dict.fromkeys(attentions, 0), []

    def hook(name, attn):
        seen = {}

        def on_q(module, args, out):
            seen["q"] = out

        def on_k(module, args, out):
            if call < 0 or calls[name] == call:
                b, n, _ = out.shape
                cpu = lambda t: t[0].view(n, attn.heads, -1).detach().float().cpu()  # noqa: E731
                proc = attn.processor
                if isinstance(proc, MHLAProcessorBase):
                    grid = proc.current_grid(n)
                    blocks = resolve_blocks(grid, proc.config.blocks)
                    mix, feature = proc.mixing(blocks).detach().float().cpu(), proc.config.feature
                else:
                    side = math.isqrt(n)
                    grid, blocks, mix, feature = (1, side, side), (1, 1, 1), torch.ones(1, 1), "relu"
                captures[name] = LayerCapture(cpu(seen["q"]), cpu(out), grid, blocks, mix, None, feature)
            calls[name] += 1

        handles.append(attn.to_q.register_forward_hook(on_q))
        handles.append(attn.to_k.register_forward_hook(on_k))

    for name, attn in attentions.items():
        hook(name, attn)
    try:
        yield captures
    finally:
        for h in handles:
            h.remove()
