"""`mhla-diffusion bench model`: a real-size transformer (random weights, bf16), original
attention vs MHLA (all layers and hybrid), one forward and one CFG denoising step, peak memory;
and the bound "self-attention removed": the same model with no attention compute in its
self-attention layers, the time no attention replacement that keeps the rest of the block can beat.
"""

from __future__ import annotations

import json
import math
import time

import torch

from ..families import latent_grid, real_model, real_model_names
from ..ops.norms import apply_qk_norm
from .profiling import kernel_profile

def timed(fn, warmup: int, iters: int, back_to_back: bool = False) -> tuple[float, float]:
    """Milliseconds of a call of `fn` and its peak memory in GB: the median of `iters` calls timed each alone (the
    host's time before a call's first launch counts, as the GPU waits for it), or `back_to_back`, the mean of `iters`
    calls launched one after another as a sampling loop launches them, where a call's host time overlaps the GPU's
    work on the calls before it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if back_to_back:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters, torch.cuda.max_memory_allocated() / 1e9
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 1e9


REMOVED = "no-self-attn"
TIMINGS = {False: "each alone (median)", True: "back to back (mean)"}


def _pass_values(q, k, v, layer_input, rope=None, qk_norm=None):
    """The attention of a self-attention-removed layer: v as it is, (B, N, heads, Dv) -> (B, N, heads*Dv); the
    layer's q/k norms across heads (Wan's), which MHLA's kernels apply on the way, run as passes of their own."""
    apply_qk_norm(q, k, qk_norm)
    return v.flatten(2)


def variant_processors(model, variant: str, original: dict) -> dict:
    """The processor dict of a bench variant: "original"; "mhla-all" / "mhla-hybrid" (every 3rd layer keeps
    softmax); REMOVED, every self-attention layer through the family's MHLA processor with its attention
    replaced by `_pass_values`: the layer's q/k/v projections, q/k norms and output projection run as they
    are, attention itself (and RoPE, which MHLA applies inside its kernels, and MHLA's output norm) does not."""
    from ..conversion import default_config, mhla_processors
    from ..processors import MHLAProcessorBase

    if variant == "original":
        return dict(original)
    if variant == REMOVED:
        procs = mhla_processors(model, default_config(model, layers="all"))
        for proc in procs.values():
            if isinstance(proc, MHLAProcessorBase):
                proc.attend = _pass_values  # an instance attribute: this processor's attention only
        return procs
    layers = variant.removeprefix("mhla-")
    return mhla_processors(model, default_config(model, layers="all" if layers == "all" else "hybrid:3"))


def run_model(args) -> int:
    from ..kernels.overrides import overridden

    with overridden(args.set):
        if not torch.cuda.is_available():
            raise ValueError("bench model needs a CUDA GPU")
        return _run_model(args)


def _run_model(args) -> int:
    from ..conversion import attn_processors, set_attn_processor
    from ..kernels.overrides import describe
    from ..zoo import build_transformer

    family, real = real_model(args.family)
    resolution = args.resolution or real.resolution
    frames = args.frames or real.frames
    latent = real.latent_shape(resolution, frames)
    t0 = time.perf_counter()
    model = build_transformer(args.family, device="cuda", dtype=torch.bfloat16, resolution=resolution)
    original = attn_processors(model)
    variants = ["original"] + [f"mhla-{lay}" for lay in args.layers] + ([] if args.no_bound else [REMOVED])
    rows = []
    for name in variants:
        set_attn_processor(model, dict(original))
        set_attn_processor(model, variant_processors(model, name, original))
        fwd = torch.compile(model, mode=args.compile) if args.compile else model
        for batch, what in ((1, "forward"), (2, "CFG step (batch 2)")):
            if what.startswith("CFG") and args.no_cfg:
                continue
            inputs = family.example_inputs(model, latent, batch, real.text_tokens)
            with torch.inference_mode():
                ms, gb = timed(lambda: fwd(**inputs, return_dict=False), args.warmup, args.iters, args.back_to_back)
                if args.profile and batch == 1:
                    print(f"--- profile: {name}{_compiled(args.compile)}, forward ---")
                    print(kernel_profile(lambda: fwd(**inputs, return_dict=False)), flush=True)
            rows.append(dict(family=args.family, resolution=resolution,
                             checkpoint=real.checkpoint(resolution), frames=frames if len(latent) == 4 else 1,
                             tokens=math.prod(latent_grid(model, latent)), attention=name, what=what, compile=args.compile,
                             timing=TIMINGS[args.back_to_back], settings=args.set, ms=round(ms, 2),
                             peak_gb=round(gb, 2)))
            print(f"  {name:12s} {what:20s} {ms:9.1f} ms  peak {gb:6.1f} GB", flush=True)
        fwd = None  # the compiled graphs go before the next variant is built
        torch.cuda.empty_cache()
    base = {r["what"]: r["ms"] for r in rows if r["attention"] == "original"}
    for r in rows:
        r["speedup"] = round(base[r["what"]] / r["ms"], 2)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        checkpoint = rows[0]["checkpoint"]
        print(f"\n{args.family} {resolution}" + (f" (the {resolution} checkpoint: {checkpoint})" if checkpoint else "")
              + f", latent {latent}, {rows[0]['tokens']} tokens, bf16, calls timed {rows[0]['timing']}, "
              f"{torch.cuda.get_device_name()}{describe(args.set)}, {time.perf_counter() - t0:.0f}s")
        print("| attention | what | ms | speedup | peak GB |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['attention']}{_compiled(r['compile'])} | {r['what']} | {r['ms']} | {r['speedup']}x | {r['peak_gb']} |")
    return 0


def _compiled(mode) -> str:
    return f" (compiled, {mode})" if mode else ""


def register_model_command(commands, settings) -> None:
    p = commands.add_parser("model", parents=[settings],
                            help="real-size transformer: original attention vs MHLA, forward and CFG step",
                            description="Random weights in bf16 on the GPU; no download.")
    p.add_argument("--family", required=True, choices=real_model_names(), help="a published model's config")
    p.add_argument("--resolution", help="pixels: 256, 512, 1024, 4096 for images; 480p, 720p or HxW (704x1280) for "
                   "video (default per model); where a checkpoint was published for it (DiT-XL/2 512), its config")
    p.add_argument("--frames", type=int, help="video frames, 4k+1 (default per model: 81, Wan2.2-TI2V-5B 121)")
    p.add_argument("--layers", nargs="+", default=["all", "hybrid"], choices=["all", "hybrid"], help="MHLA variants to time (hybrid: every 3rd layer keeps softmax)")
    p.add_argument("--compile", nargs="?", const="default", choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile the transformer (mode; reduce-overhead replays CUDA graphs)")
    p.add_argument("--no-cfg", action="store_true", help="skip the batch-2 CFG step")
    p.add_argument("--no-bound", action="store_true",
                   help=f"skip the '{REMOVED}' row (self-attention removed: projections and norms run, attention does not)")
    p.add_argument("--profile", action="store_true", help="also print where one forward's time goes (torch.profiler)")
    p.add_argument("--back-to-back", action="store_true",
                   help="time the iterations launched one after another, as a sampling loop runs them, not each alone: "
                        "host time before a call's launch then overlaps the GPU's work (CUDA graphs: the GPU time)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_model)
