"""Wan2.1 (`WanTransformer3DModel`, `WanPipeline`): text-to-video, flow matching, 3D RoPE."""

from __future__ import annotations

from ..processors import MHLAProcessorBase
from .base import Family, RealModel


class MHLAWanAttnProcessor(MHLAProcessorBase):
    """Wan self-attention (`blocks[i].attn1`): q/k RMSNorm across heads, 3D RoPE on the numerator."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("MHLAWanAttnProcessor is for unmasked self-attention; cross-attention keeps its own processor")
        if attn.fused_projections:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        out = self.attend(q, k, v, hidden_states, rope=rotary_emb).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class Wan(Family):
    def text_width(self, config) -> int:
        return config.text_dim

    def build_pipeline(self, transformer):
        import diffusers as d

        from ..zoo import tiny_tokenizer

        vae = tiny_vae()
        return d.WanPipeline(tiny_tokenizer(), tiny_text_encoder(), vae, d.FlowMatchEulerDiscreteScheduler(shift=3.0),
                             transformer)


def tiny_vae():
    """Wan's 3D causal VAE at test size (z_dim 16, 4x temporal and 8x spatial downsampling)."""
    import diffusers as d

    return d.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                              temperal_downsample=[False, True, True])


def tiny_text_encoder():
    """A one-layer UMT5 encoder (Wan's text encoder family) over the zoo's tiny vocabulary."""
    import transformers as tf

    from ..zoo import WORDS

    return tf.UMT5EncoderModel(tf.UMT5Config(vocab_size=len(WORDS) + 3, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                             num_heads=2)).eval()


def _real(heads: int, ffn: int, layers: int, resolution: str) -> RealModel:
    """A Wan2.1 T2V transformer (1.3B: 12 heads, 14B: 40) at the size it was released for."""
    return RealModel(dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=16,
                          out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers,
                          cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6),
                     latent_channels=16, vae_factor=8, temporal_factor=4, resolution=resolution, text_tokens=512)


FAMILY = Wan(
    "wan", ("WanTransformer3DModel",), MHLAWanAttnProcessor,
    tiny=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
              out_channels=16, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    real={"wan2.1-1.3b": _real(12, 8960, 30, "480p"), "wan2.1-14b": _real(40, 13824, 40, "720p")},
    block_list="blocks",
    # The released Wan2.1 MHLA: no normalizer, per-head RMSNorm on the output, RoPE on the numerator.
    defaults={"normalize": False, "output_norm": True},
    # 480p x 81 frames: the VAE's latent is 21 frames of 60 x 104.
    default_latent=(21, 60, 104), default_size_name="480p x 81 frames",
    video=True,  # context parallelism: diffusers' own `_cp_plan`
)
