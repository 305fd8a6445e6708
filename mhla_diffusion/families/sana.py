"""SANA (`SanaTransformer2DModel`): its global ReLU linear attention becomes the blocked one."""

from __future__ import annotations

import torch

from ..processors import MHLAProcessorBase
from .base import Family, RealModel


class MHLASanaAttnProcessor(MHLAProcessorBase):
    """SANA's self-attention (`transformer_blocks[i].attn1`) through MHLA."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if encoder_hidden_states is not None:
            raise ValueError("MHLASanaAttnProcessor is for self-attention; cross-attention keeps its own processor")
        dtype = hidden_states.dtype
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        out = self.attend(q, k, v, hidden_states).to(dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out


class Sana(Family):
    def transformer_inputs(self, transformer, latents, timestep, batch: dict) -> dict:
        return {**super().transformer_inputs(transformer, latents, timestep, batch),
                "encoder_attention_mask": batch.get("prompt_attention_mask")}

    def build_pipeline(self, transformer):
        import diffusers as d

        vae = d.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2,
                              encoder_block_types=("ResBlock", "EfficientViTBlock"),
                              decoder_block_types=("ResBlock", "EfficientViTBlock"),
                              encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                              encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
                              encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1],
                              downsample_block_type="conv", upsample_block_type="interpolate",
                              decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
        return d.SanaPipeline(*tiny_text_parts(), vae, transformer, d.FlowMatchEulerDiscreteScheduler(shift=3.0))


def tiny_text_parts():
    """The zoo's tokenizer and a one-layer Gemma-2 encoder of width 8 (SANA's text encoder family)."""
    import transformers as tf

    from ..zoo import WORDS, tiny_tokenizer

    encoder = tf.Gemma2Model(tf.Gemma2Config(vocab_size=len(WORDS) + 3, hidden_size=8, intermediate_size=16,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             head_dim=4)).eval()
    return tiny_tokenizer(), encoder


FAMILY = Sana(
    "sana", ("SanaTransformer2DModel",), MHLASanaAttnProcessor,
    tiny=dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=4,
              num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
              cross_attention_dim=8, caption_channels=8, sample_size=8),
    real={"sana-1.6b": RealModel(dict(patch_size=1, in_channels=32, out_channels=32, num_layers=20, attention_head_dim=32,
                                      num_attention_heads=70, num_cross_attention_heads=20, cross_attention_head_dim=112,
                                      cross_attention_dim=2240, caption_channels=2304, mlp_ratio=2.5, sample_size=32),
                                 latent_channels=32, vae_factor=32, resolution="4096", text_tokens=300)},
    # eps as SANA's own linear attention, so blocks=(1,1,1) reproduces the original exactly.
    defaults={"eps": 1e-15},
    any_size={"use_resolution_binning": False},
    # its "complex human instruction" prompt prefix is not used in training (nor read by a tiny encoder)
    validation_kwargs={"complex_human_instruction": None},
    no_context_parallel="its Mix-FFN convolves over the image grid, which a contiguous token split cuts; run it on one GPU",
)
