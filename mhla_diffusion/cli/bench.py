"""`mhla-diffusion bench`: speed measurements. A command group; `op` times the attention operator.

Each benchmark is a `register_*_command(commands)` function adding its subcommand to the group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from dataclasses import dataclass

import torch

from .bench_layer import IN_LAYER, layer_leaves, layer_of, less_projections, projections_only
from .bench_model import register_model_command
from .profiling import kernel_profile


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure speed on this machine's GPU")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    settings = settings_option()
    register_op_command(commands, settings)
    register_model_command(commands, settings)


def settings_option() -> argparse.ArgumentParser:
    """The `--set` option every bench command takes (a parent parser)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--set", nargs="+", action="extend", default=[], metavar="TABLE.KEY=VALUE",
                        help="run with kernel launch settings changed, e.g. \"parallel.CONFIG.split_heads=('forward',)\" "
                             "(a table of kernels/: mhla.CONFIG, mhla.SHORT_CONFIG, parallel.CONFIG, rms_norm.CONFIG, "
                             "...; keys it has; a Python literal): a candidate timed and checked as shipped ones are")
    return parent


def register_op_command(commands, settings: argparse.ArgumentParser) -> None:
    op = commands.add_parser(
        "op", parents=[settings],
        help="time MHLA (Triton) against cuDNN and FlashAttention-2 SDPA, global linear attention and the memory floor",
        description="Forward and forward+backward GPU times of the attention op and its peers, in one process: "
                    "CUDA-graph replay where capture works, eager otherwise.",
    )
    op.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], metavar="SHAPE",
                    help="subset of shapes, each quoted (default: all): " + ", ".join(f"'{s.name}'" for s in SHAPES))
    op.add_argument("--impls", nargs="+", choices=list(IMPLS), help="subset of implementations (default: all)")
    op.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    op.add_argument("--batch", type=int, default=1)
    op.add_argument("--check", nargs="*", metavar="CASE",
                    help="first check Triton against the fp64 reference at real sizes: every case, or those whose "
                         "names hold a CASE (dit-xl-256 dit-xl-384: the quadratic form's)")
    op.add_argument("--profile", action="store_true", help="also print where the Triton call's time goes (torch.profiler)")
    modes = op.add_mutually_exclusive_group()
    modes.add_argument("--versus", nargs="+", metavar="SETTINGS",
                       help="instead of the peers, time MHLA with the settings in force against each SETTINGS on top "
                            "of them (TABLE.KEY=VALUE as --set takes, several joined by ';'), in turn, --rounds times, "
                            "in this one process: an A/B whose table gives each its median and range; with --check, "
                            "the cases are checked under each SETTINGS too")
    modes.add_argument("--shard", nargs="+", type=int, metavar="P",
                       help="instead of the peers, time MHLA on each rank's token slice of the sequence split over P "
                            "ranks (context parallel) on this one GPU, P = 1 too: the rank's kernels, without the "
                            "all-reduces of the summaries and of their gradients (see shard_rows)")
    op.add_argument("--in-layer", action="store_true",
                    help="time each call inside a self-attention layer's projections (q, k, v from x before it, the "
                         "output projection after: cuBLAS GEMMs, as a model runs it), less those projections alone; "
                         "with --versus too")
    op.add_argument("--rounds", type=int, help="rounds of --versus (default 3)")
    op.add_argument("--shared-memory", type=int, metavar="BYTES",
                    help="launch as a card with BYTES of shared memory per program would (101376: an RTX 4090 or "
                         "L40S; 166912: an A100): the kernels step down to the settings such a card takes, checked "
                         "and timed on this one")
    op.add_argument("--json", action="store_true", help="print JSON instead of a table")
    op.set_defaults(func=run_op)


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    d: int
    grid: tuple
    blocks: object = "auto"
    # Also time MHLA as Wan uses it: Wan's 3D RoPE tables (1, N, 1, D), fp32, on the numerator, no normalizer.
    as_used: bool = False


