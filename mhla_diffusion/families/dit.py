"""DiT (`DiTTransformer2DModel`, `DiTPipeline`): class-conditional, DDPM, at its trained size."""

from __future__ import annotations

import torch

from ..processors import MHLAAttnProcessor
from .base import Family, RealModel

DIT_NULL_CLASS = 1000  # DiTPipeline's classifier-free guidance uses class id 1000 as the null class


class DiT(Family):
    def transformer_inputs(self, transformer, latents, timestep, batch: dict) -> dict:
        return {"hidden_states": latents, "timestep": timestep, "class_labels": batch["class_label"]}

    def unconditional(self, transformer, encode) -> dict:
        """The null class: the row diffusers' label embedding adds after the classes (id = number of classes),
        which DiTPipeline's guidance uses (as id 1000, ImageNet's class count)."""
        return {"class_label": torch.tensor([transformer.config.num_embeds_ada_norm])}

    def stop_conditioning_dropout(self, transformer) -> None:
        """diffusers' DiT drops labels to the null class (at 0.1) inside its forward in train mode, independently
        in every block's label embedding and the output's: a sample would see its class in some blocks and the
        null class in others, and a teacher in eval mode never."""
        from diffusers.models.embeddings import LabelEmbedding

        for m in transformer.modules():
            if isinstance(m, LabelEmbedding):
                m.dropout_prob = 0.0  # its null-class row stays: the embedding table was sized at init

    def call_kwargs(self, pipe, indices: list[int], settings) -> dict:
        num_classes = pipe.transformer.config.num_embeds_ada_norm
        guided = (settings.guidance_scale if settings.guidance_scale is not None else 4.0) > 1  # DiTPipeline's default
        if guided and num_classes != DIT_NULL_CLASS:
            raise ValueError(f"DiTPipeline's guidance uses null class {DIT_NULL_CLASS} but this model has {num_classes} "
                             "classes; pass guidance scale 1")
        if settings.prompts or settings.height or settings.width or settings.num_frames:
            raise ValueError("DiT is class-conditional at its trained size: prompts, height, width and frames do not apply")
        return {"class_labels": [i % num_classes for i in indices]}

    def demo_kwargs(self) -> dict:
        return {"class_labels": [0, 1, 2, 3]}

    def build_pipeline(self, transformer):
        import diffusers as d

        vae = d.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
        return d.DiTPipeline(transformer, vae, d.DDIMScheduler(), id2label={i: f"class {i}" for i in range(8)})


FAMILY = DiT(
    "dit", ("DiTTransformer2DModel",), MHLAAttnProcessor,
    tiny=dict(in_channels=4, out_channels=8, activation_fn="gelu-approximate", num_attention_heads=2,
              attention_head_dim=4, attention_bias=True, num_layers=2, norm_type="ada_norm_zero",
              num_embeds_ada_norm=1000, patch_size=2, sample_size=8),  # DiTPipeline's null class is 1000
    real={"dit-xl-2": RealModel(dict(in_channels=4, out_channels=8, num_attention_heads=16, attention_head_dim=72,
                                     num_layers=28, activation_fn="gelu-approximate", attention_bias=True,
                                     norm_type="ada_norm_zero", num_embeds_ada_norm=1000, patch_size=2, sample_size=32),
                                latent_channels=4, vae_factor=8, resolution="512",
                                checkpoints={"512": dict(sample_size=64)})},  # facebook/DiT-XL-2-512; the above is -256
    objective="ddpm", text=False,
    # split before the first block, gather after the last token-wise projection
    context_parallel=("transformer_blocks.0", "proj_out_2"),
)
