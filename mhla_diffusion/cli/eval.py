"""`mhla-diffusion eval {fid,ref-stats,compare,attention}`: quality checks of converted models."""

from __future__ import annotations

import argparse

from ..persistence import DTYPE_NAMES
from .main import counted


def _sampling_args(p: argparse.ArgumentParser, steps: int | None = None) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--seed", type=int, default=0, help="sample i uses seed + i (default 0)")
    g.add_argument("--steps", type=int, default=steps, help="denoising steps (default: %s)" % (steps or "the pipeline's"))
    g.add_argument("--prompts", help="text file, one prompt per line (text-to-image/video models); sample i gets prompt i mod count")
    g.add_argument("--height", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--num-frames", type=int, help="video models: frames per video (each frame counts as an image)")
    g.add_argument("--dtype", choices=DTYPE_NAMES, metavar="DTYPE", help="weights dtype: bf16 (bfloat16), fp16 (float16) or fp32 (float32); default: as stored")


def _settings(args, guidance_scale=None):
    from ..evaluation.sampling import SamplingSettings, read_prompts

    return SamplingSettings(
        seed=args.seed, steps=args.steps, guidance_scale=guidance_scale,
        prompts=read_prompts(args.prompts) if args.prompts else None,
        height=args.height, width=args.width, num_frames=args.num_frames,
    )


def _dtype(args):
    from ..persistence import parse_dtype

    return parse_dtype(args.dtype)


def _max_unreadable(p: argparse.ArgumentParser) -> None:
    from ..evaluation.images import MAX_UNREADABLE

    p.add_argument("--max-unreadable", type=float, default=MAX_UNREADABLE, metavar="FRACTION",
                   help="unreadable reference images are skipped, each counted once; more than this fraction of them "
                        "is an error (default %(default)s)")


def _device():
    from accelerate import PartialState

    return PartialState().device


def cmd_fid(args) -> int:
    from ..evaluation.fid_run import run_fid

    report = run_fid(args.model, args.reference, args.out, args.num_samples, _settings(args, args.guidance_scale),
                     batch_size=args.batch_size, fid_batch_size=args.fid_batch_size, torch_dtype=_dtype(args),
                     inception_weights=args.inception_weights, max_unreadable=args.max_unreadable)
    if report is not None:  # the main process reports
        print(f"FID {report['fid']:.3f}  ({counted(report['num_samples'], 'sample')}, {counted(report['num_images'], 'image')} vs {report['reference']})")
        if report["reference_unreadable"]:
            files = ", ".join(report["reference_unreadable_files"])
            print(f"reference: skipped {report['reference_unreadable']} unreadable file(s), e.g. {files}")
        print(f"report: {args.out}/fid.json")
    return 0


def cmd_ref_stats(args) -> int:
    from ..evaluation.fid import folder_stats
    from ..evaluation.images import UnreadableFiles

    if not args.output.endswith(".npz"):
        raise ValueError(f"output must be an .npz file, got {args.output}")
    unreadable = UnreadableFiles(args.max_unreadable)
    stats = folder_stats(args.folder, inception_weights=args.inception_weights, batch_size=args.batch_size, progress=True,
                         device=_device(), unreadable=unreadable)
    stats.save(args.output)
    print(f"wrote {args.output}: mu, sigma ({stats.mu.size} features) from n = {counted(stats.n, 'image')}")
    if unreadable.paths:
        print(unreadable.summary())
    return 0


def cmd_compare(args) -> int:
    from ..evaluation.compare import run_compare

    r = run_compare(args.teacher, args.student, args.out, args.num_samples, _settings(args, args.guidance_scale),
                    batch_size=args.batch_size, torch_dtype=_dtype(args), device=_device(), grid_rows=args.grid_rows)
    print(f"PSNR {r['psnr_mean']:.2f} dB  SSIM {r['ssim_mean']:.4f}  latent MSE {r['latent_mse_mean']:.4g} "
          f"(teacher latent mean square {r['teacher_latent_mean_square']:.4g}), {counted(r['num_samples'], 'sample')}")
    print(f"report: {args.out}/compare.json  grid: {r['grid']}")
    return 0


def cmd_attention(args) -> int:
    from ..evaluation.attention_run import run_attention

    r = run_attention(args.model, args.out, _settings(args), step=args.step, rtol=args.rank_tol,
                      max_queries=args.max_queries, torch_dtype=_dtype(args), device=_device())
    print(open(r["table"]).read(), end="")
    print(f"report: {args.out}/attention.json  plot: {r['plot']}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="quality checks: FID, teacher/student comparison, attention rank")
    sub = p.add_subparsers(dest="eval_command", required=True, metavar="CHECK")

    f = sub.add_parser("fid", help="generate samples (resumable, multi-GPU with accelerate launch) and compute FID")
    f.add_argument("--model", required=True, help="pipeline dir, converted or original")
    f.add_argument("--reference", required=True, help="image folder, or .npz with mu/sigma (ADM / clean-fid format, see `eval ref-stats`)")
    f.add_argument("--num-samples", type=int, required=True, help="samples to generate (DiT: classes balanced)")
    f.add_argument("--out", required=True, help="output dir: samples/ (resumed if present) and fid.json")
    f.add_argument("--guidance-scale", type=float, help="CFG scale (default: the pipeline's)")
    f.add_argument("--batch-size", type=int, default=8, help="samples per pipeline call and process")
    f.add_argument("--fid-batch-size", type=int, default=50, help="images per Inception batch")
    f.add_argument("--inception-weights", help="torch-fidelity InceptionV3 .pth (default: the torch hub cache)")
    _max_unreadable(f)
    _sampling_args(f)
    f.set_defaults(func=cmd_fid)

    r = sub.add_parser("ref-stats", help="Inception mu/sigma of an image folder, as an .npz reference")
    r.add_argument("folder")
    r.add_argument("output", help="output .npz (mu, sigma, n)")
    r.add_argument("--inception-weights", help="torch-fidelity InceptionV3 .pth (default: the torch hub cache)")
    r.add_argument("--batch-size", type=int, default=50)
    _max_unreadable(r)
    r.set_defaults(func=cmd_ref_stats)

    c = sub.add_parser("compare", help="teacher vs student on the same seeds: PSNR, SSIM, latent MSE, image grid")
    c.add_argument("--teacher", required=True, help="pipeline dir (usually the original)")
    c.add_argument("--student", required=True, help="pipeline dir (usually the converted one)")
    c.add_argument("--num-samples", type=int, default=8)
    c.add_argument("--out", required=True, help="output dir: compare.json, compare.png")
    c.add_argument("--guidance-scale", type=float, help="CFG scale (default: the pipeline's)")
    c.add_argument("--batch-size", type=int, default=4)
    c.add_argument("--grid-rows", type=int, default=8, help="samples shown in compare.png")
    _sampling_args(c)
    c.set_defaults(func=cmd_compare)

    a = sub.add_parser("attention", help="rank and entropy of softmax / linear / MHLA attention per converted layer")
    a.add_argument("--model", required=True, help="converted pipeline dir")
    a.add_argument("--out", required=True, help="output dir: attention.json, attention.txt, attention.png")
    a.add_argument("--step", type=int, default=-1, help="denoising step whose activations are used (0-based; -1: last)")
    a.add_argument("--rank-tol", type=float, default=1e-6, help="numerical rank: singular values above this x the largest")
    a.add_argument("--max-queries", type=int, default=1024, help="query rows kept (strided) for long sequences")
    _sampling_args(a, steps=10)
    a.set_defaults(func=cmd_attention)
