"""When does a softmax teacher start using attention? Pre-training alone, watched along the way.

The random-mosaic experiment's teacher stalled at the loss of a denoiser that sees only its own
pixel and position (issue 21): it never learned to look at its own cell. This probe pre-trains the
experiment's softmax DiT under several objectives and learning rates and records, every `--every`
steps (EMA weights): the held-out loss against that per-pixel bound (below it, the model uses
spatial context), the attention mass each query puts on its own cell (uniform: 1 / cells), and at
`--score-at` steps the samples' scores. Each run's record lands in OUT/probe.json as it grows; a
rerun skips finished runs.

    python recipes/experiments/teacher_probe.py --runs ddpm@3e-4 flow@3e-4 --steps 4000
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..evaluation.store import pin_settings
from . import digits, pixel_dit


@dataclass(frozen=True)
class ProbeRun:
    objective: str
    lr: float

    @property
    def key(self) -> str:
        return f"{self.objective}@{self.lr:g}"


def parse_run(text: str) -> ProbeRun:
    objective, _, lr = text.partition("@")
    try:
        run = ProbeRun(objective, float(lr))
        pixel_dit.Process(run.objective)
        if not run.lr > 0:
            raise ValueError("the learning rate must be positive")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected OBJECTIVE@LR, e.g. flow@3e-4 ({e})") from None
    return run


def cell_ids(side: int, cells_per_side: int) -> torch.Tensor:
    """(side * side,) the cell of each token of a raster-ordered square grid."""
    rows = torch.arange(side) * cells_per_side // side
    return (rows[:, None] * cells_per_side + rows[None, :]).flatten()


def own_cell_share(q: torch.Tensor, k: torch.Tensor, cells: torch.Tensor) -> float:
    """Mean softmax attention mass a query puts on keys of its own cell; q, k (N, heads, D), cells (N,)."""
    logits = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) / math.sqrt(q.shape[-1])
    same = (cells[:, None] == cells[None, :]).double()
    return (logits.softmax(-1) * same).sum(-1).mean().item()


@torch.no_grad()
def own_cell_shares(model, images: torch.Tensor, s: digits.Settings, levels=(0.25, 0.5, 0.75)) -> list[float]:
    """Per layer, `own_cell_share` of one held-out image noised at each of `levels` (fractions of the
    noise range), averaged over the levels."""
    from ..evaluation.attention_capture import record_projections

    attentions = {str(i): block.attn1 for i, block in enumerate(model.transformer_blocks)}
    side = s.resolution // s.patch_size
    cells = cell_ids(side, s.mosaic)
    device = next(model.parameters()).device
    shares = torch.zeros(len(attentions))
    for level in levels:
        x, timestep = _noised(images[:1].to(device), level, s.process)
        with record_projections(attentions) as captures, s.process.autocast(device):
            model(**pixel_dit.DIT.transformer_inputs(model, x, timestep, {"class_label": s.class_labels(1).to(device)}))
        shares += torch.tensor([own_cell_share(captures[i].q, captures[i].k, cells) for i in attentions])
    return (shares / len(levels)).tolist()


def _noised(x0: torch.Tensor, level: float, process: pixel_dit.Process):
    """x0 noised at `level` of the objective's noise range (fixed noise), and the model's timestep."""
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0)).to(x0.device)
    if process.objective == "flow":
        return (1 - level) * x0 + level * noise, torch.full((len(x0),), level * 1000, device=x0.device)
    t = int(level * 999)
    sqrt_ab = process.training_objective().tables["sqrt_ab"][t].item()
    return sqrt_ab * x0 + math.sqrt(1 - sqrt_ab**2) * noise, torch.full((len(x0),), t, device=x0.device)


@torch.no_grad()
def heldout_loss(model, images: torch.Tensor, s: digits.Settings, repeats: int = 4) -> float:
    """The training objective's loss on held-out images, noise and levels drawn from a fixed seed
    (the training RNG is left as it was)."""
    device = next(model.parameters()).device
    objective = s.process.training_objective()
    labels = s.class_labels(len(images)).to(device)
    total = 0.0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(12345)
        for _ in range(repeats):
            noisy = objective.noisy(images.to(device))
            with s.process.autocast(device):
                out = pixel_dit.model_output(model(**pixel_dit.DIT.transformer_inputs(
                    model, noisy.model_input, noisy.timestep, {"class_label": labels}))).float()
            total += objective.loss(out, noisy).item()
    return total / repeats


def pixel_bound(scans: torch.Tensor, process: pixel_dit.Process, labels: torch.Tensor | None = None,
                repeats: int = 20) -> float:
    """The objective's loss of the best denoiser that sees only its own pixel and position: the
    posterior mean of each pixel given its noisy value under the empirical marginal of that pixel
    position in the scans (N, 1, R, R), values on the scans' 17 grey levels. Mosaics of randomly
    drawn scans have the same per-pixel marginals at every cell. Given the scans' `labels`, the
    marginals are each digit's: the bound of a denoiser that also knows its cell's digit (as fixed
    layouts tell it)."""
    x = scans.flatten(1).double()
    values = torch.linspace(-1, 1, 17, dtype=torch.float64)
    level = ((x + 1) / 2 * 16).round().long()
    if not torch.allclose(values[level], x, atol=1e-4):
        raise ValueError("the scans are not on 17 grey levels")

    def marginals(rows: torch.Tensor) -> torch.Tensor:  # (pixels, 17) over the scans `rows`
        return torch.stack([torch.bincount(level[rows, p], minlength=17) for p in range(x.shape[1])]).double() / len(rows)

    if labels is None:
        marginal = marginals(torch.arange(len(x)))
    else:
        marginal = torch.stack([marginals(torch.nonzero(labels == c).flatten()) for c in range(int(labels.max()) + 1)])[labels]
    objective = process.training_objective()
    total = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(repeats):
            nb = objective.noisy(x)
            if process.objective == "flow":
                sigma = nb.t.double()[:, None]
                a = 1 - sigma
            else:
                a = objective.tables["sqrt_ab"][nb.t][:, None]
                sigma = objective.tables["sqrt_1m_ab"][nb.t][:, None]
            xt = nb.model_input.double()
            log_w = -((xt[..., None] - a[..., None] * values) ** 2) / (2 * sigma[..., None] ** 2) + (marginal + 1e-12).log()
            x0_hat = (log_w.softmax(-1) * values).sum(-1)
            eps_hat = (xt - a * x0_hat) / sigma.clamp_min(1e-8)
            pred = eps_hat - x0_hat if process.objective == "flow" else eps_hat
            total += (pred - nb.target.double()).pow(2).mean().item()
    return total / repeats


def probe_run(run: ProbeRun, s: digits.Settings, data, judge, record: dict, save, args, progress: bool) -> None:
    """Pre-train one teacher, appending a point to `record["points"]` at every `args.every` steps."""
    s = replace(s, objective=run.objective, pretrain_lr=run.lr, pretrain_steps=args.steps)
    device = torch.device(args.device)
    model = pixel_dit.build_dit(s.resolution, s.model_size(), digits.PRETRAIN_SEED).to(device)
    heldout = data.test_images[:256]
    record.update(points=[], train_s=0.0)
    clock = {"t": time.perf_counter()}

    def at_step(step: int) -> None:
        record["train_s"] += time.perf_counter() - clock["t"]
        point = {"step": step, "heldout_loss": heldout_loss(model, heldout, s),
                 "own_cell_share": own_cell_shares(model, heldout, s)}
        if step in args.score_at:
            labels = s.class_labels(s.samples)
            point["scores"] = judge.score(pixel_dit.sample(model, labels, s.sampling_steps, s.guidance, 0, process=s.process), labels)
        record["points"].append(point)
        save()
        shares = " ".join(f"{v:.3f}" for v in point["own_cell_share"])
        fid = f", cell FID {point['scores']['fid']:.1f}" if "scores" in point else ""
        print(f"[probe] {run.key} step {step}: held-out loss {point['heldout_loss']:.4f} (bound {record['bound']:.4f}), "
              f"own-cell share {shares} (uniform {1 / s.mosaic ** 2:.3f}){fid}", flush=True)
        clock["t"] = time.perf_counter()

    every = list(range(args.every, args.steps, args.every))
    losses = pixel_dit.train(model, data.train_images, data.train_labels, s.train_settings("pretrain"), digits.PRETRAIN_SEED,
                             f"pretrain {run.key}", progress, at_steps=every, at_step=at_step)
    at_step(args.steps)  # the EMA weights, as the experiment's pre-training ends
    record["loss"] = digits.curve(losses)
    record["step_ms"] = 1000 * record["train_s"] / args.steps
    record["done"] = True
    save()


def write_outputs(out: Path, results: dict, cells: int) -> None:
    """probe.md (a row per run and point) and probe.png (loss / bound, own-cell share, cell FID)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"# Teacher probe ({results['card']}, {results['date']} UTC)", "", f"`{results['command']}`", "",
             "| run | step | held-out loss | per-pixel bound | loss / bound | own-cell attention share per layer "
             f"(uniform {1 / cells:.3f}) | cell FID | confidence (accuracy) |", "|---|---|---|---|---|---|---|---|"]
    fig, (ratio, share, fid) = plt.subplots(1, 3, figsize=(15, 4))
    for key, rec in results["runs"].items():
        points = rec.get("points", [])
        for p in points:
            sc = p.get("scores")
            scored = f"{sc['fid']:.1f} | {sc.get('confidence', sc.get('accuracy')):.3f}" if sc else " | "
            shares = " / ".join(f"{v:.3f}" for v in p["own_cell_share"])
            lines.append(f"| {key} | {p['step']} | {p['heldout_loss']:.4f} | {rec['bound']:.4f} | "
                         f"{p['heldout_loss'] / rec['bound']:.3f} | {shares} | {scored} |")
        if "step_ms" in rec:
            lines.append(f"| {key}: {rec['step_ms']:.1f} ms per training step | | | | | | | |")
        steps = [p["step"] for p in points]
        line, = ratio.plot(steps, [p["heldout_loss"] / rec["bound"] for p in points], marker="o", label=key)
        share.plot(steps, [max(p["own_cell_share"]) for p in points], marker="o", color=line.get_color(), label=f"{key}, max over layers")
        scored = [p for p in points if "scores" in p]
        fid.plot([p["step"] for p in scored], [p["scores"]["fid"] for p in scored], marker="o", color=line.get_color(), label=key)
    ratio.axhline(1.0, color="grey", ls="--", label="per-pixel bound (no spatial context)")
    ratio.set(title="held-out loss / per-pixel bound", xlabel="pre-training step")
    share.axhline(1 / cells, color="grey", ls="--", label="uniform attention")
    share.set(title="attention mass on the own cell", xlabel="pre-training step")
    fid.set(title="cell FID of samples", xlabel="pre-training step", yscale="log")
    for ax in (ratio, share, fid):
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "probe.png", dpi=110)
    plt.close(fig)
    (out / "probe.md").write_text("\n".join(lines) + "\n")


