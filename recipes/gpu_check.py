#!/usr/bin/env python
"""Step time and peak memory of the training step, original attention vs MHLA.

Wan2.1-T2V-1.3B config with random weights, 480p x 81 frames latents (16, 21, 60, 104),
bf16 autocast, gradient checkpointing, AdamW, the recipe's flow-matching loss:

    python recipes/gpu_check.py                 # on one GPU
    python recipes/gpu_check.py --preset tiny   # seconds on a CPU (tiny config and latents)

Prints one row per variant: median step time over --steps after --warmup steps, and peak
allocated memory (CUDA only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mhla_diffusion import zoo
from mhla_diffusion.conversion import convert, default_config
from mhla_diffusion.families import family_of
from mhla_diffusion.training.objectives import FlowMatchingObjective, model_output

PRESETS = {  # model, latent (C, F, H, W), text tokens, MHLA blocks
    "real": ("wan2.1-1.3b", (16, 21, 60, 104), 512, (3, 5, 10)),
    "tiny": ("wan", (16, 3, 8, 8), 8, (1, 2, 2)),
}


def measure(variant: str, preset: str, steps: int, warmup: int, device) -> dict:
    name, latent, text_len, blocks = PRESETS[preset]
    transformer = zoo.build_transformer(name, device=device)
    if variant != "original":
        layers = "hybrid:3" if variant == "mhla-hybrid" else "all"
        convert(transformer, default_config(transformer, blocks=blocks, layers=layers))
    transformer.train().enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-5)
    objective = FlowMatchingObjective(shift=3.0, logit_mean=0.0, logit_std=1.0)
    x0 = torch.randn(1, *latent, device=device)
    family = family_of(transformer)
    batch = {"prompt_embeds": torch.randn(1, text_len, family.text_width(transformer.config), device=device)}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        noisy = objective.noisy(x0)
        with autocast:
            out = model_output(transformer(**family.transformer_inputs(transformer, noisy.model_input, noisy.timestep, batch), return_dict=False))
        loss = objective.loss(out, noisy)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del transformer, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"variant": variant, "step_s": statistics.median(times), "peak_gib": peak, "loss": loss.item()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="real")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default="original,mhla,mhla-hybrid")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure(v, args.preset, args.steps, args.warmup, device) for v in args.variants.split(",")]
    base = rows[0]["step_s"]
    print(f"{'variant':<12} {'step (s)':>9} {'speed-up':>9} {'peak (GiB)':>11} {'loss':>8}")
    for r in rows:
        print(f"{r['variant']:<12} {r['step_s']:>9.3f} {base / r['step_s']:>8.2f}x {r['peak_gib']:>11.2f} {r['loss']:>8.4f}")


if __name__ == "__main__":
    main()