SHAPES = [
    Shape("DiT-XL/2 256px", 16, 72, (1, 16, 16)),
    Shape("DiT-XL/2 384px", 16, 72, (1, 24, 24)),  # 576 tokens: PixArt's aspect-ratio buckets lie between these
    Shape("DiT-XL/2 512px", 16, 72, (1, 32, 32)),
    Shape("DiT-XL/2 1024px", 16, 72, (1, 64, 64)),
    Shape("SANA-1.6B 512px", 70, 32, (1, 16, 16)),
    Shape("SANA-1.6B 1K", 70, 32, (1, 32, 32)),
    Shape("SANA-1.6B 4K", 70, 32, (1, 128, 128)),
    Shape("SANA-1.6B-like 4K 20x112", 20, 112, (1, 128, 128)),
    Shape("DiT-S/2 4096px", 6, 64, (1, 256, 256)),
    Shape("Wan2.1-1.3B 480p", 12, 128, (21, 30, 52), (3, 4, 5), as_used=True),
    Shape("Wan2.1-14B 720p", 40, 128, (21, 45, 80), (3, 5, 8), as_used=True),
    # the blocks a converted Wan runs at its released size ("auto", the default: M^2 <= N), three to five times
    # the blocks above: larger summaries, a larger mixing GEMM, shorter blocks
    Shape("Wan2.1-1.3B 480p, model's blocks", 12, 128, (21, 30, 52), as_used=True),
    Shape("Wan2.1-14B 720p, model's blocks", 40, 128, (21, 45, 80), as_used=True),
]

# Implementations timed, in table order: (label, whether its backward can be replayed from a CUDA graph here).
# SDPA's backward is timed eagerly, with the GPU held back while the calls are queued (`queued_gpu_ms`).
IMPLS = {
    "cudnn": ("cuDNN SDPA", False),
    "fa2": ("FA2 SDPA", False),
    "linear": ("global linear", True),
    "mhla": ("MHLA", True),
    "mhla_used": ("MHLA as used", True),
    # as used, with Wan's q/k RMSNorms across heads and MHLA's output norm: in PyTorch passes around the op, and
    # applied by the kernels on the way (forward without autograd; with it, the RMSNorm kernels around the op)
    "mhla_norm_passes": ("as used + norm passes", True),
    "mhla_norms": ("as used, norms on the way", True),
}


def global_linear(q, k, v, mix=None):
    """Plain linear attention over all tokens, relu(q) @ (relu(k)^T v), two einsums, no normalizer: the
    cheapest linear attention there is (SANA's own is this), one summary per head."""
    kv = torch.einsum("bnhd,bnhe->bhde", torch.relu(k), v)
    return torch.einsum("bnhd,bhde->bnhe", torch.relu(q), kv)


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def sdpa(q, k, v, mix=None):
        with sdpa_kernel(chosen):
            out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2))
        return out.transpose(1, 2)

    return sdpa


def implementations(shape: Shape, blocks, rope) -> dict:
    """name -> fn(q, k, v, mix) for every implementation that applies to this shape (peers ignore mix)."""
    from ..ops import mhla_attention

    def mhla(rope, normalize):
        return lambda q, k, v, mix: mhla_attention(q, k, v, mix, shape.grid, blocks, rope=rope, normalize=normalize,
                                              backend="triton")

    fns = {"cudnn": _sdpa("CUDNN_ATTENTION"), "fa2": _sdpa("FLASH_ATTENTION"), "linear": global_linear,
           "mhla": mhla(None, True)}
    if shape.as_used:
        fns["mhla_used"] = mhla(rope, False)
        fns.update(_with_norms(shape, blocks, rope))
    return fns


