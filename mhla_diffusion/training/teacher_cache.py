"""A latent cache of the original model's own samples, for fine-tuning without a dataset.

The teacher (the unconverted pipeline) samples from prompts (T2I/T2V) or class labels (DiT) as its
pipeline does, classifier-free guidance included; each final latent, normalized as the VAE
posterior of a real image would be, is stored with its conditioning in the cache format
`precompute` writes. Training on that cache (`recipes/train.py --data_dir CACHE`) then noises the
teacher's samples at timesteps drawn by the family's objective, so the student learns at points
the teacher's own trajectories pass through, and `distill_output` / `distill_layers` compare the
student with the teacher there. Sample i has seed `seed + i` and prompt i mod the prompt count; each
process writes its share (i mod world) one file at a time, so an interrupted run resumes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import persistence
from ..conversion import is_converted
from ..evaluation.compare import capture_latents  # what the pipeline hands to vae.decode (DiT has no latent output)
from ..evaluation.sampling import SamplingSettings, call_kwargs, pipe_family, read_prompts
from . import conditioning
from .data import CACHE_INDEX
from .train_config import check_family
from .precompute import finish_cache, save_sample


def normalized(vae, z: torch.Tensor) -> torch.Tensor:
    """A decoder input as the normalized latent the transformer works in (the cache's latents_mean)."""
    shift, scale = conditioning._latent_norm(vae, z)
    return ((z.float() - shift) * scale).contiguous()


def write_teacher_cache(config, out_dir, num_samples: int, prompts_file: str | None, steps: int | None,
                        guidance_scale: float | None, accelerator) -> dict:
    """Sample the teacher `config.pretrained` into a latent cache at `out_dir` (this process's share)."""
    out = Path(out_dir)
    if (out / CACHE_INDEX).exists():
        raise FileExistsError(f"{out} already holds a complete latent cache; choose a new directory")
    if num_samples < 1:
        raise ValueError(f"--teacher_samples must be >= 1, got {num_samples}")
    pipe = persistence.load(config.pretrained)
    if is_converted(pipe.transformer):
        raise ValueError(f"{config.pretrained} is converted to MHLA: the teacher must be the original model")
    family = pipe_family(pipe)
    check_family(config, family, config.pretrained)
    prompts = read_prompts(prompts_file) if prompts_file else None
    if family.text and not prompts:
        raise ValueError(f"teacher samples of a text-conditioned {family.name} model need --prompts FILE (one prompt per line)")
    h, w = config.resolution
    settings = SamplingSettings(seed=config.seed, steps=steps, guidance_scale=guidance_scale, prompts=prompts,
                                **({"height": h, "width": w} if family.text else {}),
                                num_frames=config.num_frames if family.video else None)
    shape = list(conditioning.latent_shape(pipe.vae, config.resolution, config.num_frames, family.video))
    device = accelerator.device
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    out.mkdir(parents=True, exist_ok=True)
    mine = [i for i in range(accelerator.process_index, num_samples, accelerator.num_processes)
            if not (out / f"{i:09d}.safetensors").exists()]  # a rerun resumes
    batches = [mine[j:j + config.train_batch_size] for j in range(0, len(mine), config.train_batch_size)]
    for indices in tqdm(batches, desc="teacher samples", disable=not accelerator.is_local_main_process):
        kwargs = {**call_kwargs(pipe, indices, settings), **family.validation_kwargs}  # as training encodes prompts
        with capture_latents(pipe) as seen, torch.inference_mode():
            pipe(**kwargs)
        latents = normalized(pipe.vae, seen[-1])
        if list(latents.shape[1:]) != shape:
            raise ValueError(f"the teacher samples latents of shape {list(latents.shape[1:])}, but resolution "
                             f"{config.resolution} trains on {shape}: set resolution to the size the model samples at")
        cond = {}
        if family.text:
            cond["prompt_embeds"], cond["prompt_attention_mask"] = conditioning.encode_text(
                pipe, kwargs["prompt"], config.max_sequence_length, device)
        else:
            cond["class_label"] = torch.tensor(kwargs["class_labels"])
        for j, index in enumerate(indices):
            save_sample(out, index, {"latents_mean": latents[j], **{k: v[j] for k, v in cond.items()}})
    teacher = {"prompts": prompts_file, "steps": steps, "guidance_scale": guidance_scale, "seed": config.seed}
    return finish_cache(out, config, family.name, family.video, shape, accelerator, samples=num_samples, unreadable=0,
                        teacher=teacher)
