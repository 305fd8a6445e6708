"""`mhla-diffusion bench`: speed measurements. A command group; `op` times the attention operator.

Each benchmark is a `register_*_command(commands)` function adding its subcommand to the group.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch

from .bench_model import register_model_command
from .profiling import kernel_profile


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure speed on this machine's GPU")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    register_op_command(commands)
    register_model_command(commands)


def register_op_command(commands) -> None:
    op = commands.add_parser(
        "op",
        help="time MHLA (Triton, PyTorch reference) against SDPA and the memory floor",
        description="Forward and forward+backward times (median, triton.testing.do_bench) of the attention op.",
    )
    op.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], help="subset of shapes (default: all)")
    op.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    op.add_argument("--batch", type=int, default=1)
    op.add_argument("--check", action="store_true", help="first check Triton against the fp64 reference at real sizes")
    op.add_argument("--profile", action="store_true", help="also print where the Triton call's time goes (torch.profiler)")
    op.add_argument("--json", action="store_true", help="print JSON instead of a table")
    op.set_defaults(func=run_op)


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    d: int
    grid: tuple
    blocks: object = "auto"
    rope: bool = False  # Wan's 3D RoPE tables (1, N, 1, D), fp32, rotating the numerator
    normalize: bool = True


SHAPES = [
    Shape("DiT-XL/2 256px", 16, 72, (1, 16, 16)),
    Shape("DiT-XL/2 512px", 16, 72, (1, 32, 32)),
    Shape("DiT-XL/2 1024px", 16, 72, (1, 64, 64)),
    Shape("SANA-1.6B 1K", 70, 32, (1, 32, 32)),
    Shape("SANA-1.6B 4K", 70, 32, (1, 128, 128)),
    Shape("SANA-1.6B-like 4K 20x112", 20, 112, (1, 128, 128)),
    Shape("DiT-S/2 4096px", 6, 64, (1, 256, 256)),
    Shape("Wan2.1-1.3B 480p", 12, 128, (21, 30, 52), (3, 4, 5)),
    Shape("Wan2.1-1.3B 480p RoPE unnorm", 12, 128, (21, 30, 52), (3, 4, 5), rope=True, normalize=False),
    Shape("Wan2.1-14B 720p", 40, 128, (21, 45, 80), (3, 5, 8)),
]


def _copy_bandwidth(do_bench) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the floor's denominator."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _time_op(bench, fn, leaves, do, backward: bool) -> float:
    if not backward:
        with torch.no_grad():
            return bench(lambda: fn(*leaves), return_mode="median")
    return bench(lambda: fn(*leaves).backward(do), grad_to_none=leaves, return_mode="median")


def bench_shape(shape: Shape, dtype: torch.dtype, batch: int, bandwidth: float, profile: bool = False) -> dict:
    """Eager times of SDPA, the reference and Triton; Triton also replayed from a CUDA graph (GPU time
    alone, as under torch.compile with CUDA graphs), since eager calls can be bound by Python launch cost."""
    from triton.testing import do_bench, do_bench_cudagraph

    from ..blocks import locality_mix, resolve_blocks
    from ..kernels import op
    from ..ops import mhla_attention

    blocks = resolve_blocks(shape.grid, shape.blocks)
    n, m = math.prod(shape.grid), math.prod(blocks)
    q, k, v, do = (torch.randn(batch, n, shape.heads, shape.d, device="cuda", dtype=dtype) for _ in range(4))
    mix = locality_mix(blocks).float().cuda()
    angles = torch.rand(1, n, 1, shape.d // 2, device="cuda").repeat_interleave(2, dim=-1) * 6.28
    rope = (angles.cos(), angles.sin()) if shape.rope else None
    row_bytes = q.numel() * q.element_size()
    leaves = [t.requires_grad_() for t in (q, k, v, mix)]

    def sdpa(q, k, v, mix):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    def mhla(backend):
        return lambda q, k, v, mix: mhla_attention(q, k, v, mix, shape.grid, blocks, rope=rope, normalize=shape.normalize,
                                                     backend=backend)

    row = {"shape": shape.name, "N": n, "heads": shape.heads, "D": shape.d, "blocks": list(blocks), "M": m,
           "blocks_chosen": "auto" if shape.blocks == "auto" else "fixed",
           "floor_fwd_ms": 4 * row_bytes / bandwidth * 1e3, "floor_fwdbwd_ms": 11 * row_bytes / bandwidth * 1e3}
    for name, fn in (("sdpa", sdpa), ("torch", mhla("torch")), ("triton", mhla("triton"))):
        for backward, key in ((False, "fwd"), (True, "fwdbwd")):
            row[f"{name}_{key}_ms"] = _time_op(do_bench, fn, leaves, do, backward)
            torch.cuda.empty_cache()
    for backward, key in ((False, "fwd"), (True, "fwdbwd")):
        try:
            row[f"triton_graph_{key}_ms"] = _time_op(do_bench_cudagraph, mhla("triton"), leaves, do, backward)
        except RuntimeError as err:  # capture refused: report it, keep the eager numbers
            row[f"triton_graph_{key}_ms"], row["graph_error"] = math.nan, str(err).splitlines()[0]
        row[f"triton_{key}_floor_frac"] = row[f"floor_{key}_ms"] / row[f"triton_{key}_ms"]
        row[f"triton_graph_{key}_floor_frac"] = row[f"floor_{key}_ms"] / row[f"triton_graph_{key}_ms"]
    if n <= op.DENSE_MAX_TOKENS:  # no-grad forwards here take the dense kernel: time the linear path beside it
        cos, sin = rope if rope else (None, None)

        def linear(q, k, v, mix):
            return op.mhla_fwd(q, k, v, mix, cos, sin, list(shape.grid), list(blocks), shape.normalize, 1e-6, "relu")[0]

        row["linear_graph_fwd_ms"] = _time_op(do_bench_cudagraph, linear, leaves, do, False)
    if profile:
        for backward, what in ((False, "forward"), (True, "forward+backward")):
            fn = mhla("triton")
            call = (lambda: fn(*leaves).backward(do)) if backward else (lambda: fn(*[t.detach() for t in leaves]))
            print(f"--- profile: {shape.name}, Triton {what} ---\n{kernel_profile(call)}", flush=True)
    return row


def _table(rows: list[dict], device: str, bandwidth: float, dtype: str, batch: int) -> str:
    lines = [
        f"{device}, {dtype}, B = {batch}, medians of triton.testing.do_bench in ms (graph: do_bench_cudagraph, "
        f"GPU time without Python launch cost); copy bandwidth {bandwidth / 1e12:.2f} TB/s. floor: read q, k, v "
        "and write o once (fwd); plus read q, k, v, dO and write dq, dk, dv (f+b). %: floor / Triton (eager, graph).",
        "",
        "| shape | N | heads x D | blocks (M) | floor fwd | SDPA fwd | torch fwd | Triton fwd | graph | % "
        "| floor f+b | SDPA f+b | torch f+b | Triton f+b | graph | % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        blocks = f"{'x'.join(map(str, r['blocks']))} ({r['M']}, {r['blocks_chosen']})"
        cells = [r["shape"], f"{r['N']:,}", f"{r['heads']} x {r['D']}", blocks]
        for key in ("fwd", "fwdbwd"):
            cells += [f"{r[f'{name}_{key}_ms']:.3f}" for name in ("floor", "sdpa", "torch", "triton", "triton_graph")]
            cells.append(f"{100 * r[f'triton_{key}_floor_frac']:.0f}, {100 * r[f'triton_graph_{key}_floor_frac']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    small = [r for r in rows if "linear_graph_fwd_ms" in r]
    if small:
        lines += ["", "Forward without gradients at small N (GPU time, CUDA graph): the dense kernel the op takes "
                  "vs the linear path.", "", "| shape | N | dense | linear | SDPA (eager) |", "|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['N']:,} | {r['triton_graph_fwd_ms']:.3f} | {r['linear_graph_fwd_ms']:.3f} "
                  f"| {r['sdpa_fwd_ms']:.3f} |" for r in small]
    return "\n".join(lines)


def _check_table(results: list[dict]) -> str:
    lines = ["| case | dtype | N | M | heads x D/Dv | o | dq | dk | dv | dmix | o no-grad | ok |", "|---" * 12 + "|"]
    for r in results:
        e = r["errors"]
        errs = " | ".join(f"{e[x]:.1e}" for x in ("o", "dq", "dk", "dv", "dmix", "o no-grad"))
        lines.append(f"| {r['case']} | {r['dtype']} | {r['N']:,} | {r['M']} | {r['heads']} x {r['D']}/{r['Dv']} "
                     f"| {errs} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def run_op(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench op needs a CUDA GPU")
    from triton.testing import do_bench

    dtype = getattr(torch, args.dtype)
    report = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "batch": args.batch}
    if args.check:
        from ..kernels.check import run_checks

        report["check"] = run_checks()
    report["bandwidth_Bps"] = bandwidth = _copy_bandwidth(do_bench)
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    report["rows"] = [bench_shape(s, dtype, args.batch, bandwidth, args.profile) for s in shapes]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        if args.check:
            print(_check_table(report["check"]), end="\n\n")
        print(_table(report["rows"], report["device"], bandwidth, args.dtype, args.batch))
    failed = [r["case"] for r in report.get("check", []) if not r["ok"]]
    if failed:
        raise ValueError(f"Triton kernels off the fp64 reference in: {', '.join(failed)}")
    return 0