# The per-pixel bound and the own-cell share assume mosaics whose cells are drawn at random.
RANDOM_MOSAICS = {name: s for name, s in digits.PRESETS.items() if s.layout == "random"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python recipes/experiments/teacher_probe.py", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(RANDOM_MOSAICS), default="mosaic-random",
                   help="model, data and batch: a random-mosaic preset (default: mosaic-random)")
    p.add_argument("--runs", nargs="+", type=parse_run, default=[parse_run("ddpm@3e-4"), parse_run("flow@3e-4")],
                   metavar="OBJECTIVE@LR", help="teachers to pre-train, e.g. ddpm@3e-4 flow@1e-3 (default: ddpm@3e-4 flow@3e-4)")
    p.add_argument("--steps", type=int, default=4000, help="pre-training steps of each run (default 4000)")
    p.add_argument("--every", type=int, default=500, help="record a point every this many steps (default 500)")
    p.add_argument("--score-at", type=lambda t: {int(x) for x in t.split(",") if x}, default=None,
                   help="steps at which to sample and score too, comma-separated (default: the last)")
    p.add_argument("--precision", choices=pixel_dit.PRECISIONS, default="fp32", help="(default fp32)")
    p.add_argument("--out", type=Path, default=Path("outputs/teacher-probe"), help="output dir (default outputs/teacher-probe)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error(f"--steps and --every must be positive, got {args.steps} and {args.every}")
    args.score_at = args.score_at or {args.steps}
    if not all(0 < n <= args.steps and (n % args.every == 0 or n == args.steps) for n in args.score_at):
        p.error(f"--score-at {sorted(args.score_at)}: each must be a recorded step (a multiple of --every up to --steps)")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    s = replace(digits.PRESETS[args.preset], precision=args.precision)
    device = torch.device(args.device)
    try:  # runs of other presets or precisions are not mixed into one record
        pin_settings(args.out, {"preset": args.preset, "precision": args.precision}, "teacher probe results")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (args.out / "checkpoints").mkdir(exist_ok=True)
    results = digits.Results(args.out / "probe.json", {
        "card": digits.card(device), "torch": torch.__version__, "preset": args.preset, "precision": args.precision,
        "command": shlex.join(["python", "recipes/experiments/teacher_probe.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
    scans, data = digits.load_data(s)
    classifier = digits.classifier_phase(args.out, scans, s, results, device, not args.no_progress)
    judge = digits.Judge(classifier, s, scans.train_images, device, data.train_images[:digits.MOSAIC_REFERENCE])
    def save():
        results.save()
        write_outputs(args.out, results.data, s.mosaic ** 2)

    for run in args.runs:
        record = results.data["runs"].get(run.key, {})
        if record.get("done") and record.get("steps") == args.steps:
            continue
        record = results.data["runs"][run.key] = {"steps": args.steps, "bound": pixel_bound(scans.train_images, pixel_dit.Process(run.objective))}
        probe_run(run, s, data, judge, record, save, args, not args.no_progress)
    write_outputs(args.out, results.data, s.mosaic ** 2)
    print(f"[probe] done: {args.out / 'probe.md'}", flush=True)
    return 0
