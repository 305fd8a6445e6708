"""Developer tool: where the time of one MHLA call goes, stage by stage, and launch-config sweeps.

    python -c "from mhla_diffusion.kernels.tune import main; main()" [--tune summary output grad gram mix]
        [--sweep rope|short|rms_norm] [--shapes wan480 ... wan480auto ... dit512 ...]

Prints median ms (triton.testing.do_bench) of each stage of forward and backward at the
Wan2.1 shapes (or `--shapes`); with --tune KERNEL..., first a coordinate descent over SWEEP for those kernels'
`mhla.CONFIG` entries on the first shape. The chosen values are copied into `mhla.CONFIG`. `--sweep rms_norm` times
`rms_norm.CONFIG`'s candidates at the norms a Wan layer runs around the op in training (`RMS_NORM_SHAPES`).
"""

from __future__ import annotations

import argparse
import math

import torch
from triton.testing import do_bench, do_bench_cudagraph

from ..blocks import block_geometry, locality_mix, resolve_blocks
from ..ops import mhla_attention  # the whole op as callers get it: a developer tool, not the kernels' own import
from . import fitting, mhla, rms_norm

SHAPES = {
    "wan480": (12, 128, (21, 30, 52), (3, 4, 5)), "wan720": (40, 128, (21, 45, 80), (3, 5, 8)),
    # the blocks a converted Wan runs ('auto': 180 at 480p, 252 at 14B 720p), where the mixing GEMM is a third of the op
    **{name + "auto": (heads, d, grid, resolve_blocks(grid, "auto")) for name, heads, d, grid in (
        ("wan480", 12, 128, (21, 30, 52)), ("wan720", 40, 128, (21, 45, 80)))},
    # short blocks (mhla.SHORT_BLOCK), in the op's 'auto' cut: DiT-XL/2 at 512 and 1024 px, SANA-1.6B at 1K
    **{name: (heads, d, grid, resolve_blocks(grid, "auto")) for name, heads, d, grid in (
        ("dit512", 16, 72, (1, 32, 32)), ("dit1024", 16, 72, (1, 64, 64)), ("sana1k", 70, 32, (1, 32, 32)))},
}
SWEEP = {
    "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3), "programs": (256, 1024, 4096),
    "max_dv": (64, 128), "block_k": (32, 64, 128), "maxnreg": (None, 128, 168),
    "block_f": (64, 128),
}
KERNEL_STAGES = {
    "summary": ("fwd: summaries", "bwd: dS~ summaries"),
    "gram": ("bwd: mix^T, dmix",),
    "output": ("fwd: output",),
    "grad": ("bwd: dq + stats", "bwd: dk, dv"),
    "mix": ("fwd: mix (S and z)", "bwd: mix^T, dmix"),
}


