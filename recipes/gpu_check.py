#!/usr/bin/env python
"""Step time and peak memory of the training step (original attention vs MHLA), of teacher-only
distillation, and of attention transfer's pieces.

Wan2.1-T2V-1.3B config with random weights, 480p x 81 frames latents (16, 21, 60, 104), bf16 autocast,
gradient checkpointing, AdamW on all parameters, the recipe's flow-matching loss:

    python recipes/gpu_check.py                 # on one GPU
    python recipes/gpu_check.py --variants mhla,teacher-only,transfer
    python recipes/gpu_check.py --preset tiny   # seconds on a CPU (tiny config and latents)

Variants: `original`, `mhla` (all layers), `mhla-hybrid` (hybrid:3): the data fine-tune step.
`teacher-only`: the MHLA step plus the teacher as the recipe builds it (distill.build_teacher before
conversion: bf16, sharing what full training leaves frozen, i.e. nothing), its forward in the step,
output and per-layer distillation; `teacher-only-guided` adds the unconditional teacher forward of a
guided target (distill_guidance_scale). `transfer`: one layer of `mhla-diffusion transfer` at its
defaults (bf16 teacher, a call of --batch-size samples): the teacher forward that records that layer's
call, one fitting step of the layer on it, and a whole pass estimated from them.

Prints one row per variant: median time over --steps after --warmup (per step; transfer: per fitting
step), and peak allocated memory (CUDA only). `--profile` also prints, per training variant, where one
step's time goes (torch.profiler: kernels by GPU time, ops by CPU time).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from mhla_diffusion import zoo
from mhla_diffusion.cli.main import build_parser
from mhla_diffusion.cli.profiling import kernel_profile
from mhla_diffusion.conversion import convert, converted_indices, default_config, new_processor, resolve_config
from mhla_diffusion.families import family_of, self_attentions
from mhla_diffusion.processors import TokenGrid
from mhla_diffusion.training import distill, model
from mhla_diffusion.training.objectives import FlowMatchingObjective, model_output
from mhla_diffusion.training.train_config import TrainConfig
from mhla_diffusion.transfer import fit_step, fitting, layer_key, record_self_attention

PRESETS = {  # model, latent (C, F, H, W), text tokens, MHLA blocks
    "real": ("wan2.1-1.3b", (16, 21, 60, 104), 512, (3, 5, 10)),
    "tiny": ("wan", (16, 3, 8, 8), 8, (1, 2, 2)),
}
VARIANTS = ("original", "mhla", "mhla-hybrid", "teacher-only", "teacher-only-guided", "transfer")
GUIDED_SCALE = 5.0  # the Wan recipe's validation guidance


def timed(fn, steps: int, warmup: int, device) -> tuple[float, object]:
    """Median seconds of `fn()` over `steps` calls after `warmup`, and the last result."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), result


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_training(variant: str, preset: str, steps: int, warmup: int, device, profile: bool = False) -> dict:
    name, latent, text_len, blocks = PRESETS[preset]
    transformer = zoo.build_transformer(name, device=device)
    family = family_of(transformer)
    teacher = None
    if variant.startswith("teacher-only"):  # the released Wan recipe trains all parameters
        teacher = distill.build_teacher(transformer, model.frozen_parameter_ids(transformer, TrainConfig(pretrained=name)),
                                        torch.bfloat16)
    if variant != "original":
        layers = "hybrid:3" if variant == "mhla-hybrid" else "all"
        convert(transformer, default_config(transformer, blocks=blocks, layers=layers))
    taps = None
    if teacher is not None:
        layers = converted_indices(transformer)
        taps = (distill.AttentionTap(transformer, layers), distill.AttentionTap(teacher, layers))
    transformer.train().enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-5)
    objective = FlowMatchingObjective(shift=3.0, logit_mean=0.0, logit_std=1.0)
    x0 = torch.randn(1, *latent, device=device)
    width = family.text_width(transformer.config)
    batch = {"prompt_embeds": torch.randn(1, text_len, width, device=device)}
    uncond = {"prompt_embeds": torch.randn(1, text_len, width, device=device)}  # stands in for the empty prompt's
    guided = variant == "teacher-only-guided"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        noisy = objective.noisy(x0)
        inputs = family.transformer_inputs(transformer, noisy.model_input, noisy.timestep, batch)
        with autocast:
            out = model_output(transformer(**inputs, return_dict=False))
        losses = {"diffusion": objective.loss(out, noisy)}
        if teacher is not None:
            uncond_inputs = family.transformer_inputs(transformer, noisy.model_input, noisy.timestep, uncond) if guided else None
            with torch.no_grad(), autocast:
                target = distill.teacher_prediction(teacher, inputs, uncond_inputs, GUIDED_SCALE)
            losses.update(distill.distill_loss(out, target, *taps, 1.0, 1.0))
        loss = sum(losses.values())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    reset_peak(device)
    step_s, loss = timed(step, steps, warmup, device)
    row = {"variant": variant, "step_s": step_s, "peak_gib": peak_gib(device), "loss": loss}
    if profile:
        row["profile"] = kernel_profile(step, calls=1, top=30)
    return row