def _with_norms(shape: Shape, blocks, rope) -> dict:
    """MHLA as used with a Wan layer's RMSNorms (random weights near 1): as PyTorch passes around the op, and
    handed to the op (`ops.norms`), which applies them on the way where it can."""
    from ..blocks import block_geometry
    from ..ops import MHLAOptions, mhla_op
    from ..ops.norms import Norms

    geometry, options = block_geometry(shape.grid, blocks), MHLAOptions(normalize=False)
    weights = [1 + 0.1 * torch.randn(shape.heads * shape.d, device="cuda") for _ in range(2)]
    weights.append(1 + 0.1 * torch.randn(shape.heads, shape.d, device="cuda"))
    by_dtype = {}

    def norms_for(q):  # in the model's dtype, as its modules hold them: made once, outside the timed calls
        if q.dtype not in by_dtype:
            wq, wk, gain = (w.to(q.dtype) for w in weights)
            by_dtype[q.dtype] = Norms(wq, wk, 1e-6, gain)
        return by_dtype[q.dtype]

    def passes(q, k, v, mix):
        norms = norms_for(q)
        q, k = norms.inputs(q, k)
        return norms.output(mhla_op(q, k, v, mix, geometry, options, rope=rope, backend="triton"))

    def on_the_way(q, k, v, mix):
        return mhla_op(q, k, v, mix, geometry, options, rope=rope, backend="triton", norms=norms_for(q))

    return {"mhla_norm_passes": passes, "mhla_norms": on_the_way}


def _copy_bandwidth(do_bench) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the floor's denominator."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _call(fn, leaves, do, backward: bool):
    """One call of `fn` on the leaves: without gradients, or forward+backward with the leaves' grads reset."""
    if not backward:
        def call():
            with torch.no_grad():
                fn(*leaves)
        return call

    def step():
        fn(*leaves).backward(do)
        for t in leaves:
            t.grad = None
    return step


def time_op(bench, fn, leaves, do, backward: bool) -> float:
    if not backward:
        with torch.no_grad():
            return bench(lambda: fn(*leaves), return_mode="median")
    return bench(lambda: fn(*leaves).backward(do), grad_to_none=leaves, return_mode="median")


SLEEP_CYCLES_PER_MS = 1.98e6  # torch.cuda._sleep counts SM cycles: H200's top clock (a slower clock holds longer)


def queued_gpu_ms(call, repeats: int = 3, budget_ms: float = 50.0) -> float:
    """GPU time per call of eager `call`s without Python launch cost: the stream is held by a sleep kernel
    while the calls are queued behind it, so they run back to back between two CUDA events (median of
    `repeats`). For calls that cannot be replayed from a CUDA graph."""
    import time

    call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - t0) * 1e3  # GPU plus CPU time: bounds the CPU time of queueing one call
    calls = max(1, min(50, int(budget_ms / once_ms)))
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A call of over 100 ms is GPU-bound: launch cost cannot open gaps in it, so the hold stays short.
        torch.cuda._sleep(int(min(1.5 * calls * once_ms, 100.0) * SLEEP_CYCLES_PER_MS))
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def time_impl(fn, leaves, do, backward: bool, graph: bool) -> dict:
    """{"ms": GPU time, "how": "graph" | "queued", "eager_ms": ...}. GPU time is CUDA-graph replay where
    `graph` and capture works, else `queued_gpu_ms`; "queued_ms" is also taken beside a graph time, as a
    cross-check of the two. eager_ms is the eager median of do_bench, Python launch cost included."""
    from triton.testing import do_bench, do_bench_cudagraph

    out = {"eager_ms": time_op(do_bench, fn, leaves, do, backward),
           "queued_ms": queued_gpu_ms(_call(fn, leaves, do, backward))}
    if graph:
        try:
            out.update(ms=time_op(do_bench_cudagraph, fn, leaves, do, backward), how="graph")
            return out
        except RuntimeError as err:  # capture refused: the queued eager time stands
            out["graph_error"] = str(err).splitlines()[0]
    out.update(ms=out["queued_ms"], how="queued")
    return out


def ratios(row: dict) -> dict:
    """MHLA against cuDNN and global linear attention, and MHLA as used against plain MHLA, per pass
    (> 1: MHLA slower). Missing or failed timings give NaN."""
    def ms(name, key):
        return row.get("times", {}).get(name, {}).get(key, {}).get("ms", math.nan)

    out = {}
    for key in ("fwd", "fwdbwd"):
        mhla = ms("mhla", key)
        out[f"mhla_vs_cudnn_{key}"] = mhla / ms("cudnn", key)
        out[f"mhla_vs_linear_{key}"] = mhla / ms("linear", key)
        out[f"used_vs_mhla_{key}"] = ms("mhla_used", key) / mhla
    return out


