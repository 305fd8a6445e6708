"""SANA-Video (`SanaVideoTransformer3DModel`, `SanaVideoPipeline`): its global ReLU linear attention
over all frames x rows x columns becomes the blocked one.

diffusers' `SanaLinearAttnProcessor3_0` (0.42.1): q, k, v from the layer's projections, RMSNorm of
q and k across heads, phi = ReLU per head, then Wan's 3D RoPE (interleaved pairs) on phi(q) and
phi(k) in the numerator only; the denominator is phi(q) . sum_j phi(k_j), un-rotated, plus 1e-15.
That is MHLA's `rope="numerator"` with the normalizer on and eps 1e-15, so blocks (1, 1, 1)
reproduce the original (it sums the denominator in the input dtype, MHLA in fp32 at least).
"""

from __future__ import annotations

from ..processors import MHLAProcessorBase
from .base import RealModel
from .sana import Sana, tiny_text_parts
from .wan import tiny_vae


class MHLASanaVideoAttnProcessor(MHLAProcessorBase):
    """SANA-Video self-attention (`transformer_blocks[i].attn1`): q/k RMSNorm, ReLU, RoPE on the numerator."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("MHLASanaVideoAttnProcessor is for unmasked self-attention; cross-attention keeps its own processor")
        dtype = hidden_states.dtype
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        out = self.attend(q, k, v, hidden_states, rope=rotary_emb).to(dtype)
        return attn.to_out[1](attn.to_out[0](out))


class SanaVideo(Sana):
    """SANA's transformer inputs (with the prompt mask); the pipeline names its frame count `frames`."""

    def size_kwargs(self, height=None, width=None, frames=None) -> dict:
        sizes = (("height", height), ("width", width), ("frames", frames))
        return {k: v for k, v in sizes if v is not None}

    def demo_kwargs(self) -> dict:
        """64 x 64 x 5 (sizes divisible by 32): 2 x 4 x 4 tokens, so "auto" picks blocks (1, 2, 2); at 32 x 32
        it picks one block, which is SANA-Video's own attention exactly (the demo would show no difference)."""
        return {**super().demo_kwargs(), **self.size_kwargs(64, 64)}

    def build_pipeline(self, transformer):
        """SANA's tiny tokenizer and Gemma-2 encoder (width 8), Wan's tiny VAE (SANA-Video uses Wan2.1's)."""
        import diffusers as d

        return d.SanaVideoPipeline(*tiny_text_parts(), tiny_vae(), transformer, d.FlowMatchEulerDiscreteScheduler(shift=8.0))


FAMILY = SanaVideo(
    "sana_video", ("SanaVideoTransformer3DModel",), MHLASanaVideoAttnProcessor,
    # diffusers' own tests' tiny config, with caption_channels 8 for SANA's tiny Gemma-2 encoder
    tiny=dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=12, num_layers=2,
              num_cross_attention_heads=2, cross_attention_head_dim=12, cross_attention_dim=24, caption_channels=8,
              mlp_ratio=2.5, sample_size=8, patch_size=(1, 2, 2), norm_elementwise_affine=False, norm_eps=1e-6,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    # SANA-Video 2B 480p (Efficient-Large-Model/SANA-Video_2B_480p_diffusers): the transformer_kwargs of
    # diffusers' scripts/convert_sana_video_to_diffusers.py; Wan2.1's VAE (16 channels, 8x spatial, 4x
    # temporal) and Gemma-2-2B text (300 tokens of 2304), as its model_index.json and pipeline name them.
    real={"sana-video-2b": RealModel(dict(in_channels=16, out_channels=16, num_attention_heads=20, attention_head_dim=112,
                                          num_layers=20, num_cross_attention_heads=20, cross_attention_head_dim=112,
                                          cross_attention_dim=2240, caption_channels=2304, mlp_ratio=3.0,
                                          attention_bias=False, sample_size=30, patch_size=(1, 2, 2),
                                          norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads",
                                          rope_max_seq_len=1024),
                                     latent_channels=16, vae_factor=8, temporal_factor=4, resolution="480p",
                                     text_tokens=300)},
    # eps as SANA-Video's own linear attention, so blocks=(1,1,1) reproduces the original exactly
    # (MHLAConfig's defaults already give its normalizer and RoPE on the numerator).
    defaults={"eps": 1e-15},
    # 480p x 81 frames, the pipeline's default: the Wan VAE's latent is 21 frames of 60 x 104 (21 x 30 x 52 tokens).
    default_latent=(21, 60, 104), default_size_name="480p x 81 frames",
    # its aspect-ratio bins need the released sample_size (30 or 22)
    any_size={"use_resolution_binning": False},
    # its "complex human instruction" prompt prefix is not used in training (nor read by a tiny encoder)
    validation_kwargs={"complex_human_instruction": None},
    video=True,
    no_context_parallel="its Mix-FFN convolves over rows and columns (3x3) and over frames (3 taps), which a "
                        "contiguous token split cuts; run it on one GPU",
)
