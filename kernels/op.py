"""The Triton MHLA path as torch custom ops, so autograd and torch.compile see opaque nodes.

The linear path (`mhla_linear`) is two ops that autograd chains: `mhla_summaries` (k, v -> per-block
summaries S, z, block-major (M, B*heads, ...), z fp32) and `mhla_output` (q, mix, S, z -> o, S~, z~). Split there
so that a context-parallel call can sum one rank's partial summaries over the ranks between them with a
differentiable all-reduce, whose backward sums the summaries' gradients the same way before the
summaries' backward (dk, dv) reads them; an unsharded call is the slice [0, N) with nothing between.
Besides the inputs, the backward keeps only S and z, and the mixed S~ and z~ where `mhla.keeps_mixed`.
Gradients flow to q, k, v and mix; RoPE tables get none.
A short sequence over its whole grid takes a third op instead, `mhla_parallel` (`parallel.py`: MHLA's quadratic
form, one launch forward and two backward; its backward keeps its output and 1 / den per query).
`mhla_rms_norm` is a layer's RMSNorms around the op where the kernels cannot apply them on the way (with gradients:
training), one launch each way (`rms_norm.py`).
The ops take the call's block geometry, token slice and options flattened by `op_args` (torch.library
schemas take ints, floats, bools and strings, not objects) and read them back in `_decode`: one place each.
"""

import math
from typing import Optional

import torch

from ..blocks import block_geometry
from ..mixing import mixing_matrix
from ..ops.rope import kernel_tables
from . import mhla, parallel, rms_norm
from .capabilities import FEATURES


def op_args(geometry, options, start: int = 0) -> tuple:
    """A `BlockGeometry`, an `MHLAOptions` and the first raster token of the call's slice as the custom ops take
    them: (T, H, W, bt, bh, bw, start), normalize, eps, feature."""
    return ([*geometry.grid, *geometry.blocks, int(start)], bool(options.normalize), float(options.eps),
            str(options.feature))


def _options(normalize, eps, feature) -> dict:
    """The launchers' keyword options from a custom op's."""
    if feature not in FEATURES:  # the dispatch refuses these; a direct caller must not get another map
        raise ValueError(f"the Triton kernels compute the feature maps {FEATURES}, not {feature!r}")
    return dict(elu=feature == "elu", normalize=normalize, eps=eps)


def _decode(x, y, geometry, normalize, eps, feature):
    """The launchers' `Geometry` (x: q or k; y: any tensor whose last dim is D_v) and keyword options from a
    custom op's arguments. (The quadratic form's ops read the grids from `geometry` as they are: a whole grid,
    checked by the dispatch, and a Geometry's slice arithmetic was a tenth of an eager call's host time.)"""
    g = mhla.Geometry(x, y, block_geometry(geometry[:3], geometry[3:6]), start=geometry[6])
    return g, _options(normalize, eps, feature)


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take any strides for B, N, heads but need unit stride along the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _pair(a: Optional[torch.Tensor], b):
    """(a, b), or None for an absent a: RoPE tables, or an output norm's (gain, eps)."""
    return None if a is None else (a, b)


def _rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float):
    """(per-token rstd, weight) of an RMSNorm across heads that the kernels apply to x as they load it, or None."""
    return None if weight is None else (mhla.token_rstd(x, eps), weight.contiguous())


PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose memory the kernels can be launched on


def _eager(tensors) -> bool:
    """Whether a call on `tensors` runs as its caller makes it: not traced by torch.compile (nor by AOTAutograd, on
    fake and functional tensors that releases before torch 2.14 may not mark as compiling), on plain tensors. Its
    launches then come in the caller's order, after those that made its inputs: what the ops' `settled` flags say."""
    return not torch.compiler.is_compiling() and all(type(t) in PLAIN for t in tensors)


def _saved_as_is() -> bool:
    """Whether what an op saves for its backward comes back as it was saved: no saved-tensor hooks in force
    (`torch.autograd.graph.saved_tensors_hooks`: offloading, compression, non-reentrant checkpointing), which may
    remake it in the backward by the launch just ahead of the op's own (so not `settled` there)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _records_grad(tensors) -> bool:
    """Whether autograd records a call on `tensors`."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _op(name: str):
    """Registers the function as the custom op `mhla_diffusion::name`; the op keeps the function as `body`, which
    `_call` runs where no one needs the op's node."""
    def register(fn):
        op = torch.library.custom_op(f"mhla_diffusion::{name}", fn, mutates_args=())
        op.body = fn
        return op

    return register