def shape_inputs(shape: Shape, dtype: torch.dtype, batch: int):
    """What every timed call of a shape takes: its block geometry, q, k, v and the output's gradient (random, in
    `dtype`), a locality mixing matrix (fp32) and fp32 RoPE tables (cos, sin) as a converted model's rotary
    embedding hands them to its layers (`RoPETables`: rounded for the kernels on a forward's first layer, here before
    the timed calls; a Wan forward rounds once for its 30 layers, 21 us at 480p on an H100)."""
    from ..blocks import block_geometry, locality_mix
    from ..ops.rope import RoPETables

    geometry = block_geometry(shape.grid, shape.blocks)
    n = geometry.num_tokens
    q, k, v, do = (torch.randn(batch, n, shape.heads, shape.d, device="cuda", dtype=dtype) for _ in range(4))
    mix = locality_mix(geometry.blocks).float().cuda()
    angles = torch.rand(1, n, 1, shape.d // 2, device="cuda").repeat_interleave(2, dim=-1) * 6.28
    return geometry, (q, k, v, do), mix, RoPETables((angles.cos(), angles.sin()))


def bench_shape(shape: Shape, dtype: torch.dtype, batch: int, bandwidth: float, profile: bool = False,
                impls=None, in_layer: bool = False) -> dict:
    """GPU times of each implementation (see `time_impl`), forward and forward+backward, same inputs; `in_layer`:
    inside a layer's projections, less the projections alone (`bench_layer`)."""
    geometry, (q, k, v, do), mix, rope = shape_inputs(shape, dtype, batch)
    blocks = geometry.blocks
    n, m = geometry.num_tokens, geometry.num_blocks
    row_bytes = q.numel() * q.element_size()
    leaves = [t.requires_grad_() for t in (q, k, v, mix)]
    row = {"shape": shape.name, "N": n, "heads": shape.heads, "D": shape.d, "blocks": list(blocks), "M": m,
           "blocks_chosen": "auto" if shape.blocks == "auto" else "fixed",
           "floor_fwd_ms": 4 * row_bytes / bandwidth * 1e3, "floor_fwdbwd_ms": 11 * row_bytes / bandwidth * 1e3,
           "times": {}}
    fns = {name: fn for name, fn in implementations(shape, blocks, rope).items() if not impls or name in impls}
    if in_layer:
        leaves, do = layer_leaves(q, do, mix)
        fns = {name: layer_of(fn, shape.heads) for name, fn in fns.items()}
        row["projections"] = {key: time_impl(layer_of(projections_only, shape.heads), leaves, do, backward, graph=True)
                              for backward, key in ((False, "fwd"), (True, "fwdbwd"))}
    for name, fn in fns.items():
        row["times"][name] = {}
        for backward, key in ((False, "fwd"), (True, "fwdbwd")):
            try:
                timed = time_impl(fn, leaves, do, backward, graph=not backward or IMPLS[name][1])
                row["times"][name][key] = less_projections(timed, row["projections"][key]) if in_layer else timed
            except RuntimeError as err:  # e.g. no cuDNN kernel for this shape: say so, time the rest
                row["times"][name][key] = {"ms": math.nan, "error": str(err).splitlines()[0]}
            torch.cuda.empty_cache()
    row.update(ratios(row))
    if profile:
        for name in ("mhla", "mhla_used", "mhla_norms"):
            if name not in fns:
                continue
            for backward, what in ((False, "forward"), (True, "forward+backward")):
                print(f"--- profile: {shape.name}, {IMPLS[name][0]}, {what} ---\n"
                      f"{kernel_profile(_call(fns[name], leaves, do, backward))}", flush=True)
    return row


def shard_rows(shape: Shape, dtype: torch.dtype, batch: int, worlds):
    """GPU times (`time_impl`) of MHLA on one rank's token slice, for every rank of P = 1 and each P in `worlds`,
    plain and (Wan shapes) as Wan uses it: a one-GPU stand-in for a context-parallel run. Yields a row per rank.

    Timed: what `op.mhla_attention_triton(..., start=start)` runs on the rank's slice [start, end) of the tokens:
    the summary kernel on its keys (fp32 partial summaries of all M blocks, rounded after), mixing of all M
    blocks, the output kernel on its queries, and in the backward the dq, dS~ summary, Gram, mix^T and dk/dv
    steps on its tokens. Not timed: the forward all-reduce of the summaries and the backward all-reduce of their
    gradients (B * heads * M * (D*Dv [+ D]) fp32 values each; `ops.context_parallel.comm_bytes`), nor waiting
    for the slowest rank.
    """
    from ..kernels import op
    from ..ops import MHLAOptions
    from ..ops.context_parallel import token_range

    geometry, (q, k, v, do), mix, wan_rope = shape_inputs(shape, dtype, batch)
    n = geometry.num_tokens
    mix.requires_grad_()
    variants = {"mhla": (None, MHLAOptions())}
    if shape.as_used:
        variants["mhla_used"] = (wan_rope, MHLAOptions(normalize=False))
    for world in sorted({1, *worlds}):
        for rank in range(world):
            start, end = token_range(n, world, rank)
            leaves = [t[:, start:end].clone().requires_grad_() for t in (q, k, v)] + [mix]
            _, m_count, max_len = geometry.slice_blocks(start, end)
            row = {"shape": shape.name, "P": world, "rank": rank, "start": start, "end": end, "M": geometry.num_blocks,
                   "blocks_launched": m_count, "longest": max_len, "times": {}}
            for name, (rope, options) in variants.items():
                tables = None if rope is None else tuple(t[:, start:end] for t in rope)

                def fn(q, k, v, mix, tables=tables, options=options, start=start):
                    return op.mhla_attention_triton(q, k, v, mix, geometry, options, tables, start=start)

                row["times"][name] = {key: time_impl(fn, leaves, do[:, start:end], backward, graph=True)
                                      for backward, key in ((False, "fwd"), (True, "fwdbwd"))}
            torch.cuda.empty_cache()
            yield row


def _shard_table(rows: list[dict], device: str, dtype: str, batch: int) -> str:
    cols = [(name, key) for name in ("mhla", "mhla_used") for key in ("fwd", "fwdbwd")
            if any(name in r["times"] for r in rows)]
    head = ["shape", "P", "rank", "tokens", "blocks launched", "longest"] + [
        f"{IMPLS[name][0]} {'fwd' if key == 'fwd' else 'f+b'}" for name, key in cols]
    lines = [f"{device}, {dtype}, B = {batch}: one rank's token slice of a context-parallel run, timed on this one GPU "
             "(GPU time in ms, as in `bench op`), without the all-reduces of the summaries and of their gradients. "
             "Each P's last row: its slowest rank, and in brackets P = 1's time / P over it (1.00: the kernels "
             "scale ideally).", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['P']} | {r['rank']} | [{r['start']:,}, {r['end']:,}) | "
                     f"{r['blocks_launched']} of {r['M']} | {r['longest']} | "
                     + " | ".join(_cell(r["times"].get(name, {}).get(key)) for name, key in cols) + " |")
        if r["P"] > 1 and r["rank"] == r["P"] - 1:
            same = [x for x in rows if x["shape"] == r["shape"]]
            cells = []
            for name, key in cols:
                if name not in r["times"]:
                    cells.append("-")
                    continue
                whole = next(x for x in same if x["P"] == 1)["times"][name][key]["ms"]
                slowest = max(x["times"][name][key]["ms"] for x in same if x["P"] == r["P"])
                cells.append(f"{ms_text(slowest)} ({whole / r['P'] / slowest:.2f})")
            lines.append(f"| {r['shape']} | {r['P']} | slowest | | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(t: dict | None) -> str:
    if not t or math.isnan(t.get("ms", math.nan)):
        return "-" if not t else "fail"
    return ms_text(t["ms"]) + ("" if t["how"] == "graph" else "*")


def ms_text(x: float) -> str:
    """Milliseconds to three decimals, or to three significant digits where those need more: DiT's shapes take
    8-30 us, which three decimals would print as 0.008 for 8.4 and 8.6 alike."""
    if not 0 < x < 0.1:  # NaN too
        return f"{x:.3f}"
    return f"{x:.{2 - math.floor(math.log10(x))}f}"


def _ratio(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.2f}x"


def _table(rows: list[dict], device: str, bandwidth: float, dtype: str, batch: int) -> str:
    names = [name for name in IMPLS if any(name in r["times"] for r in rows)]
    lines = [
        f"{device}, {dtype}, B = {batch}, GPU time in ms: median of CUDA-graph replay (triton.testing."
        "do_bench_cudagraph); * = eager calls queued behind a sleep kernel and timed between CUDA events "
        f"(SDPA's backward: no Python launch cost either way). Copy bandwidth {bandwidth / 1e12:.2f} TB/s. floor: read q, k, v and write o once (fwd); "
        "plus read q, k, v, dO and write dq, dk, dv (f+b). MHLA eager: median of eager calls (Python launch "
        "cost included). Ratios: MHLA / cuDNN, MHLA / global linear, MHLA as used / MHLA (> 1: slower)."
        + (" " + IN_LAYER if any("projections" in r for r in rows) else ""),
    ]
    for key, what in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
        head = ["shape", "N", "heads x D", "blocks (M)", "floor"] + [IMPLS[n][0] for n in names]
        if "mhla" in names:
            head += ["MHLA eager", "/ cuDNN", "/ linear", "as used / MHLA"]
        lines += ["", f"{what}:", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for r in rows:
            blocks = f"{'x'.join(map(str, r['blocks']))} ({r['M']}, {r['blocks_chosen']})"
            cells = [r["shape"], f"{r['N']:,}", f"{r['heads']} x {r['D']}", blocks, ms_text(r[f"floor_{key}_ms"])]
            cells += [_cell(r["times"].get(n, {}).get(key)) for n in names]
            if "mhla" in names:
                eager = r["times"].get("mhla", {}).get(key, {}).get("eager_ms", math.nan)
                cells += [ms_text(eager)] + [_ratio(r[f"{x}_{key}"]) for x in ("mhla_vs_cudnn", "mhla_vs_linear",
                                                                              "used_vs_mhla")]
            lines.append("| " + " | ".join(cells) + " |")
    errors = [f"{r['shape']} {n} {key}: {t['error']}" for r in rows for n, ts in r["times"].items()
              for key, t in ts.items() if "error" in t]
    if errors:
        lines += ["", "Failed: " + "; ".join(errors)]
    return "\n".join(lines)


def _progress(row: dict) -> str:
    cells = [f"{n} {key} {_cell(t)} (queued {ms_text(t.get('queued_ms', math.nan))}, "
             f"eager {ms_text(t.get('eager_ms', math.nan))})"
             for n, ts in row["times"].items() for key, t in ts.items()]
    where = f", P = {row['P']}, rank {row['rank']}" if "P" in row else ""
    return f"[{row['shape']}{where}] " + ", ".join(cells)


CHECK_COLUMNS = ("o", "dq", "dk", "dv", "dmix", "o no-grad", "o no-grad, norms on the way")
CHECK_HEADER = ["| case | dtype | N | M | heads x D/Dv | " + " | ".join(CHECK_COLUMNS) + " | ok |",
                "|---" * (6 + len(CHECK_COLUMNS)) + "|"]


def _check_row(r: dict) -> str:
    e = r["errors"]
    errs = " | ".join(f"{e[x]:.1e}" if x in e else "-" for x in CHECK_COLUMNS)
    return (f"| {r['case']} | {r['dtype']} | {r['N']:,} | {r['M']} | {r['heads']} x {r['D']}/{r['Dv']} "
            f"| {errs} | {'yes' if r['ok'] else 'NO'} |")


def run_op(args: argparse.Namespace) -> int:
    from ..kernels.overrides import describe, overridden

    if args.check:  # a case name no case holds: refused before any setting or GPU is touched
        from ..ops.check import selected_cases

        selected_cases(args.check)
    candidates = _versus_candidates(args)  # so is a candidate's setting that no table holds
    with overridden(args.set):
        if not torch.cuda.is_available():
            raise ValueError("bench op needs a CUDA GPU")
        device = torch.cuda.get_device_name() + describe(args.set)
        if args.shared_memory is None:
            return _run_op(args, device, candidates)
        from ..kernels.fitting import card_with_shared_memory

        with card_with_shared_memory(args.shared_memory):
            return _run_op(args, f"{device} as a card of {args.shared_memory} bytes of shared memory", candidates)


def _versus_candidates(args: argparse.Namespace) -> list[list[str]]:
    """--versus's candidates, each its list of settings ([] without --versus), and the options it takes checked."""
    if args.in_layer and args.shard:
        raise ValueError("--in-layer times the peers or --versus, not a rank's slice: drop --in-layer or --shard")
    if args.versus is None:
        if args.rounds is not None:
            raise ValueError("--rounds counts the rounds of --versus: give --versus too")
        return []
    if args.impls or args.profile:
        raise ValueError("--versus times MHLA alone, without a profile: drop --impls and --profile")
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    from .bench_versus import candidate_settings

    return candidate_settings(args.versus)


def _run_op(args: argparse.Namespace, device: str, candidates: list[list[str]]) -> int:
    from triton.testing import do_bench

    from ..kernels.fitting import as_asked
    from ..kernels.overrides import overridden

    dtype = getattr(torch, args.dtype)
    report = {"device": device, "dtype": args.dtype, "batch": args.batch, "settings": args.set,
              "in_layer": args.in_layer}
    # an A/B times and checks each candidate as it is asked, not at the smaller settings a card would step down to,
    # unless it runs as a card with less shared memory, whose step-down is what is measured
    exact = as_asked if candidates and args.shared_memory is None else contextlib.nullcontext
    if args.check is not None:
        from ..ops.check import run_checks

        report["check"] = []
        for changed in [[], *candidates]:  # with --versus, the cases under each candidate too
            if not args.json:  # each case's row as it finishes: a run cut short still says what it checked
                print(*([f"check, {'; '.join(changed) or 'as run'}:"] if candidates else []), *CHECK_HEADER,
                      sep="\n", flush=True)
            with overridden(changed), exact():
                results = run_checks(on_result=None if args.json else lambda r: print(_check_row(r), flush=True),
                                     names=args.check)
            report["check"] += [{**r, "settings": changed} for r in results]
            if not args.json:
                print(flush=True)
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    if candidates:
        from .bench_versus import versus_lines, versus_row, versus_table

        rounds = args.rounds or 3
        report["versus_rows"] = []
        for s in shapes:
            with exact():
                report["versus_rows"].append(versus_row(s, dtype, args.batch, candidates, rounds, args.in_layer))
            if not args.json:
                print("\n".join(versus_lines(report["versus_rows"][-1])), flush=True)
        print(json.dumps(report, indent=1) if args.json else
              versus_table(report["versus_rows"], report["device"], args.dtype, args.batch, rounds, args.in_layer))
        return _check_failures(report)
    if args.shard:
        report["shard_rows"] = []
        for s in shapes:
            for row in shard_rows(s, dtype, args.batch, args.shard):
                report["shard_rows"].append(row)
                if not args.json:  # as it finishes, as for the shapes below
                    print(_progress(row), flush=True)
        print(json.dumps(report, indent=1) if args.json else
              _shard_table(report["shard_rows"], report["device"], args.dtype, args.batch))
        return _check_failures(report)
    report["bandwidth_Bps"] = bandwidth = _copy_bandwidth(do_bench)
    report["rows"] = []
    for s in shapes:
        report["rows"].append(bench_shape(s, dtype, args.batch, bandwidth, args.profile, args.impls, args.in_layer))
        if not args.json:  # one line per shape as it finishes: a run cut short still reports what it measured
            print(_progress(report["rows"][-1]), flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(_table(report["rows"], report["device"], bandwidth, args.dtype, args.batch))
    return _check_failures(report)


def _check_failures(report: dict) -> int:
    failed = [r["case"] + (f" ({'; '.join(r['settings'])})" if r["settings"] else "")
              for r in report.get("check", []) if not r["ok"]]
    if failed:
        raise ValueError(f"Triton kernels off the fp64 reference in: {', '.join(failed)}")
    return 0
