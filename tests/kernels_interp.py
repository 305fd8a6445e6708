"""Runs the Triton MHLA kernels on CPU under TRITON_INTERPRET=1 and prints their errors as JSON.

Started in a subprocess by tests/test_kernels.py: the interpreter must be switched on before
triton is imported, which the rest of the test session does normally. Each check reports the
largest relative error ||x - ref|| / ||ref|| of its outputs against an fp64 PyTorch reference.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

from mhla_diffusion.blocks import block_geometry, locality_mix  # noqa: E402
from mhla_diffusion.kernels import mhla  # noqa: E402
from mhla_diffusion.kernels.op import mhla_output, mhla_summaries  # noqa: E402
from mhla_diffusion.ops import mhla_attention, naive  # noqa: E402

# One program per block keeps the interpreter quick; SPLIT cases force several programs per
# block (atomic summaries, split Gram sums) with small token tiles.
FEW = {"programs": 1}
SPLIT = {"programs": 1 << 16, "block_n": 16}


def rel(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).norm() / ref.norm()).item()


def configure(overrides):
    for cfg in mhla.CONFIG.values():
        cfg.update({k: v for k, v in overrides.items() if k in cfg})


def rope_tables(n, d, gen):
    angle = (torch.rand(1, n, 1, d // 2, generator=gen, dtype=torch.float64) * 6.28).repeat_interleave(2, -1)
    return angle.cos(), angle.sin()


def op_case(grid, blocks, heads, d, dv, *, batch=2, dtype=torch.float32, normalize=True, feature="relu",
            rope=False, fused_qkv=False, launch=FEW, seed=0, scale=1.0):
    """Forward and q, k, v, mix gradients of the custom op against the fp64 reference (q, k, v ~ N(0, scale^2)),
    and the forward without autograd (inference)."""
    configure(launch)
    gen = torch.Generator().manual_seed(seed)
    n, m = math.prod(grid), math.prod(blocks)
    if fused_qkv:  # q, k, v as strided views of one (B, N, 3, h, D) projection
        q, k, v = torch.randn(batch, n, 3, heads, d, generator=gen).unbind(2)
    else:
        q, k = (torch.randn(batch, n, heads, d, generator=gen) for _ in range(2))
        v = torch.randn(batch, n, heads, dv, generator=gen)
    q, k, v = q * scale, k * scale, v * scale
    mix = locality_mix(blocks) + 0.1 * torch.rand(m, m, generator=gen, dtype=torch.float64)
    tables = rope_tables(n, d, gen) if rope else None
    do = torch.randn(batch, n, heads, v.shape[-1], generator=gen)
    kw = dict(normalize=normalize, feature=feature)

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [mix.float().requires_grad_()]
    rope32 = None if tables is None else tuple(t.float() for t in tables)
    out = mhla_attention(*leaves, grid, blocks, rope=rope32, backend="triton", **kw)
    out.backward(do.to(dtype))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = mhla_attention(*ref_leaves, grid, blocks, rope=tables, backend="torch", **kw)
    ref.backward(do.double())
    errors = {"o": rel(out, ref)}
    errors.update({f"d{x}": rel(a.grad, b.grad) for x, a, b in zip("qkv", leaves, ref_leaves)})
    errors["dmix"] = rel(leaves[3].grad, ref_leaves[3].grad)
    with torch.no_grad():
        errors["o no-grad"] = rel(mhla_attention(*leaves, grid, blocks, rope=rope32, backend="triton", **kw), ref)
    errors["dtype"] = str(out.dtype)
    return errors


def stage_case(launch):
    """Each launcher against its plain PyTorch meaning, `ops.naive.reference_*` (ragged blocks, RoPE, elu)."""
    configure(launch)
    gen = torch.Generator().manual_seed(1)
    grid, blocks, heads, d, dv, batch = (3, 5, 7), (2, 2, 3), 2, 24, 40, 2
    n = math.prod(grid)
    x = torch.randn(batch, n, heads, d, generator=gen)
    y = torch.randn(batch, n, heads, dv, generator=gen)
    rope = tuple(t.float() for t in rope_tables(n, d, gen))
    g = mhla.Geometry(x, y, block_geometry(grid, blocks))
    scale, weight = (torch.rand(g.BH, n, generator=gen) + 0.5 for _ in range(2))
    mat = torch.randn(g.M, g.BH, d, dv, generator=gen)  # block-major, as the kernels keep summaries
    vec = torch.rand(g.M, g.BH, d, generator=gen) + 0.5
    errors = {}

    s, z = mhla.block_summaries(x, y, rope, g, elu=True, with_z=True, y_scale=scale, z_weight=weight)
    s_ref, z_ref = naive.reference_summaries(x, y, rope, g, elu=True, y_scale=scale, z_weight=weight)
    errors["summary S"], errors["summary z"] = rel(s, s_ref), rel(z, z_ref)

    o = mhla.block_output(x, mat, vec, rope, g, elu=True, normalize=True, eps=1e-6, out_dtype=torch.float32)
    errors["output"] = rel(o, naive.reference_output(x, mat, vec, rope, g, elu=True, normalize=True, eps=1e-6))

    for stats, with_dy in ((True, False), (False, True)):
        got = mhla.block_grad(x, y, mat, vec, rope, g, elu=True, stats=stats, use_vec=True, with_dy=with_dy, eps=1e-6)
        want = naive.reference_grad(x, y, mat, vec, rope, g, elu=True, stats=stats, use_vec=True, eps=1e-6)
        for name, a, b in zip(("dx", "dy", "rden", "c"), got, want):
            if a is not None:
                errors[f"grad stats={stats} {name}"] = rel(a, b)

    a, b = torch.randn(g.M, g.BH, d, dv, generator=gen), torch.randn(g.M, g.BH, d, dv, generator=gen)
    errors["gram"] = rel(mhla.block_gram(a, b, torch.float32), torch.einsum("ibde,jbde->ij", a.double(), b.double()))
    return errors


def compile_case():
    """torch.compile(fullgraph=True) through the custom op, forward and backward, matches eager."""
    configure(FEW)
    gen = torch.Generator().manual_seed(2)
    grid, blocks = (2, 4, 6), (1, 2, 2)
    q, k, v = (torch.randn(1, 48, 2, 16, generator=gen, requires_grad=True) for _ in range(3))
    mix = locality_mix(blocks).float().requires_grad_()

    def f(q, k, v, mix):
        return mhla_attention(q, k, v, mix, grid, blocks, backend="triton").square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, mix)
    grads = torch.autograd.grad(loss, (q, k, v, mix))
    ref_loss = f(q, k, v, mix)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v, mix))
    errors = {"loss": rel(loss, ref_loss)}
    errors.update({f"grad{i}": rel(a, b) for i, (a, b) in enumerate(zip(grads, ref_grads))})
    return errors


def opcheck_case():
    """torch.library.opcheck: schema, fake tensor (output types per input type) and autograd registration, for the
    whole grid and for a slice of it (fp32 partial summaries)."""
    configure(FEW)
    gen = torch.Generator().manual_seed(3)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for dtype in (torch.float32, torch.bfloat16):
        for start, end in ((0, 24), (5, 17)):
            q, k, v = (torch.randn(1, end - start, 2, 8, generator=gen).to(dtype).requires_grad_() for _ in range(3))
            mix = torch.rand(4, 4, generator=gen, requires_grad=True)
            options = ([1, 4, 6, 1, 2, 2, start], True, 1e-6, "relu")
            torch.library.opcheck(mhla_summaries, (k, v, None, None, *options), test_utils=checks)
            s, z = (t.detach().requires_grad_() for t in mhla_summaries(k, v, None, None, *options))
            s = s.to(mhla.state_dtype(dtype)).detach().requires_grad_()
            torch.library.opcheck(mhla_output, (q, mix, s, z, None, None, *options), test_utils=checks)
    return {"ok": 0.0}


CASES = {
    "ragged relu normalized fused-qkv strides": lambda: op_case((2, 5, 7), (1, 2, 3), 2, 16, 16, fused_qkv=True),
    "elu rope unnormalized Dv!=D": lambda: op_case((1, 9, 11), (1, 2, 3), 3, 24, 40, batch=1, normalize=False,
                                                   feature="elu", rope=True),
    "rope normalized split programs": lambda: op_case((3, 4, 5), (2, 3, 2), 2, 16, 8, rope=True, launch=SPLIT),
    # as Wan uses it (RoPE, no normalizer: z neither accumulated nor mixed), summaries split over programs
    "rope unnormalized split programs": lambda: op_case((3, 4, 5), (2, 3, 2), 2, 16, 8, rope=True, normalize=False,
                                                        launch=SPLIT),
    "D=136 Dv=72 (tiled D and Dv)": lambda: op_case((2, 3, 5), (1, 2, 2), 1, 136, 72, batch=1, feature="elu"),
    "rope normalized D=136 Dv=72": lambda: op_case((2, 3, 5), (1, 2, 2), 1, 136, 72, batch=1, rope=True, seed=4),
    "fp16 rope": lambda: op_case((2, 5, 7), (1, 2, 3), 2, 16, 16, dtype=torch.float16, rope=True),
    # two 256-token blocks of N(0, 100^2) inputs: block sums reach ~1e5, beyond fp16 range (summaries stay fp32)
    "fp16 block sums beyond fp16 range": lambda: op_case((1, 16, 32), (1, 1, 2), 1, 16, 16, batch=1,
                                                         dtype=torch.float16, scale=100.0),
    "stages": lambda: stage_case(FEW),
    "stages split programs": lambda: stage_case(SPLIT),
    "torch.compile fullgraph": compile_case,
    "opcheck": opcheck_case,
}


def main(names):
    results = {}
    for name in names or CASES:
        try:
            results[name] = CASES[name]()
        except Exception:  # reported per case so one failure does not hide the others
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