def _autograd(op, backward, setup_context) -> None:
    """`op.register_autograd(backward, setup_context=...)`, the two kept for `_Recorded` as `op.autograd`."""
    op.register_autograd(backward, setup_context=setup_context)
    op.autograd = (setup_context, backward)


class _Recorded(torch.autograd.Function):
    """An op's body recorded by autograd with the op's own setup_context and backward (`_autograd`): the node the
    custom op would make, without the dispatcher's host time, for eager training (`_call`)."""

    @staticmethod
    def forward(ctx, op, *args):
        output = op.body(*args)
        setup_context, ctx.op_backward = op.autograd
        setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return None, *ctx.op_backward(ctx, *grads)


def _call(op, *args):
    """`op(*args)` where torch.compile traces or a tensor is not a plain one (the fake and functional tensors of
    AOTAutograd's trace, which releases before torch 2.14 may not mark as compiling; DTensors); its body otherwise,
    recorded by `_Recorded` where autograd records the call (eager training) and called as it is elsewhere (eager
    inference, and the backward's own launches). The custom-op dispatch costs host time that eager DiT and SANA,
    host-bound at these sizes, pay in full. H100, torch 2.11, session 40, eager `mhla_attention` without gradients,
    median of 6 alternating rounds, custom op every call -> bodies: DiT-XL/2 512 px 627 -> 401 us a call, SANA-1.6B
    1K 620 -> 436 (the op's GPU time: 21 and 27 us); forward+backward 3251 -> 2771 and 2949 -> 2868 (the forward's
    ops still custom ops then)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not _eager(tensors):
        return op(*args)
    if _records_grad(tensors):  # the backward ops have no backward: double backward gets torch's own refusal
        return _Recorded.apply(op, *args) if hasattr(op, "autograd") else op(*args)
    return op.body(*args)


@_op("mhla_summaries")
def mhla_summaries(
    k: torch.Tensor, v: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor], qk_eps: float,
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, z) of the call's keys: S in `mhla.state_dtype`, or fp32 for a slice short of the grid (partial sums).
    k_weight, qk_eps: k RMSNormed across heads on the way (one pass over k for its per-token rstd); forward only."""
    g, kw = _decode(k, v, geometry, normalize, eps, feature)
    k, v = (_inner_contiguous(t) for t in (k, v))
    return mhla.summary_forward(k, v, _pair(cos, sin), g, elu=kw["elu"], normalize=normalize,
                                k_norm=_rms_norm(k, k_weight, qk_eps))


@mhla_summaries.register_fake
def _(k, v, cos, sin, k_weight, qk_eps, geometry, *options):
    b, n, heads, d = k.shape
    m, partial = math.prod(geometry[3:6]), n < math.prod(geometry[:3])
    return (k.new_empty((m, b * heads, d, v.shape[-1]), dtype=torch.float32 if partial else mhla.state_dtype(k.dtype)),
            k.new_empty((m, b * heads, d), dtype=torch.float32))


@_op("mhla_summaries_bwd")
def mhla_summaries_bwd(
    ds: torch.Tensor, dz: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settled: bool,
    cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv). settled: k and v were complete before the launch ahead of this op's first launch started (an eager
    backward without saved-tensor hooks: the forward made them), so the kernel may read them before it waits for that
    launch."""
    g, kw = _decode(k, v, geometry, normalize, eps, feature)
    settled = settled and all(t.stride(-1) == 1 for t in (k, v))  # a copy made here is the launch just ahead
    k, v = (_inner_contiguous(t) for t in (k, v))
    return mhla.summary_backward(ds, dz, k, v, _pair(cos, sin), g, **kw, settled=settled)


@mhla_summaries_bwd.register_fake
def _(ds, dz, k, v, *options):
    return k.new_empty(k.shape), v.new_empty(v.shape)  # the launchers allocate contiguous gradients


@_op("mhla_output")
def mhla_output(
    q: torch.Tensor, mix: torch.Tensor, mix_logits: bool, s: torch.Tensor, z: torch.Tensor,
    cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    q_weight: Optional[torch.Tensor], qk_eps: float, out_gain: Optional[torch.Tensor], out_eps: float,
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, S~, z~) of the call's queries from the complete summaries (S in `mhla.state_dtype`): the output and the
    mixed summaries it read, which the backward takes where `mhla.keeps_mixed` (z~ empty unnormalized: z is not
    mixed). mix_logits: mix holds the mixing matrix's logits (`mixing_matrix`). q_weight, qk_eps: q RMSNormed
    across heads on the way; out_gain, out_eps: each head's o RMSNormed and scaled (`mhla.fuses_output_norm` calls
    only); forward only."""
    g, kw = _decode(q, s, geometry, normalize, eps, feature)
    q = _inner_contiguous(q)
    o, (mixed_s, mixed_z) = mhla.output_forward(q, mix, s, z, _pair(cos, sin), g, **kw,
                                                q_norm=_rms_norm(q, q_weight, qk_eps),
                                                out_norm=_pair(None if out_gain is None else out_gain.contiguous(),
                                                               out_eps), logits=mix_logits)
    return o, mixed_s, z.new_empty(0) if mixed_z is None else mixed_z


