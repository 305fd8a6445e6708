"""Frozen encoders: pixels -> normalized VAE posterior, captions -> text embeddings.

The VAE posterior is kept as (mean, std) rather than a drawn latent, so a precomputed cache
and raw data draw the training latent the same way, from the step's random stream.
"""

from __future__ import annotations

import inspect

import torch


def _latent_norm(vae, like: torch.Tensor):
    """(shift, scale) such that normalized = (z - shift) * scale, broadcastable to `like`."""
    cfg = vae.config
    if cfg.get("latents_mean") is not None:  # Wan: per-channel statistics
        shape = (1, -1) + (1,) * (like.ndim - 2)
        mean = torch.tensor(cfg.latents_mean, device=like.device, dtype=like.dtype).view(shape)
        std = torch.tensor(cfg.latents_std, device=like.device, dtype=like.dtype).view(shape)
        return mean, 1.0 / std
    return cfg.get("shift_factor") or 0.0, cfg.scaling_factor


@torch.no_grad()
def vae_posterior(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalized latent mean and std (std None for deterministic autoencoders such as SANA's DC-AE)."""
    enc = vae.encode(pixels.to(vae.dtype))
    dist = getattr(enc, "latent_dist", None)
    mean, std = (dist.mean, dist.std) if dist is not None else (enc.latent, None)
    shift, scale = _latent_norm(vae, mean)
    mean = ((mean - shift) * scale).float().contiguous()
    return mean, None if std is None else (std * scale).float().contiguous()


def draw_latents(mean: torch.Tensor, std: torch.Tensor | None) -> torch.Tensor:
    """A sample of the VAE posterior (as upstream training does), from the global RNG.

    `randn` of the shape, not `randn_like`: the latter follows the input's strides, so a
    non-contiguous posterior (raw data) and a stored one (cache) would draw different noise."""
    return mean if std is None else mean + std * torch.randn(std.shape, dtype=std.dtype, device=std.device)


def default_max_sequence_length(pipe) -> int:
    return inspect.signature(pipe.encode_prompt).parameters["max_sequence_length"].default


@torch.no_grad()
def encode_text(pipe, captions: list[str], max_sequence_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Text embeddings and attention mask, with the pipeline's own encode_prompt (as at inference)."""
    out = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False, device=device,
                             max_sequence_length=max_sequence_length or default_max_sequence_length(pipe))
    embeds = out[0]
    mask = out[1] if isinstance(out[1], torch.Tensor) and out[1].ndim == 2 else None
    if mask is None:  # Wan zero-pads and takes no mask; keep one so every cache has the same keys
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    return embeds.float(), mask


def unconditional(pipe, transformer, family, max_sequence_length: int, device, dtype) -> dict:
    """The input of the unconditional branch of classifier-free guidance (`family.unconditional`) on `device`;
    the text families' empty prompt is encoded once, by the pipeline's text encoder on `device` in `dtype` (a
    CPU encode of UMT5-XXL takes minutes per rank); an encoder that was elsewhere goes back there, in `dtype`."""
    def encode(prompts):
        if pipe is None:
            raise ValueError("a bare transformer has no text encoder for the empty prompt of classifier-free guidance: "
                             "give its pipeline as pretrained, or set uncond_prob 0 and distill_guidance_scale 1")
        home = pipe.text_encoder.device
        pipe.text_encoder.to(device, dtype=dtype)
        try:
            return encode_text(pipe, prompts, max_sequence_length, device)
        finally:
            pipe.text_encoder.to(home)

    return {k: v.to(device) for k, v in family.unconditional(transformer, encode).items()}


def drop_conditioning(batch: dict, uncond: dict, drop: torch.Tensor) -> dict:
    """`batch` with the conditioning of the samples where `drop` ((B,) bool) is true replaced by `uncond`
    (one sample's, from `unconditional`): what teacher and student both get."""
    out = dict(batch)
    for key, value in uncond.items():
        if value.shape[1:] != batch[key].shape[1:]:
            raise ValueError(f"the unconditional {key} has shape {list(value.shape[1:])} but the batch's has "
                             f"{list(batch[key].shape[1:])}: set max_sequence_length to the one the latent cache was made with")
        out[key] = torch.where(drop.view(-1, *[1] * (value.ndim - 1)), value.to(batch[key].dtype), batch[key])
    return out


def vae_factors(vae) -> tuple[int, int]:
    """(temporal, spatial) compression of a VAE."""
    cfg = vae.config
    if "scale_factor_spatial" in cfg:
        return cfg.scale_factor_temporal, cfg.scale_factor_spatial
    ratio = getattr(vae, "spatial_compression_ratio", None)
    return 1, ratio or 2 ** (len(cfg.block_out_channels) - 1)


def latent_shape(vae, resolution, num_frames: int, video: bool) -> tuple[int, ...]:
    """Shape of one normalized latent (C, [F,] H, W) for the training resolution."""
    ft, fs = vae_factors(vae)
    h, w = resolution
    if h % fs or w % fs:
        raise ValueError(f"resolution {h}x{w} is not a multiple of the VAE's spatial factor {fs}")
    channels = vae.config.get("latent_channels") or vae.config.get("z_dim")
    if not video:
        return (channels, h // fs, w // fs)
    if (num_frames - 1) % ft:
        raise ValueError(f"num_frames must be 1 + a multiple of {ft} for this VAE, got {num_frames}")
    return (channels, (num_frames - 1) // ft + 1, h // fs, w // fs)


def encode_batch(batch: dict, pipe, text: bool, max_sequence_length: int, device) -> dict:
    """Raw batch (pixels, caption|class_label) -> the keys a latent cache stores."""
    mean, std = vae_posterior(pipe.vae, batch["pixels"].to(device))
    out = {"latents_mean": mean}
    if std is not None:
        out["latents_std"] = std
    if text:
        out["prompt_embeds"], out["prompt_attention_mask"] = encode_text(pipe, batch["caption"], max_sequence_length, device)
    else:
        out["class_label"] = batch["class_label"].to(device)
    return out
