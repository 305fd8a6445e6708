"""A class-conditional DiT trained in pixel space (no VAE): build, train, sample.

Training reuses the recipes' objectives and DiT call: DDPM epsilon prediction sampled with DDIM
(as DiT trains), or rectified flow sampled with Euler steps (as SANA and Wan train), both with
classifier-free guidance against the null class that DiT's label embedding adds for its label
dropout (class id = number of classes). DiTPipeline cannot be used: it decodes with a VAE and
hard-codes ImageNet's null class 1000.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..families import family_by_name
from ..training.distill import teacher_prediction
from ..training.model import param_groups
from ..training.objectives import DDPMObjective, FlowMatchingObjective, model_output
from .digits_data import NUM_CLASSES

DIT = family_by_name("dit")

# Cosine betas suit small images (improved DDPM); trailing DDIM steps start at t = T - 1.
SCHEDULER = {"num_train_timesteps": 1000, "beta_schedule": "squaredcos_cap_v2"}
OBJECTIVES = ("ddpm", "flow")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Process:
    """How a model is trained and sampled: `objective` "ddpm" (epsilon, DDIM) or "flow" (velocity
    noise - x0, noise levels logit-normal(0, 1) without a shift, Euler steps on diffusers' default
    schedule: sigma from 1 to 1/1000 in steps - 1 equal steps, then to 0); `precision` "bf16" runs
    forward passes under bf16 autocast on CUDA (weights, optimizer and loss stay fp32; a distillation
    teacher's target is then bf16-rounded too)."""

    objective: str = "ddpm"
    precision: str = "fp32"

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")

    def training_objective(self):
        if self.objective == "flow":
            return FlowMatchingObjective(shift=1.0, logit_mean=0.0, logit_std=1.0)
        return DDPMObjective(SCHEDULER, learned_variance=False)

    def scheduler(self, steps: int):
        """A fresh sampling scheduler set to `steps` (the flow one keeps a step index: one per batch)."""
        from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

        if self.objective == "flow":
            scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        else:
            scheduler = DDIMScheduler.from_config({**SCHEDULER, "timestep_spacing": "trailing"})
        scheduler.set_timesteps(steps)
        return scheduler

    def autocast(self, device: torch.device):
        if self.precision == "bf16" and device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass(frozen=True)
class ModelSize:
    layers: int
    heads: int
    head_dim: int
    patch_size: int


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int
    lr: float
    warmup: int
    ema_decay: float  # reached after the EMA's warm-up (power 3/4), so short runs average short windows
    grad_clip: float = 1.0
    mhla_lr: float = 0.0  # the MHLA parameters' own rate (0: lr)
    process: Process = field(default_factory=Process)


def build_dit(resolution: int, size: ModelSize, seed: int):
    """A fresh DiT on (1, resolution, resolution) images with softmax attention."""
    from diffusers import DiTTransformer2DModel

    if resolution % size.patch_size:
        raise ValueError(f"resolution {resolution} is not a multiple of patch size {size.patch_size}")
    torch.manual_seed(seed)
    return DiTTransformer2DModel(
        in_channels=1, out_channels=1, num_layers=size.layers, num_attention_heads=size.heads,
        attention_head_dim=size.head_dim, patch_size=size.patch_size, sample_size=resolution,
        num_embeds_ada_norm=NUM_CLASSES, norm_type="ada_norm_zero", activation_fn="gelu-approximate",
        attention_bias=True)


# DiT's class dropout rate (its label embedding's dropout_prob), the unconditional branch guidance samples:
# drawn here once per sample, not by diffusers' DiT inside its forward, which drops labels independently in
# every block's label embedding (a sample sees its class in some blocks and the null class in others, and
# guidance's all-null input almost never; runs before 2026-12-01 15:00 trained that way).
LABEL_DROPOUT = 0.1


@dataclass(frozen=True)
class Teacher:
    """Output distillation from a frozen `model` at the student's noisy input (weight 1).

    guidance None: both branches as CFG sampling evaluates them: the same labels, the same 10 % of
    them dropped to the null class (`LABEL_DROPOUT`), go to teacher and student. guidance g: the
    teacher's guided prediction
    uncond + g (cond - uncond) is the target of the student's conditional one (guidance
    distillation; the student then samples at guidance 1)."""

    model: torch.nn.Module
    guidance: float | None = None


def _distill_target(teacher: Teacher, inputs: dict) -> torch.Tensor:
    """The recipes' target (`distill.teacher_prediction`), the null class as the unconditional input."""
    null = None if teacher.guidance is None else {**inputs, "class_labels": torch.full_like(inputs["class_labels"], NUM_CLASSES)}
    with torch.no_grad():
        return teacher_prediction(teacher.model, inputs, null, teacher.guidance or 1.0)


def train(model, images, labels, settings: TrainSettings, seed: int, desc: str, progress: bool = True,
          teacher: Teacher | None = None, at_steps=(), at_step=None) -> list[float]:
    """AdamW (wd 0) with linear warm-up, grad clipping and EMA, all parameters trained; the EMA
    weights end up in `model`. With a `teacher`, its prediction is a second target (`Teacher`).
    `at_step(step)` is called after each of `at_steps` with the EMA weights in `model` (eval mode),
    for quality along the way. Labels drop to the null class at `LABEL_DROPOUT`, once per sample (not
    under a guided target, whose student samples at guidance 1). Returns the loss of every step."""
    from diffusers.training_utils import EMAModel

    device = next(model.parameters()).device
    objective = settings.process.training_objective()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(model, params, settings.lr, settings.mhla_lr or settings.lr), weight_decay=0.0)
    warmup = lambda step: min(1.0, (step + 1) / max(1, settings.warmup))  # noqa: E731
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    ema = EMAModel(params, decay=settings.ema_decay, use_ema_warmup=True, power=3 / 4, foreach=True)
    images, labels = images.to(device), labels.to(device)
    torch.manual_seed(seed)
    DIT.stop_conditioning_dropout(model)  # the loop draws the dropped labels
    model.train()
    losses = []
    for step in tqdm(range(1, settings.steps + 1), desc=desc, disable=not progress, mininterval=2):
        idx = torch.randint(0, len(labels), (settings.batch_size,), device=device)
        noisy = objective.noisy(images[idx])
        y = labels[idx]
        if teacher is None or teacher.guidance is None:
            y = torch.where(torch.rand(len(y), device=device) < LABEL_DROPOUT, NUM_CLASSES, y)
        inputs = DIT.transformer_inputs(model, noisy.model_input, noisy.timestep, {"class_label": y})
        with settings.process.autocast(device):
            out = model_output(model(**inputs)).float()
            target = None if teacher is None else _distill_target(teacher, inputs).float()
        loss = objective.loss(out, noisy)
        if teacher is not None:
            loss = loss + (out - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        lr_schedule.step()
        ema.step(params)
        losses.append(loss.detach())
        if step in at_steps and step < settings.steps:
            ema.store(params)
            ema.copy_to(params)
            model.eval()
            at_step(step)
            ema.restore(params)
            model.train()
    ema.copy_to(params)
    model.eval()
    losses = torch.stack(losses).cpu().tolist() if losses else []
    if not all(math.isfinite(v) for v in losses):
        raise FloatingPointError(f"{desc}: the training loss became non-finite; lower the learning rate")
    return losses


@torch.no_grad()
def sample(model, labels: torch.Tensor, steps: int, guidance: float, seed: int, batch_size: int = 500,
           process: Process = Process()) -> torch.Tensor:
    """Images (N, 1, R, R) in [-1, 1] of the classes `labels`, sampled as `process` trained the model;
    the noise depends only on `seed`."""
    device = next(model.parameters()).device
    size = model.config.sample_size
    noise = torch.randn((len(labels), 1, size, size), generator=torch.Generator().manual_seed(seed))
    model.eval()
    out = []
    for x, y in zip(noise.split(batch_size), labels.split(batch_size)):
        x, y = x.to(device), y.to(device)
        guided = guidance != 1.0
        classes = torch.cat([y, torch.full_like(y, NUM_CLASSES)]) if guided else y
        scheduler = process.scheduler(steps)
        for t in scheduler.timesteps:
            inp = torch.cat([x, x]) if guided else x
            timestep = torch.full((len(inp),), t.item(), device=device)
            with process.autocast(device):
                pred = model_output(model(**DIT.transformer_inputs(model, inp, timestep, {"class_label": classes}))).float()
            if guided:
                cond, uncond = pred.chunk(2)
                pred = uncond + guidance * (cond - uncond)
            x = scheduler.step(pred, t, x).prev_sample
        out.append(x.clamp(-1, 1).cpu())
    return torch.cat(out)


def converted_copy(model, blocks, layers="all"):
    """A copy of the softmax `model` with its self-attentions `layers` ("all", or "hybrid:K": every
    K-th keeps softmax) converted to MHLA on `blocks` ((1, 1, 1): one block, plain linear attention),
    or an unchanged copy when `blocks` is None."""
    from ..conversion import convert, default_config

    twin = copy.deepcopy(model)
    if blocks is not None:
        convert(twin, default_config(twin, blocks=blocks, layers=layers))
    return twin
