"""The Triton MHLA path as torch custom ops, so autograd and torch.compile see one opaque node.

`mhla_fwd` returns (o, S, z); S, z (per-block summaries, block-major (M, B*heads, ...): S in
`mhla.state_dtype`, z fp32) are the only state the backward keeps besides the inputs. Gradients
flow to q, k, v and mix; RoPE tables get none.
`mhla_dense` (dense formula) and `mhla_short` (one-launch linear) are forward-only small-N kernels, taken when no
gradient is needed.
The ops take the call's block geometry and options flattened by `op_args` (torch.library schemas take
ints, floats, bools and strings, not objects) and read them back in `_decode`: one place each.
"""

from typing import Optional

import torch

from ..blocks import block_geometry
from . import mhla, short
from .capabilities import FEATURES

# Forward calls that need no gradient take the one-launch dense kernel up to this many tokens.
# H200, bf16, GPU time dense vs linear path: 16 heads x 72 at N = 256 0.034 vs 0.061 ms (eager 0.18
# vs 0.33), at N = 1,024 0.156 vs 0.151, at N = 4,096 2.92 vs 0.36; 70 x 32 at N = 1,024 0.36 vs 0.09.
DENSE_MAX_TOKENS = 256
# Above that, up to this many tokens, they take the one-launch linear kernel (kernels/short.py), whose work grows
# as M x N. Not yet measured on a GPU: `bench op` times the dense, short and linear forwards side by side.
SHORT_MAX_TOKENS = 1024


def op_args(geometry, options) -> tuple:
    """A `BlockGeometry` and an `MHLAOptions` as the custom ops take them: (T, H, W, bt, bh, bw), normalize,
    eps, feature."""
    return [*geometry.grid, *geometry.blocks], bool(options.normalize), float(options.eps), str(options.feature)


def _decode(q, v, geometry, normalize, eps, feature):
    """The launchers' `Geometry` and keyword options from a custom op's arguments."""
    if feature not in FEATURES:  # the dispatch refuses these; a direct caller must not get another map
        raise ValueError(f"the Triton kernels compute the feature maps {FEATURES}, not {feature!r}")
    g = mhla.Geometry(q, v, block_geometry(geometry[:3], geometry[3:]))
    return g, dict(elu=feature == "elu", normalize=normalize, eps=eps)


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take any strides for B, N, heads but need unit stride along the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]):
    return None if cos is None else (cos, sin)


@torch.library.custom_op("mhla_diffusion::mhla_fwd", mutates_args=())
def mhla_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mix: torch.Tensor,
    cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, kw = _decode(q, v, geometry, normalize, eps, feature)
    q, k, v = (_inner_contiguous(t) for t in (q, k, v))
    return mhla.mhla_forward(q, k, v, mix, _rope(cos, sin), g, **kw)


@mhla_fwd.register_fake
def _(q, k, v, mix, cos, sin, *options):
    b, n, heads, d = q.shape
    dv, m = v.shape[-1], mix.shape[0]
    return (q.new_empty((b, n, heads, dv), dtype=v.dtype),
            q.new_empty((m, b * heads, d, dv), dtype=mhla.state_dtype(q.dtype)),
            q.new_empty((m, b * heads, d), dtype=torch.float32))


@torch.library.custom_op("mhla_diffusion::mhla_bwd", mutates_args=())
def mhla_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mix: torch.Tensor,
    s: torch.Tensor, z: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g, kw = _decode(q, v, geometry, normalize, eps, feature)
    do, q, k, v = (_inner_contiguous(t) for t in (do.to(v.dtype), q, k, v))
    return mhla.mhla_backward(do, q, k, v, mix, s, z, _rope(cos, sin), g, **kw)


@mhla_bwd.register_fake
def _(do, q, k, v, mix, s, z, cos, sin, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(mix)


def _forward_only(name: str, launcher):
    """A forward-only custom op (no autograd registered) running one of the one-launch kernels, for the
    dispatcher's calls that need no gradient."""

    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mix: torch.Tensor,
        cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
        geometry: list[int], normalize: bool, eps: float, feature: str,
    ) -> torch.Tensor:
        g, kw = _decode(q, v, geometry, normalize, eps, feature)
        q, k, v = (_inner_contiguous(t) for t in (q, k, v))
        return launcher(q, k, v, mix, _rope(cos, sin), g, **kw)

    op = torch.library.custom_op(f"mhla_diffusion::{name}", forward, mutates_args=())
    op.register_fake(lambda q, k, v, mix, cos, sin, *options: q.new_empty((*q.shape[:3], v.shape[-1]), dtype=v.dtype))
    return op


mhla_dense = _forward_only("mhla_dense", mhla.dense_output)  # O(N^2) dense formula, one launch
mhla_short = _forward_only("mhla_short", short.short_output)  # linear, one kernel (kernels/short.py)


def _setup_context(ctx, inputs, output):
    q, k, v, mix, cos, sin, *options = inputs
    _, s, z = output
    ctx.mark_non_differentiable(s, z)
    ctx.save_for_backward(q, k, v, mix, s, z, cos, sin)
    ctx.options = options


def _backward(ctx, do, _ds, _dz):
    q, k, v, mix, s, z, cos, sin = ctx.saved_tensors
    dq, dk, dv, dmix = mhla_bwd(do, q, k, v, mix, s, z, cos, sin, *ctx.options)
    return dq, dk, dv, dmix, None, None, *(None for _ in ctx.options)


mhla_fwd.register_autograd(_backward, setup_context=_setup_context)


def _table(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A RoPE table as the kernels read it: rounded to bf16 for bf16 inputs, whose rotated features are rounded to
    bf16 before every product anyway. Half the table bytes per token tile: H200, op as Wan uses it (RoPE,
    unnormalized), fp32 -> bf16 tables, fwd 0.243 -> 0.201 ms (plain op 0.210) at Wan 1.3B 480p and 1.526 -> 1.24
    (plain 1.263) at 14B 720p, f+b 1.05 -> 0.93 and 6.57 -> 5.71 (tables converted before the timed calls; here
    each call rounds its (1, N, 1, D) tables once, a small elementwise pass); output error vs fp64 4.0e-3 -> 4.4e-3."""
    t = t.detach()
    return t.to(torch.bfloat16) if dtype == torch.bfloat16 and t.dtype == torch.float32 else t


def mhla_attention_triton(q, k, v, mix, geometry, options, rope=None):
    """The fused path behind `mhla_attention(..., backend="triton")`: a `BlockGeometry` and `MHLAOptions` the
    dispatch has checked against `capabilities`."""
    cos, sin = (None, None) if rope is None else (_table(rope[0], q.dtype), _table(rope[1], q.dtype))
    args = (q, k, v, mix, cos, sin, *op_args(geometry, options))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mix))
    if not needs_grad and q.shape[1] <= DENSE_MAX_TOKENS:
        return mhla_dense(*args)
    if not needs_grad and q.shape[1] <= SHORT_MAX_TOKENS:
        return mhla_short(*args)
    return mhla_fwd(*args)[0]
