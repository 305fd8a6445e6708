#!/usr/bin/env python
"""Fine-tune a pretrained diffusers transformer converted to MHLA.

    accelerate launch recipes/train.py --config recipes/configs/wan21_t2v_1_3b.yaml [--key value ...]

Loads the original model, converts its self-attention (all layers, a list, or hybrid), and
trains it with the family's upstream objective (DDPM + learned variance for DiT/PixArt, flow
matching for SANA/Wan), optionally distilling from the unconverted model. Every random draw of
step k comes from a seed of (seed, k, micro-batch, data-parallel rank), so a resumed run continues
exactly as an uninterrupted one would. `--context_parallel P` splits each sample's tokens over the
P processes (mhla_diffusion.training.context_parallel). A bad input ends the run with one line and
exit 2, Ctrl-C with the resume command and 130 (tracebacks with --debug or MHLA_DEBUG=1). Helpers
live in mhla_diffusion.training.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin, ProjectConfiguration
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from mhla_diffusion.conversion import converted_indices
from mhla_diffusion.training import checkpoint, conditioning, context_parallel, data, distill, launch, model, objectives, validation
from mhla_diffusion.training.train_config import config_reference, config_source, load_config, parse_overrides, save_config

log = logging.getLogger("mhla_diffusion.train")
WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="config keys (YAML, or --key value on the command line):\n" + config_reference())
    parser.add_argument("--config", action="append", help="recipe YAML; give it again to layer another on top (its keys win: "
                        "a family's config, then configs/teacher_only.yaml); any other --key value overrides one of its keys")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    cfg = load_config(args.config, overrides)
    launch.check_precision(cfg, overrides, args.config)
    resume_from = checkpoint.find_resume(cfg)  # a mismatching checkpoint or a used output_dir fails before anything loads

    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.gradient_accumulation_steps, sync_with_dataloader=False),
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )
    logging.basicConfig(level=logging.INFO if accelerator.is_main_process else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp and (cfg.distill_output or cfg.distill_layers or cfg.ema_decay or cfg.validation_steps or cfg.train_mode == "lora"):
        raise ValueError("under FSDP the recipe supports full/mhla training without distillation, EMA, LoRA or validation samples")
    context_parallel.check(cfg, accelerator.num_processes, fsdp)
    cp_size = context_parallel.group_size(cfg)
    data_rank = accelerator.process_index // cp_size  # the ranks of a context-parallel group draw the same numbers
    torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
    torch.manual_seed(cfg.seed)
    weight_dtype = WEIGHT_DTYPES[cfg.mixed_precision]
    device = accelerator.device

    # --- model and data (every input check happens here, before training starts)
    pipe, transformer, family = model.load_model(cfg)
    validation.check_validation(cfg, family)
    data_type = cfg.data_type if cfg.data_type != "auto" else data.detect_data_type(cfg.data_dir, family.video)
    dataset = data.build_dataset(data_type, cfg.data_dir, cfg.resolution, cfg.num_frames)
    skipped = data.SkippedFiles(dataset, cfg.max_unreadable)
    cached = data_type == "latents"
    if cached:
        data.check_cache(dataset.info, cfg, family.name)
        latent_shape = tuple(dataset.info["latent_shape"])
    elif pipe is None:
        raise ValueError(f"{cfg.pretrained} is a bare transformer: raw images/videos need its pipeline (VAE, text encoder)")
    else:
        latent_shape = conditioning.latent_shape(pipe.vae, cfg.resolution, cfg.num_frames, family.video)
    if len(dataset) < cfg.train_batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes // cp_size:
        raise ValueError(f"{len(dataset)} samples in {cfg.data_dir} are fewer than one optimizer step consumes "
                         f"(train_batch_size {cfg.train_batch_size} x gradient_accumulation_steps "
                         f"{cfg.gradient_accumulation_steps} x {accelerator.num_processes // cp_size} data-parallel "
                         f"process(es), from {config_source(args.config)} and the command line): lower "
                         "--train_batch_size or add data")

    distilling = bool(cfg.distill_output or cfg.distill_layers)
    teacher = None
    if distilling:
        teacher = distill.build_teacher(transformer, model.frozen_parameter_ids(transformer, cfg), weight_dtype).to(device)
    model.convert_model(transformer, model.mhla_config(transformer, cfg, latent_shape))
    params = model.set_trainable(transformer, cfg)
    if cp_size > 1:
        context_parallel.enable(transformer, cfg)
    transformer.train()
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    taps = None
    if cfg.distill_layers:
        layers = converted_indices(transformer)
        taps = (distill.AttentionTap(transformer, layers), distill.AttentionTap(teacher, layers))
    scheduler_config = pipe.scheduler.config if pipe is not None else None
    objective = objectives.build_objective(cfg.objective if cfg.objective != "auto" else family.objective, transformer, scheduler_config, cfg,
                                           model.expert_sigmas(pipe, cfg))
    if pipe is not None and (not cached or cfg.validation_steps):
        pipe.vae.to(device)
        if family.text:
            pipe.text_encoder.to(device, dtype=weight_dtype)
    guided = cfg.distill_guidance_scale != 1
    uncond = (conditioning.unconditional(pipe, transformer, family, cfg.max_sequence_length, device, weight_dtype)
              if cfg.uncond_prob or guided else None)
    for other in model.other_experts(pipe, cfg) if cfg.validation_steps else []:  # frozen; validation samples with it
        other.requires_grad_(False).to(device, dtype=weight_dtype)

    optimizer = torch.optim.AdamW(model.param_groups(transformer, params, cfg.learning_rate, cfg.mhla_learning_rate), betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, eps=cfg.adam_epsilon)
    lr_scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=cfg.max_steps * accelerator.num_processes)
    loader = DataLoader(dataset, batch_size=cfg.train_batch_size, shuffle=True, drop_last=True,
                        num_workers=cfg.num_workers, collate_fn=data.collate)
    transformer, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)
    loader = context_parallel.prepare_loader(accelerator, loader, cfg)
    ema = None
    if cfg.ema_decay:
        ema = EMAModel(params, decay=cfg.ema_decay)
        ema.to(device)
        accelerator.register_for_checkpointing(ema)
    steps_per_epoch = len(loader) // cfg.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ValueError("each process gets fewer batches per epoch than gradient_accumulation_steps")

    # --- resume
    global_step, epoch, skip = 0, 0, 0
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        progress = checkpoint.read_progress(resume_from)
        global_step, epoch, skip = progress["step"], progress["epoch"], progress["batches_in_epoch"]
        log.info("resumed from %s at step %d (epoch %d, skipping %d batches)", resume_from, global_step, epoch, skip)
    if accelerator.is_main_process:
        checkpoint.clear_output_dir(cfg)  # --overwrite_output_dir, now that every input check has passed
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "train_config.yaml")
        accelerator.init_trackers("mhla", config={k: str(v) for k, v in vars(cfg).items()})

    def losses_of(batch):
        if not cached:
            batch.update(conditioning.encode_batch(batch, pipe, family.text, cfg.max_sequence_length, device))
        x0 = conditioning.draw_latents(batch["latents_mean"], batch.get("latents_std"))
        noisy = objective.noisy(x0)
        if cfg.uncond_prob:  # guidance's unconditional branch, for the same samples in teacher and student
            batch = conditioning.drop_conditioning(batch, uncond, torch.rand(len(x0), device=device) < cfg.uncond_prob)
        unwrapped = accelerator.unwrap_model(transformer)
        inputs = family.transformer_inputs(unwrapped, noisy.model_input, noisy.timestep, batch)
        out = objectives.model_output(transformer(**inputs, return_dict=False))
        losses = {"diffusion": objective.loss(out, noisy)}
        if teacher is not None:
            uncond_inputs = None
            if guided:
                everyone = torch.ones(len(x0), dtype=torch.bool, device=device)
                uncond_inputs = family.transformer_inputs(unwrapped, noisy.model_input, noisy.timestep,
                                                          conditioning.drop_conditioning(batch, uncond, everyone))
            with torch.no_grad(), accelerator.autocast():
                teacher_out = distill.teacher_prediction(teacher, inputs, uncond_inputs, cfg.distill_guidance_scale)
            losses.update(distill.distill_loss(out, teacher_out, *(taps or (None, None)), cfg.distill_output, cfg.distill_layers))
        return losses

    # --- loop
    bar = tqdm(total=cfg.max_steps, initial=global_step, desc="steps", disable=not accelerator.is_local_main_process)
    logged = {}
    while global_step < cfg.max_steps:
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        batches.set_epoch(epoch)  # the shuffle order is a function of (seed, epoch)
        n_batches = steps_per_epoch * cfg.gradient_accumulation_steps - skip  # whole optimizer steps only
        for micro, batch in enumerate(itertools.islice(batches, n_batches)):
            torch.manual_seed(step_seed(cfg.seed, global_step, micro % cfg.gradient_accumulation_steps, data_rank))
            skipped.add(batch.pop("skipped"))
            with accelerator.accumulate(transformer):
                losses = losses_of(batch)
                loss = sum(losses.values())
                accelerator.backward(loss * cp_size)  # DDP averages; the group's partial gradients add up
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(transformer.parameters(), cfg.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            for k, v in {"loss": loss, **losses}.items():
                logged[k] = logged.get(k, 0.0) + v.detach() / cfg.gradient_accumulation_steps
            if not accelerator.sync_gradients:
                continue
            global_step += 1
            bar.update(1)
            if ema is not None:
                ema.step(params)
            if global_step % cfg.log_every == 0 or global_step == cfg.max_steps:
                scalars = {k: accelerator.reduce(v, "mean").item() for k, v in logged.items()}
                scalars.update({"lr": lr_scheduler.get_last_lr()[0], "data/skipped_files": skipped.sync(accelerator),
                                **({} if fsdp else model.mixing_drift(accelerator.unwrap_model(transformer)))})
                accelerator.log(scalars, step=global_step)
                bar.set_postfix(loss=f"{scalars['loss']:.4f}")
            logged = {}
            if global_step % cfg.checkpointing_steps == 0 or global_step == cfg.max_steps:
                checkpoint.save_checkpoint(accelerator, cfg, global_step, steps_per_epoch)
            if cfg.validation_steps and global_step % cfg.validation_steps == 0 and accelerator.is_main_process:
                with validation.ema_weights(ema, params):
                    files = validation.sample(pipe, accelerator.unwrap_model(transformer), family, cfg, global_step)
                validation.log_grid(accelerator, files[-1], global_step)
                log.info("step %d: wrote %d validation samples and grid.png to %s", global_step, len(files) - 1,
                         files[0].parent)
            if global_step >= cfg.max_steps:
                break
        epoch, skip = epoch + 1, 0
    bar.close()
    if skipped.files.paths and accelerator.is_main_process:
        log.warning(skipped.files.summary())

    # --- final save, loadable with mhla_diffusion.from_pretrained
    accelerator.wait_for_everyone()
    final = accelerator.unwrap_model(transformer)
    if ema is not None:
        ema.copy_to(params)
    if cfg.train_mode == "lora":
        model.merge_lora(final)
    state = accelerator.get_state_dict(transformer)
    if accelerator.is_main_process:
        out = Path(cfg.output_dir) / "final"
        model.save_trained(out, final, state, pipe, cfg.component)
        log.info("saved the trained model to %s (load with mhla_diffusion.from_pretrained)", out)
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(launch.run_recipe(main, resumable=True))