def _inputs(heads, d, grid, blocks):
    n = math.prod(grid)
    q, k, v, do = (torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, do, locality_mix(blocks).float().cuda()


def stages(name: str) -> dict:
    """Median ms of each kernel / GEMM of one forward and backward (where `mhla.keeps_mixed` does not hold, the
    backward runs the forward's mix stage once more). Where the q-side grad launch also makes dO's summaries
    (`mhla.summarizes`), "bwd: dq + stats" includes them and there is no "bwd: dS~ summaries"."""
    heads, d, grid, blocks = SHAPES[name]
    q, k, v, do, mix = _inputs(heads, d, grid, blocks)
    g = mhla.Geometry(q, v, block_geometry(grid, blocks))
    kw = dict(elu=False, eps=1e-6)
    s, z = mhla.block_summaries(k, v, None, g, elu=False, with_z=True)
    ms, mz = mhla.mix_summaries(mix, s, z, q.dtype)
    dq, _, rden, c, summaries = mhla.block_grad(q, do, ms, mz, None, g, stats=True, use_vec=True, with_dy=False,
                                                summarize=True, **kw)
    apart = {} if summaries else {"bwd: dS~ summaries": lambda: mhla.block_summaries(
        q, do, None, g, elu=False, with_z=True, y_scale=rden, z_weight=c)}
    dms, dmz = summaries or apart["bwd: dS~ summaries"]()
    timed = {
        "fwd: summaries": lambda: mhla.block_summaries(k, v, None, g, elu=False, with_z=True),
        "fwd: mix (S and z)": lambda: mhla.mix_summaries(mix, s, z, q.dtype),
        "fwd: output": lambda: mhla.block_output(q, ms, mz, None, g, normalize=True, out_dtype=q.dtype, **kw),
        "bwd: dq + stats": lambda: mhla.block_grad(q, do, ms, mz, None, g, stats=True, use_vec=True, with_dy=False,
                                                   summarize=True, **kw),
        **apart,
        "bwd: mix^T, dmix": lambda: mhla.mix_back(mix, dms, dmz, s, z, q.dtype),
        "bwd: dk, dv": lambda: mhla.block_grad(k, v, ms, mz, None, g, stats=False, use_vec=True, with_dy=True, **kw),
    }
    return {key: do_bench(fn, return_mode="median") for key, fn in timed.items()}


def op_times(name: str, as_used: bool = False) -> tuple[float, float]:
    """GPU time (CUDA graph replay) of the whole op, forward and forward+backward: eager calls at these
    sizes also carry Python launch cost, which varies from host to host. `as_used`: as Wan uses it (fp32
    RoPE tables (1, N, 1, D) on the numerator, no normalizer)."""
    heads, d, grid, blocks = SHAPES[name]
    q, k, v, do, mix = _inputs(heads, d, grid, blocks)
    leaves = [t.requires_grad_() for t in (q, k, v, mix)]
    kw = {}
    if as_used:
        angles = torch.rand(1, q.shape[1], 1, d // 2, device="cuda").repeat_interleave(2, dim=-1) * 6.28
        kw = dict(rope=(angles.cos(), angles.sin()), normalize=False)
    fn = lambda: mhla_attention(*leaves, grid, blocks, backend="triton", **kw)  # noqa: E731
    with torch.no_grad():
        fwd = do_bench_cudagraph(fn, return_mode="median")
    return fwd, do_bench_cudagraph(lambda: fn().backward(do), grad_to_none=leaves, return_mode="median")


def tune(kernel: str, shape: str) -> None:
    """Coordinate descent over SWEEP on the summed time of the kernel's stages; leaves the best in CONFIG."""
    def cost():
        times = stages(shape)
        return sum(times.get(k, 0.0) for k in KERNEL_STAGES[kernel])

    best = cost()
    for key, values in SWEEP.items():
        if key not in mhla.CONFIG[kernel]:
            continue
        current = mhla.CONFIG[kernel][key]
        for value in values:
            if value == current:
                continue
            mhla.CONFIG[kernel][key] = value
            try:
                t = cost()
            except Exception as err:  # a config the compiler rejects (e.g. out of shared memory)
                print(f"tune {kernel} {key}={value}: {type(err).__name__}")
                continue
            print(f"tune {kernel} {key}={value}: {t:.4f} ms (best {best:.4f})")
            if t < best:
                best, current = t, value
        mhla.CONFIG[kernel][key] = current
    print(f"tune {kernel}: {mhla.CONFIG[kernel]} {best:.4f} ms")


# Launch-option overrides tried for the RoPE variants (mhla.ROPE_CONFIG), one kernel at a time.
ROPE_CANDIDATES = {
    # 2026-12-01, first sweep (H200): {} (4 warps, 2 stages), {8, 1} (kept), {8, 2}, {block_n 32, 8, 2}; summary
    # {}, {stages 2}, {block_n 16}, {stages 2, no register cap}: none beat {}. Second sweep, below: grad {16, 1} kept
    # (~1 % over {8, 1}), summary {} kept (kernels/NOTES.md, fifth pass). Third sweep (session 34), with the bf16
    # tables the op has passed since the fifth pass (sm_90 on CPU: grad dk/dv at 16 warps, 2 stages keeps 126
    # registers and gets async copies, which 1 stage has none of; 32 tokens on 8 warps, 128 registers, no spill).
    "grad": ({"num_warps": 16, "num_stages": 1}, {"num_warps": 16, "num_stages": 2}, {"num_warps": 8, "num_stages": 2},
             {"block_n": 32, "num_warps": 8, "num_stages": 2}),
    "summary": ({}, {"num_stages": 2}, {"num_stages": 4}, {"block_n": 64}),
    "output": ({}, {"num_warps": 8}),
}
# Overrides tried for short blocks (mhla.SHORT_CONFIG): one or two token tiles a program. 2026-12-01, first sweep
# (H200, dit512 dit1024 sana1k): summary {block_n 64, 2 stages}, output {block_n 16, 4 warps}, grad {block_n 32}
# kept (grad: f+b -29 % at both DiT sizes); 4-warp summaries won at SANA 1K only, split blocks lost everywhere.
SHORT_CANDIDATES = {
    "summary": ({}, {"block_n": 64, "num_stages": 2}, {"block_n": 64, "num_warps": 4, "num_stages": 2},
                {"num_warps": 4}, {"block_n": 16, "num_warps": 4, "num_stages": 2}, {"programs": 2048}),
    "output": ({}, {"block_n": 32}, {"block_n": 32, "num_warps": 4}, {"num_warps": 4},
               {"block_n": 16, "num_warps": 4}, {"block_n": 32, "programs": 4096}),
    "grad": ({}, {"block_n": 32}, {"block_n": 32, "num_warps": 8}, {"num_warps": 8, "num_stages": 1},
             {"block_n": 16}, {"block_n": 32, "programs": 4096}),
}
# name: (override table, candidates, time the op as Wan uses it, default shapes: where the table applies)
SWEEPS = {"rope": (mhla.ROPE_CONFIG, ROPE_CANDIDATES, True, ("wan480", "wan720")),
          "short": (mhla.SHORT_CONFIG, SHORT_CANDIDATES, False, ("dit512", "dit1024", "sana1k"))}


def sweep(kind: str, shapes=None) -> dict:
    """Whole-op GPU time (fwd, f+b; as Wan uses it for the RoPE variants) for each candidate override of the
    sweep's table (mhla.ROPE_CONFIG or mhla.SHORT_CONFIG), kernel by kernel: the summed fwd + f+b over `shapes`
    decides (the RoPE sweeps before 2026-12-01, session 27, summed f+b alone). An entry's settings that no candidate
    of its kernel sets are kept under each candidate and in the winner. Then the winners together, the plain op beside
    them (RoPE), the empty candidates (drift within the call); the table is left holding the winners, which are
    returned (a kernel whose every candidate failed keeps the override it had)."""
    table, candidates, as_used, default_shapes = SWEEPS[kind]
    shapes = shapes or default_shapes
    if kind == "short" and not any(_max_block_tokens(name) <= mhla.SHORT_BLOCK for name in shapes):
        raise ValueError(f"no shape among {shapes} has blocks of <= {mhla.SHORT_BLOCK} tokens: SHORT_CONFIG would not "
                         "apply; pick short shapes (dit512, dit1024, sana1k)")
    winners = {kernel: dict(table.get(kernel, {})) for kernel in candidates}
    # an entry's settings that no candidate sets (the summaries' "num_stages") are kept under every candidate
    kept = {kernel: {key: value for key, value in winners[kernel].items() if not any(key in c for c in options)}
            for kernel, options in candidates.items()}
    try:
        for kernel, options in candidates.items():
            best = None
            for cand in options:
                table[kernel] = {**kept[kernel], **cand}
                try:
                    times = {name: op_times(name, as_used=as_used) for name in shapes}
                except Exception as err:  # a config the compiler rejects
                    print(f"{kind} {kernel} {cand}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                    continue
                cost = sum(f + fb for f, fb in times.values())
                print(f"{kind} {kernel} {cand}: " + ", ".join(f"{n} {f:.4f} / {fb:.4f}" for n, (f, fb) in times.items()),
                      flush=True)
                if best is None or cost < best[0]:
                    best = (cost, table[kernel])
            if best is not None:
                winners[kernel] = dict(best[1])
            table[kernel] = dict(winners[kernel])
            print(f"{kind} {kernel}: keep {winners[kernel]}", flush=True)
        print(f"{kind} final " + ", ".join(f"{n} {'%.4f / %.4f' % op_times(n, as_used=as_used)}" for n in shapes))
        if as_used:
            print("plain      " + ", ".join(f"{n} {'%.4f / %.4f' % op_times(n)}" for n in shapes))
        for kernel in candidates:
            table[kernel] = dict(kept[kernel])
        print(f"{kind} none  " + ", ".join(f"{n} {'%.4f / %.4f' % op_times(n, as_used=as_used)}" for n in shapes),
              flush=True)
    finally:
        table.update({kernel: dict(w) for kernel, w in winners.items()})
    return winners


# (rows, groups, width): a Wan layer's q or k across heads and its per-head output norm, at 1.3B 480p and 14B 720p
RMS_NORM_SHAPES = {"1.3B q/k": (32760, 1, 1536), "1.3B out": (32760, 12, 128),
                   "14B q/k": (75600, 1, 5120), "14B out": (75600, 40, 128)}
RMS_NORM_CANDIDATES = {
    "forward": [dict(tile=t, num_warps=w) for t in (1024, 2048, 4096, 8192) for w in (4, 8, 16)],
    "backward": [dict(tile=t, num_warps=w, programs_per_sm=p) for t in (1024, 2048, 4096, 8192) for w in (4, 8, 16)
                 for p in (2, 4, 8, 16)],
}


def sweep_rms_norm() -> dict:
    """GPU ms of each `rms_norm.CONFIG` candidate, per kernel, at `RMS_NORM_SHAPES` in bf16 with an fp32 weight; the
    candidate with the least mean time relative to each shape's best wins and is left in `rms_norm.CONFIG`."""
    inputs = {}
    for name, (rows, groups, width) in RMS_NORM_SHAPES.items():
        x = torch.randn(rows, groups * width, device="cuda", dtype=torch.bfloat16)
        weight = 1 + 0.1 * torch.randn(groups * width, device="cuda")
        inputs[name] = (x, weight, torch.randn_like(x), groups, rms_norm.rms_norm_forward(x, weight, groups, 1e-6)[1])
    calls = {"forward": lambda x, w, dy, g, rstd: rms_norm.rms_norm_forward(x, w, g, 1e-6),
             "backward": lambda x, w, dy, g, rstd: rms_norm.rms_norm_backward(dy, x, w, rstd, g)}
    for kernel, candidates in RMS_NORM_CANDIDATES.items():
        times = []
        for cand in candidates:
            rms_norm.CONFIG[kernel] = cand
            # GPU time (graph replay): eager timing of these 0.1-ms launches also counts the host's launch cost
            times.append({n: do_bench_cudagraph(lambda: calls[kernel](*args), return_mode="median")
                          for n, args in inputs.items()})
            print(f"rms_norm {kernel} {cand}: " + ", ".join(f"{n} {ms:.4f}" for n, ms in times[-1].items()), flush=True)
        best = {n: min(t[n] for t in times) for n in inputs}
        score = [sum(t[n] / best[n] for n in inputs) / len(inputs) for t in times]
        rms_norm.CONFIG[kernel] = candidates[score.index(min(score))]
        print(f"rms_norm {kernel}: keep {rms_norm.CONFIG[kernel]} ({min(score):.3f} x each shape's best)", flush=True)
    return rms_norm.CONFIG


def _max_block_tokens(name: str) -> int:
    """Tokens of the fullest block of a SHAPES entry (the `max_len` the launch config sees)."""
    _, _, grid, blocks = SHAPES[name]
    return block_geometry(grid, blocks).slice_blocks(0, math.prod(grid))[2]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", nargs="*", choices=list(mhla.CONFIG), help="kernels whose config to tune")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                        help="default: the Wan shapes; for --sweep, the shapes its table applies to")
    parser.add_argument("--sweep", choices=[*SWEEPS, "rms_norm"],
                        help="only sweep the launch-option overrides of the RoPE variants or of short blocks, or the "
                             "RMSNorm kernels' settings")
    args = parser.parse_args(argv)
    with fitting.as_asked():  # a candidate the card refuses is skipped, not timed at smaller settings
        _run(args)


def _run(args) -> None:
    if args.sweep == "rms_norm":
        sweep_rms_norm()
        return
    if args.sweep:
        sweep(args.sweep, args.shapes)
        return
    shapes = args.shapes or ["wan480", "wan720"]
    for kernel in args.tune or ():
        if _max_block_tokens(shapes[0]) <= mhla.SHORT_BLOCK:
            raise ValueError(f"{shapes[0]} has short blocks, where SHORT_CONFIG masks CONFIG: use --sweep short")
        tune(kernel, shapes[0])
    for name in shapes:
        for stage, ms in stages(name).items():
            print(f"{name:7s} {stage:22s} {ms:.4f} ms")
        print(f"{name:7s} op fwd / fwd+bwd        {'%.4f / %.4f' % op_times(name)} ms")
