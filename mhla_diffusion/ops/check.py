"""GPU correctness of the Triton path at real sizes, against the reference in fp64.

Run through `mhla-diffusion bench op --check`. For each case: fresh random inputs, output and
gradient buffers poisoned with NaN beforehand (the caching allocator hands the poisoned blocks
back to the kernels), relative error ||x - ref|| / ||ref|| of o, dq, dk, dv, dmix and of the
no-grad forward, and no NaN/Inf. Cases with "ranks" run the op as that many context-parallel ranks
would, one after another on this GPU (`as_ranks`); cases with "logits" give the op the mixing matrix's logits
(`mix_logits`), and dmix is their gradient.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..blocks import block_geometry, locality_mix, resolve_blocks
from ..kernels.mhla import state_dtype
from . import mhla_attention, mhla_op
from .context_parallel import token_range
from .norms import Norms
from .options import MHLAOptions

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-3}

# name, heads, D, Dv, grid, blocks, options
CASES = [
    ("wan-1.3b-480p", 12, 128, 128, (21, 30, 52), (3, 4, 5), {}),
    ("wan-1.3b-480p rope unnorm", 12, 128, 128, (21, 30, 52), (3, 4, 5),
     {"normalize": False, "rope": True, "norms": True}),  # and as Wan runs it: its q/k and output norms on the way
    ("dit-xl-512 elu", 16, 72, 72, (1, 32, 32), "auto", {"feature": "elu"}),
    ("sana-1.6b-1k", 70, 32, 32, (1, 32, 32), "auto", {}),
    ("sana-like-4k", 20, 112, 112, (1, 128, 128), "auto", {}),
    ("sana-1.6b-4k", 70, 32, 32, (1, 128, 128), "auto", {}),  # 32-wide heads, long blocks: fewer warps (mhla._config)
    ("sana-video-2b-480p rope", 20, 112, 112, (21, 30, 52), "auto", {"rope": True}),  # normalized, RoPE on the numerator
    ("d256 rope", 4, 256, 256, (3, 20, 30), (2, 3, 4), {"rope": True}),
    ("d136/dv40 ragged B=2", 3, 136, 40, (5, 13, 17), (2, 3, 4), {"feature": "elu", "batch": 2}),
    ("few blocks (split summaries)", 2, 64, 64, (4, 32, 32), (1, 2, 2), {}),
    ("wan-1.3b-480p rope unnorm, 3 ranks", 12, 128, 128, (21, 30, 52), (3, 4, 5),
     {"normalize": False, "rope": True, "ranks": 3}),
    ("d136/dv40 ragged B=2, 4 ranks", 3, 136, 40, (5, 13, 17), (2, 3, 4), {"feature": "elu", "batch": 2, "ranks": 4}),
    ("few blocks (split summaries), 2 ranks", 2, 64, 64, (4, 32, 32), (1, 2, 2), {"ranks": 2}),
    ("rope unnorm ragged B=2", 6, 64, 40, (3, 13, 23), (2, 3, 4), {"normalize": False, "rope": True, "batch": 2}),
    ("dit-xl-256", 16, 72, 72, (1, 16, 16), "auto", {}),  # short grids: the quadratic form (kernels/parallel.py)
    ("dit-xl-384 elu", 16, 72, 72, (1, 24, 24), "auto", {"feature": "elu"}),  # its forward over 256 tokens
    ("dit-xl-1024", 16, 72, 72, (1, 64, 64), "auto", {}),  # 64-token blocks: mhla.SHORT_CONFIG's settings
    # slices of one-tile blocks: each rank's q-side grad launch makes its share of dO's summaries (`mhla.summarizes`)
    ("dit-xl-512 elu, 3 ranks", 16, 72, 72, (1, 32, 32), "auto", {"feature": "elu", "ranks": 3}),
    # the case before with q, k, v one element past 16-byte alignment: the kernels Triton compiled for the aligned
    # ones must not be launched on them (`kernels/compiled.py`'s key)
    ("dit-xl-1024, inputs off 16-byte alignment", 16, 72, 72, (1, 64, 64), "auto", {"offset": 1}),
    ("sana-1.6b-512 B=2", 70, 32, 32, (1, 16, 16), "auto", {"batch": 2}),
    # the quadratic form with more than 16 blocks (a 32- and a 64-wide mix-row tile): at 1,024 tokens and 30 blocks,
    # 64-query tiles walking 32 keys on 8 warps gave NaN (H100 and H200, Triton 3.6; exact in the interpreter)
    ("dit-xl-256, 64 blocks", 16, 72, 72, (1, 16, 16), (1, 8, 8), {}),
    ("dit-xl-384, 36 blocks", 16, 72, 72, (1, 24, 24), (1, 6, 6), {}),
    # the blocks a converted Wan runs ("auto": 180), where mixing takes the Triton kernel, and 512 blocks (cuBLAS)
    ("wan-1.3b-480p rope unnorm, model's blocks", 12, 128, 128, (21, 30, 52), "auto",
     {"normalize": False, "rope": True, "norms": True}),
    ("many blocks (512)", 2, 64, 64, (4, 32, 32), (2, 16, 16), {}),
    # a converted Wan2.1-14B's 252 blocks at 720p: the mixing kernel's 128-row blocks (over 192), two of its 40 heads
    ("wan-14b-720p rope unnorm, model's blocks, 2 heads", 2, 128, 128, (21, 45, 80), "auto",
     {"normalize": False, "rope": True}),
    # given the mixing matrix's logits (a converted layer with gradients or compiled): softmaxed by the quadratic
    # form's launch, by the mixing launch (bf16, up to 64 blocks) or by PyTorch first (fp32; 180 blocks)
    ("dit-xl-256 logits", 16, 72, 72, (1, 16, 16), "auto", {"logits": True}),
    ("dit-xl-512 logits", 16, 72, 72, (1, 32, 32), "auto", {"logits": True}),
    ("wan-1.3b-480p logits, model's blocks", 12, 128, 128, (21, 30, 52), "auto", {"logits": True}),
]


def as_ranks(q, k, v, mix, grid, blocks, rope, ranks: int, **kwargs):
    """The Triton op as `ranks` context-parallel ranks compute it, one after another on this GPU: the kernels on
    each rank's slice, and in place of the all-reduce a sum of the slices' summaries (whose backward hands each
    slice the summed gradient, as the all-reduce's does). Returns the slices' outputs in order."""
    from ..kernels import op

    geometry, options = block_geometry(grid, blocks), MHLAOptions(**kwargs)
    cos, sin = op.kernel_tables(rope, q.dtype)
    slices = [token_range(geometry.num_tokens, ranks, rank) for rank in range(ranks)]

    def cut(t, start, end):
        return None if t is None else t[:, start:end]

    def args(start):
        return op.op_args(geometry, options, start)

    parts = [op.mhla_summaries(cut(k, a, b), cut(v, a, b), cut(cos, a, b), cut(sin, a, b), None, 0.0, *args(a))
             for a, b in slices]
    s, z = (sum(part[i] for part in parts) for i in (0, 1))
    return torch.cat([op.mixed_output(cut(q, a, b), mix, s, z, cut(cos, a, b), cut(sin, a, b), args(a))
                      for a, b in slices], dim=1)


def _rope_tables(n: int, d: int, device):
    angle = torch.randn(1, n, 1, d // 2, device=device, dtype=torch.float64).repeat_interleave(2, -1)
    return angle.cos(), angle.sin()


def _poison(shapes_dtypes, device):
    """Fill freshly allocated blocks of these sizes with NaN, then free them for reuse."""
    poisoned = [torch.full(s, math.nan, dtype=dt, device=device) for s, dt in shapes_dtypes]
    del poisoned  # all alive at once, then freed together: the next allocations reuse them


def _leaf(t: torch.Tensor, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """t in dtype as a leaf that wants gradients, its storage starting `offset` elements into a buffer."""
    buf = torch.empty(t.numel() + offset, device=t.device, dtype=dtype)
    return buf[offset:].view(t.shape).copy_(t).requires_grad_()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return math.inf
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _norms_error(leaves, grid, blocks, rope, kwargs) -> float:
    """The no-grad forward with a layer's RMSNorms (q, k across heads, the output per head; `ops.norms`) applied by
    the kernels on the way, against the reference with them applied in fp64 around it."""
    q, k, v, mix = (t.detach() for t in leaves)
    heads, d, dv = q.shape[2], q.shape[3], v.shape[3]
    weights = [torch.rand(heads * d, device=q.device) + 0.5, torch.rand(heads * d, device=q.device) + 0.5,
               torch.rand(heads, dv, device=q.device) + 0.5]
    geometry, options = block_geometry(grid, blocks), MHLAOptions(**kwargs)

    def run(tensors, table, backend):
        *qkvm, wq, wk, gain = tensors
        return mhla_op(*qkvm, geometry, options, rope=table, backend=backend, norms=Norms(wq, wk, 1e-6, gain))

    with torch.no_grad():
        o = run([q, k, v, mix, *(w.to(q.dtype) for w in weights)], None if rope is None else
                tuple(t.float() for t in rope), "triton")
        ref = run([t.double() for t in (q, k, v, mix, *weights)], rope, "torch")
    return _rel(o, ref)


def check_case(name, heads, d, dv, grid, blocks, options, dtype, device="cuda") -> dict:
    """One case: errors of o and all gradients against the fp64 reference."""
    blocks = resolve_blocks(grid, blocks)
    batch = options.get("batch", 1)
    n, m = math.prod(grid), math.prod(blocks)
    q, k = (torch.randn(batch, n, heads, d, device=device) for _ in range(2))
    v = torch.randn(batch, n, heads, dv, device=device)
    mix = (locality_mix(blocks) + 0.05 * torch.rand(m, m, dtype=torch.float64)).float().to(device)
    logits = options.get("logits", False)
    if logits:  # rows whose softmax is mix, row-normalized
        mix = (mix * 2).log()
    rope = _rope_tables(n, d, device) if options.get("rope") else None
    kwargs = {"normalize": options.get("normalize", True), "feature": options.get("feature", "relu")}
    do = torch.randn(batch, n, heads, dv, device=device)

    ranks = options.get("ranks", 1)

    def triton_op(*leaves):
        tables = None if rope is None else tuple(t.float() for t in rope)
        if ranks > 1:
            return as_ranks(*leaves, grid, blocks, tables, ranks, **kwargs)
        return mhla_attention(*leaves, grid, blocks, rope=tables, backend="triton", mix_logits=logits, **kwargs)

    leaves = [_leaf(t, dtype, options.get("offset", 0)) for t in (q, k, v)] + [mix.clone().requires_grad_()]
    outs = [((batch, n, heads, dv), dtype), ((batch, n, heads, d), dtype), ((batch, n, heads, d), dtype),
            ((batch, n, heads, dv), dtype), ((m, batch * heads, d, dv), state_dtype(dtype))]
    _poison(outs, device)
    o = triton_op(*leaves)
    _poison(outs, device)
    o.backward(do.to(dtype))
    torch.cuda.synchronize()

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_mix = ref_leaves[3].softmax(-1) if logits else ref_leaves[3]
    ref = mhla_attention(*ref_leaves[:3], ref_mix, grid, blocks, rope=rope, backend="torch", **kwargs)
    ref.backward(do.double())
    errors = {"o": _rel(o, ref)}
    errors.update({f"d{x}": _rel(a.grad, b.grad) for x, a, b in zip(("q", "k", "v", "mix"), leaves, ref_leaves)})
    _poison(outs[:1], device)
    with torch.no_grad():  # inference: the same op without autograd
        o = triton_op(*leaves)
    errors["o no-grad"] = _rel(o, ref.detach())
    if options.get("norms"):
        errors["o no-grad, norms on the way"] = _norms_error(leaves, grid, blocks, rope, kwargs)
    worst = max(errors.values())
    return {"case": name, "dtype": str(dtype).replace("torch.", ""), "N": n, "M": m, "heads": heads, "D": d,
            "Dv": dv, "errors": errors, "worst": worst, "ok": worst < TOLERANCE[dtype]}


def selected_cases(names=()) -> list[tuple]:
    """The cases whose names hold one of `names`, every case for none: a launch setting of the quadratic form's
    kernels is checked by its cases ("dit-xl-256", "dit-xl-384") in seconds, not by all of them in minutes."""
    for name in names:
        if not any(name in case[0] for case in CASES):
            raise ValueError(f"no check case's name holds {name!r}; the cases: {', '.join(c[0] for c in CASES)}")
    return [case for case in CASES if not names or any(name in case[0] for name in names)]


def run_checks(dtypes=(torch.bfloat16, torch.float32), on_result=None, names=()) -> list[dict]:
    """The cases `selected_cases(names)` in every dtype (minutes at real sizes: a progress bar on stderr), each
    result handed to `on_result` as it is made."""
    results = []
    for case, dtype in tqdm([(c, dt) for c in selected_cases(names) for dt in dtypes], desc="bench op --check",
                            unit="case"):
        torch.manual_seed(CASES.index(case))  # a case's inputs are the same whichever cases run with it
        results.append(check_case(*case, dtype))
        if on_result is not None:
            on_result(results[-1])
        torch.cuda.empty_cache()
    return results