def measure_transfer(preset: str, steps: int, warmup: int, device) -> dict:
    """One layer of `mhla-diffusion transfer` at its defaults; the pass estimate multiplies the pieces out."""
    name, latent, text_len, blocks = PRESETS[preset]
    cli = build_parser().parse_args(["transfer", "SRC", "DST"])  # the command's defaults
    teacher = zoo.build_transformer(name, device=device, dtype=torch.bfloat16)
    family = family_of(teacher)
    attns = self_attentions(teacher)
    key = layer_key("transformer", {id(m): n for n, m in teacher.named_modules()}[id(attns[0])])
    inputs = family.example_inputs(teacher, latent, batch=cli.batch_size, text_tokens=text_len)

    def forward():
        with torch.inference_mode():
            teacher(**inputs, return_dict=False)

    def capture():
        with record_self_attention({"transformer": teacher}, keep=1, only={key}) as calls:
            forward()
        return calls[key][0]

    reset_peak(device)
    forward_s, _ = timed(forward, steps, warmup, device)
    capture_s, call = timed(capture, steps, warmup, device)
    call_gib = call.nbytes / 2**30
    proc = new_processor(family, attns[0], resolve_config(teacher, default_config(teacher, blocks=blocks)), TokenGrid())
    layer, optimizer = fitting(attns[0], proc, cli.lr, cli.projection_lr, device)
    fit_s, loss = timed(lambda: fit_step(layer, optimizer, call, device), steps, warmup, device)
    n, calls = len(attns), -(-cli.num_samples // cli.batch_size) * cli.steps * 2  # Wan's pipeline: a second call for CFG
    note = (f"transfer at its defaults ({cli.num_samples} samples in calls of {cli.batch_size}, {cli.steps} steps, keep "
            f"{cli.keep_calls} calls, {cli.steps_per_layer} steps per layer, {n} layers): teacher forward {forward_s:.3f} s, "
            f"with one layer's call recorded {capture_s:.3f} s ({call_gib:.2f} GiB on the CPU); fitting step {fit_s:.3f} s. "
            f"A pass: sampling {calls} forwards ~{calls * forward_s:.0f} s (again per --layers-per-pass group), fitting "
            f"{n} x {cli.steps_per_layer} steps ~{n * cli.steps_per_layer * fit_s:.0f} s; the kept calls of all layers "
            f"at once {n * cli.keep_calls * call_gib:.0f} GiB of CPU memory ({cli.keep_calls * call_gib:.1f} GiB per layer)")
    return {"variant": "transfer", "step_s": fit_s, "peak_gib": peak_gib(device), "loss": loss, "note": note}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="real")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also print where one training step's time goes")
    parser.add_argument("--variants", default="original,mhla,mhla-hybrid", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for v in variants:
        rows.append(measure_transfer(args.preset, args.steps, args.warmup, device) if v == "transfer"
                    else measure_training(v, args.preset, args.steps, args.warmup, device, args.profile))
        gc.collect()  # the attention taps' hooks make reference cycles with the models
    base = rows[0]["step_s"]
    print(f"{'variant':<20} {'step (s)':>9} {'speed-up':>9} {'peak (GiB)':>11} {'loss':>8}")
    for r in rows:
        print(f"{r['variant']:<20} {r['step_s']:>9.3f} {base / r['step_s']:>8.2f}x {r['peak_gib']:>11.2f} {r['loss']:>8.4f}")
    for r in rows:
        if "note" in r:
            print(r["note"])
        if "profile" in r:
            print(f"-- {r['variant']}: one step --\n{r['profile']}")
    return rows


if __name__ == "__main__":
    main()
