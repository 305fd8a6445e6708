"""PixArt-alpha/Sigma (`PixArtTransformer2DModel`): T5 text, DDPM, aspect-ratio bins at sampling."""

from __future__ import annotations

import torch

from ..processors import MHLAAttnProcessor
from .base import Family, RealModel

VAE_FACTOR = 8  # PixArt's VAE: its micro-conditions are in pixels


class PixArt(Family):
    def transformer_inputs(self, transformer, latents, timestep, batch: dict) -> dict:
        return {**super().transformer_inputs(transformer, latents, timestep, batch),
                "encoder_attention_mask": batch.get("prompt_attention_mask"),
                "added_cond_kwargs": micro_conditions(transformer, latents)}

    def build_pipeline(self, transformer):
        import diffusers as d
        import transformers as tf

        from ..zoo import WORDS, tiny_tokenizer

        vae = d.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
        encoder = tf.T5EncoderModel(tf.T5Config(vocab_size=len(WORDS) + 3, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                                num_heads=2)).eval()
        return d.PixArtSigmaPipeline(tiny_tokenizer(), encoder, vae, transformer, d.DDIMScheduler())


def micro_conditions(transformer, latents) -> dict:
    """PixArt-alpha's resolution/aspect-ratio micro-conditions (None for models without them)."""
    if not transformer.config.use_additional_conditions:
        return {"resolution": None, "aspect_ratio": None}
    b, _, h, w = latents.shape
    res = torch.tensor([h * VAE_FACTOR, w * VAE_FACTOR], device=latents.device, dtype=latents.dtype).repeat(b, 1)
    return {"resolution": res, "aspect_ratio": (res[:, :1] / res[:, 1:])}


FAMILY = PixArt(
    "pixart", ("PixArtTransformer2DModel",), MHLAAttnProcessor,
    tiny=dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=2, num_attention_heads=2,
              in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
              activation_fn="gelu-approximate", num_embeds_ada_norm=8, norm_type="ada_norm_single",
              norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False, caption_channels=None),
    real={"pixart-sigma": RealModel(dict(sample_size=128, num_layers=28, patch_size=2, attention_head_dim=72,
                                         num_attention_heads=16, in_channels=4, out_channels=8, cross_attention_dim=1152,
                                         caption_channels=4096, attention_bias=True, activation_fn="gelu-approximate",
                                         num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                                         norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False,
                                         interpolation_scale=2),
                                    latent_channels=4, vae_factor=VAE_FACTOR, resolution="1024", text_tokens=300)},
    any_size={"use_resolution_binning": False},
    objective="ddpm",
    context_parallel=("transformer_blocks.0", "proj_out"),
)