@mhla_output.register_fake
def _(q, mix, mix_logits, s, z, cos, sin, q_weight, qk_eps, out_gain, out_eps, geometry, normalize, *options):
    return q.new_empty((*q.shape[:3], s.shape[-1])), s.new_empty(s.shape), z.new_empty(z.shape if normalize else 0)


@_op("mhla_output_bwd")
def mhla_output_bwd(
    do: torch.Tensor, q: torch.Tensor, mix: torch.Tensor, s: torch.Tensor, z: torch.Tensor,
    mixed_s: Optional[torch.Tensor], mixed_z: Optional[torch.Tensor], settled: bool,
    cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dmix, dS, dz); mixed_s, mixed_z: the forward's S~ and z~ (`mhla.keeps_mixed`), or None to mix again.
    settled: q, S~ and z~ were complete before the launch ahead of this op's first launch started (an eager backward
    without saved-tensor hooks: the forward made them), so the q-side kernel may read them before it waits for that
    launch."""
    g, kw = _decode(q, s, geometry, normalize, eps, feature)
    settled = settled and q.stride(-1) == 1  # a copy made here is the launch just ahead
    do, q = (_inner_contiguous(t) for t in (do.to(q.dtype), q))
    mixed = None if mixed_s is None else (mixed_s, mixed_z if normalize else None)
    return mhla.output_backward(do, q, mix, s, z, _pair(cos, sin), g, **kw, mixed=mixed, settled=settled)


@mhla_output_bwd.register_fake
def _(do, q, mix, s, z, *options):
    return q.new_empty(q.shape), mix.new_empty(mix.shape), s.new_empty(s.shape), z.new_empty(z.shape)


@_op("mhla_parallel")
def mhla_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mix: torch.Tensor, mix_logits: bool,
    geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, 1 / den per query) of a whole grid's queries in MHLA's quadratic form (`parallel.parallel_output`);
    mix_logits: mix holds the mixing matrix's logits (`mixing_matrix`)."""
    q, k, v = (_inner_contiguous(t) for t in (q, k, v))
    return parallel.parallel_output(q, k, v, mix, geometry[:3], geometry[3:6], **_options(normalize, eps, feature),
                                    logits=mix_logits)


@mhla_parallel.register_fake
def _(q, k, v, mix, mix_logits, geometry, normalize, *options):
    b, n, heads, _ = q.shape
    return q.new_empty((b, n, heads, v.shape[-1])), q.new_empty((b * heads, n) if normalize else (0,),
                                                                dtype=torch.float32)


@_op("mhla_parallel_bwd")
def mhla_parallel_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mix: torch.Tensor, o: torch.Tensor,
    rden: torch.Tensor, geometry: list[int], normalize: bool, eps: float, feature: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    elu = _options(normalize, eps, feature)["elu"]
    do, q, k, v = (_inner_contiguous(t) for t in (do.to(q.dtype), q, k, v))
    dq, dk, dv, dmix = parallel.parallel_grad(do, q, k, v, mix, o, rden, geometry[:3], geometry[3:6], elu=elu,
                                              normalize=normalize)
    return dq, dk, dv, dmix.to(mix.dtype)


@mhla_parallel_bwd.register_fake
def _(do, q, k, v, mix, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), mix.new_empty(mix.shape)


def _mix_grad(dmix: torch.Tensor, matrix: torch.Tensor, mix: torch.Tensor, logits: bool) -> torch.Tensor:
    """The gradient of what the op was given as mix from dmix, the mixing matrix's: through the rows' softmax where
    mix held the logits (`mixing_matrix`), in mix's type."""
    if logits:
        dmix = torch.ops.aten._softmax_backward_data(dmix.float(), matrix, -1, torch.float32)
    return dmix.to(mix.dtype)


