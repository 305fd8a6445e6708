"""Record what each MHLA layer attends with: q, k, token grid, blocks and mixing matrix."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..blocks import resolve_blocks
from ..conversion import mhla_modules


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

        def recording(q, k, v, layer_input, rope=None):
            if call < 0 or calls[path] == call:
                grid = proc.current_grid(q.shape[1])
                blocks = resolve_blocks(grid, proc.config.blocks)
                cpu = lambda t: t[0].detach().float().cpu()  # noqa: E731
                captures[path] = LayerCapture(
                    cpu(q), cpu(k), grid, blocks, proc.mixing(blocks).detach().float().cpu(),
                    None if rope is None else tuple(cpu(r.expand(q.shape[0], *r.shape[1:])) for r in rope),
                    proc.config.feature,
                )
            calls[path] += 1
            return attend(q, k, v, layer_input, rope=rope)

        proc.attend = recording

    for path, proc in modules.items():
        patch(path, proc)
    try:
        yield captures
    finally:
        for proc in modules.values():
            del proc.attend
