"""Wan-VACE: should the control blocks' self-attention convert too? (README, "Wan-VACE".)

Right after conversion (no fine-tuning), on random-weight tiny VACE transformers, the relative L2
error of the output against the original for: the main blocks converted, the control blocks
converted, both; and, for scale, how much the control hints move the output at all (hints off).

    python recipes/experiments/vace_control_blocks.py     # CPU, under a minute
"""

import sys

import torch

import mhla_diffusion as md
from mhla_diffusion import zoo

SIZES = {"4 layers, control after [0, 2], 2x12 heads": dict(num_layers=4, vace_layers=[0, 2]),
         "6 layers, control after [0, 2, 4], 4x16 heads": dict(num_layers=6, vace_layers=[0, 2, 4], num_attention_heads=4,
                                                               attention_head_dim=16, ffn_dim=64)}


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def measure(overrides: dict, seed: int) -> dict:
    base = zoo.build_transformer("vace", seed=seed, **overrides)
    g = torch.Generator().manual_seed(100 + seed)
    inputs = dict(hidden_states=torch.randn(1, 16, 5, 16, 16, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 5, 16, generator=g),
                  control_hidden_states=torch.randn(1, 96, 5, 16, 16, generator=g), return_dict=False)
    main, control = base.config.num_layers, len(base.config.vace_layers)
    with torch.no_grad():
        ref = base(**inputs)[0]
        out = {"hints off": rel(base(**inputs, control_hidden_states_scale=torch.zeros(control))[0], ref)}
        for name, layers in (("main", list(range(main))), ("control", list(range(main, main + control))), ("both", "all")):
            model = zoo.build_transformer("vace", seed=seed, **overrides)
            md.convert(model, md.default_config(model, layers=layers))
            out[name] = rel(model(**inputs)[0], ref)
    return out


def main() -> int:
    print("| tiny VACE (5 seeds) | hints off | main converted | control converted | both converted |\n|---|---|---|---|---|")
    for what, overrides in SIZES.items():
        runs = [measure(overrides, seed) for seed in range(5)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        print(f"| {what} | " + " | ".join(f"{mean[k]:.3f}" for k in ("hints off", "main", "control", "both")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