def _save_parallel_inputs(ctx, inputs, output):
    q, k, v, mix, ctx.mix_logits, *options = inputs
    ctx.set_materialize_grads(False)  # no zeros made for rden, which nothing differentiates
    ctx.save_for_backward(q, k, v, mix, *output)
    ctx.options = options


def _parallel_backward(ctx, do, _):
    q, k, v, mix, o, rden = ctx.saved_tensors
    matrix = mixing_matrix(mix, ctx.mix_logits)
    dq, dk, dv, dmix = _call(mhla_parallel_bwd, do, q, k, v, matrix, o, rden, *ctx.options)
    return dq, dk, dv, _mix_grad(dmix, matrix, mix, ctx.mix_logits), None, *(None for _ in ctx.options)


_autograd(mhla_parallel, _parallel_backward, _save_parallel_inputs)


def _forward_only(*norm_tensors) -> None:
    if any(t is not None for t in norm_tensors):
        raise RuntimeError("the Triton ops apply RMSNorms on the way in inference only; with gradients, apply them "
                           "before and after the op (ops.norms.Norms.inputs / output)")


def _save_summaries_inputs(ctx, inputs, output):
    k, v, cos, sin, k_weight, _, *options = inputs
    _forward_only(k_weight)
    ctx.save_for_backward(k, v, cos, sin)
    ctx.saved_as_is = _saved_as_is()
    ctx.options = options


def _summaries_backward(ctx, ds, dz):
    k, v, cos, sin = ctx.saved_tensors
    dk, dv = _call(mhla_summaries_bwd, ds, dz, k, v, ctx.saved_as_is and _eager((ds, dz, k, v)), cos, sin,
                   *ctx.options)
    return dk, dv, None, None, None, None, *(None for _ in ctx.options)


def _save_output_inputs(ctx, inputs, output):
    q, mix, ctx.mix_logits, s, z, cos, sin, q_weight, _, out_gain, _, *options = inputs
    _forward_only(q_weight, out_gain)
    ctx.set_materialize_grads(False)  # no zeros made for S~ and z~, which nothing differentiates
    mixed = output[1:] if mhla.keeps_mixed(s.shape[0], q.shape[1], q.shape[-1]) else (None, None)
    ctx.save_for_backward(q, mix, s, z, *mixed, cos, sin)
    ctx.saved_as_is = _saved_as_is()
    ctx.options = options


def _output_backward(ctx, do, *_):
    q, mix, s, z, mixed_s, mixed_z, cos, sin = ctx.saved_tensors
    matrix = mixing_matrix(mix, ctx.mix_logits)
    dq, dmix, ds, dz = _call(mhla_output_bwd, do, q, matrix, s, z, mixed_s, mixed_z,
                             ctx.saved_as_is and _eager((do, q, matrix, s, z)), cos, sin, *ctx.options)
    return (dq, _mix_grad(dmix, matrix, mix, ctx.mix_logits), None, ds, dz, None, None, None, None, None, None,
            *(None for _ in ctx.options))


_autograd(mhla_summaries, _summaries_backward, _save_summaries_inputs)
_autograd(mhla_output, _output_backward, _save_output_inputs)


@_op("rms_norm")
def mhla_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): x (rows, groups * width) RMSNormed per group of width features and scaled by weight (groups *
    width elements, any shape), y in x's dtype, rstd (rows, groups) fp32 for the backward."""
    return rms_norm.rms_norm_forward(x.contiguous(), weight.contiguous().view(-1), groups, eps)


@mhla_rms_norm.register_fake
def _(x, weight, groups, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((x.shape[0], groups),
                                                                                   dtype=torch.float32)


@_op("rms_norm_bwd")
def mhla_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = rms_norm.rms_norm_backward(dy.contiguous(), x.contiguous(), weight.contiguous().view(-1), rstd, groups)
    return dx, dw.view(weight.shape)


@mhla_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, groups):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format))


def _save_rms_norm_inputs(ctx, inputs, output):
    x, weight, groups, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.groups = groups


def _rms_norm_backward(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _call(mhla_rms_norm_bwd, dy, x, weight, rstd, ctx.groups)
    return dx, dw, None, None


_autograd(mhla_rms_norm, _rms_norm_backward, _save_rms_norm_inputs)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """x (..., groups * width) RMSNormed per group and scaled by weight, in x's dtype (`mhla_rms_norm`)."""
    features = x.shape[-1]
    if features % groups or weight.numel() != features:
        raise ValueError(f"grouped_rms_norm needs x's last dim ({features}) to split into {groups} equal groups and "
                         f"a weight of as many elements, got a weight of shape {tuple(weight.shape)}")
    return _call(mhla_rms_norm, x.reshape(-1, x.shape[-1]), weight, groups, eps)[0].view(x.shape)


def mixed_output(q, mix, s, z, cos, sin, args, q_norm=(None, 0.0), out_norm=(None, 0.0), mix_logits=False):
    """`mhla_output` from complete summaries of any float type (a slice's are fp32), rounded to `mhla.state_dtype`."""
    return _call(mhla_output, q, mix, mix_logits, s.to(mhla.state_dtype(q.dtype)), z, cos, sin, *q_norm, *out_norm,
                 *args)[0]


def mhla_linear(q, k, v, mix, cos, sin, args, reduce=None, norms=None, mix_logits=False):
    """The linear path on flattened `op_args`: summaries, `reduce` (for a context-parallel slice: their sum over
    the ranks, differentiable), then mixing and output. `norms` (`ops.norms.Norms`, inference only): q and k
    RMSNormed across heads on the way (one pass over each for its per-token rstd), the output norm in the output
    kernel where it holds a head's whole Dv, after it otherwise. `mix_logits`: mix holds the matrix's logits."""
    q_norm = k_norm = (None, 0.0)
    if norms is not None:
        q_norm, k_norm = (norms.q_weight, norms.qk_eps), (norms.k_weight, norms.qk_eps)
    s, z = _call(mhla_summaries, k, v, cos, sin, *k_norm, *args)
    if reduce is not None:
        s, z = reduce(s, z)
    fuse_out = norms is not None and norms.out_gain is not None and mhla.fuses_output_norm(q.shape[-1], v.shape[-1])
    out = mixed_output(q, mix, s, z, cos, sin, args, q_norm, (norms.out_gain, norms.out_eps) if fuse_out else (None, 0.0),
                       mix_logits)
    return out if norms is None or fuse_out else norms.output(out, grouped_rms_norm)


def _runs_as_called(q: torch.Tensor) -> bool:
    """Whether a call's launches run as it makes them, host time and all: neither traced by torch.compile nor captured
    in a CUDA graph."""
    return not torch.compiler.is_compiling() and not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _takes_parallel_form(q, k, v, mix, geometry, rope, reduce, norms) -> bool:
    """Whether a call is over the whole grid, without RoPE or norms on the way, at a length where the quadratic form
    measured faster, with gradients wanted or not, run as called or not (`parallel.uses_parallel_form`)."""
    if rope is not None or reduce is not None or norms is not None or q.shape[1] != geometry.num_tokens:
        return False
    return parallel.uses_parallel_form(q.shape[1], q.dtype, _records_grad((q, k, v, mix)), _runs_as_called(q))


def mhla_attention_triton(q, k, v, mix, geometry, options, rope=None, start=0, reduce=None, norms=None,
                          mix_logits=False):
    """The fused path behind `mhla_attention(..., backend="triton")`: a `BlockGeometry` and `MHLAOptions` the
    dispatch has checked against `capabilities`.

    q, k, v (and rope) may hold raster tokens [start, start + N) only, a context-parallel rank's slice; `reduce`
    then takes the slice's partial summaries (S, z) to complete ones (`ops.context_parallel`). Without it a
    slice's output is wrong, but its kernels are those of a rank: `bench op --shard` times them so.
    `norms`: RMSNorms to apply on the way (`mhla_linear`; inference only, the dispatch decides).
    `mix_logits`: mix holds the mixing matrix's logits, softmaxed where the kernels read them (the quadratic form's
    launch; the mixing launch where it reads mix as it is, `mhla._mixes_in_one_launch`), else first by PyTorch.
    Short calls over the whole grid take `mhla_parallel` (`_takes_parallel_form`).
    """
    if _takes_parallel_form(q, k, v, mix, geometry, rope, reduce, norms):
        return _call(mhla_parallel, q, k, v, mix, mix_logits, *op_args(geometry, options))[0]
    cos, sin = kernel_tables(rope, q.dtype)
    args = op_args(geometry, options, start)
    return mhla_linear(q, k, v, mix, cos, sin, args, reduce, norms, mix_logits)
