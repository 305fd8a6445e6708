"""Wan2.1 and Wan2.2 (`WanTransformer3DModel`, `WanPipeline`): text-to-video, flow matching, 3D RoPE.

Wan2.2 members: TI2V-5B is one transformer over the Wan2.2 VAE's 48-channel latent (16x spatial,
4x temporal), released at 704 x 1280 x 121 frames; the A14B T2V/I2V pipelines hold two Wan2.1-14B
sized experts, `transformer` (high noise, t >= boundary_ratio * 1000) and `transformer_2` (low
noise), and `convert(pipe)` converts both.
"""

from __future__ import annotations

from ..processors import MHLAProcessorBase
from .base import Family, RealModel, Variant, patched

TI2V_CHANNELS = 48  # the Wan2.2 VAE's z_dim: a transformer over that latent is TI2V-5B
# TI2V-5B at 704 x 1280 x 121 frames (Wan2.2's "720P" for that model): a 31 x 44 x 80 latent
TI2V_LATENT, TI2V_SIZE = (31, 44, 80), "704 x 1280 x 121 frames"


class MHLAWanAttnProcessor(MHLAProcessorBase):
    """Wan self-attention (`blocks[i].attn1`): q/k RMSNorm across heads, 3D RoPE on the numerator."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("MHLAWanAttnProcessor is for unmasked self-attention; cross-attention keeps its own processor")
        if attn.fused_projections:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        out = self.attend(q, k, v, hidden_states, rope=rotary_emb, qk_norm=(attn.norm_q, attn.norm_k)).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def is_ti2v(config) -> bool:
    return config["in_channels"] == TI2V_CHANNELS


class Wan(Family):
    def text_width(self, config) -> int:
        return config.text_dim

    def default_grid(self, transformer):
        if is_ti2v(transformer.config):
            return patched(transformer.config.patch_size, TI2V_LATENT), TI2V_SIZE
        return super().default_grid(transformer)

    def expert_sigmas(self, pipe, component: str) -> tuple[float, float] | None:
        """Wan2.2 A14B: `transformer` runs t >= boundary_ratio * num_train_timesteps, `transformer_2` below."""
        boundary = pipe.config.get("boundary_ratio")
        if boundary is None:
            return None
        return {"transformer": (boundary, 1.0), "transformer_2": (0.0, boundary)}[component]

    def build_pipeline(self, transformer, boundary_ratio: float | None = None):
        """WanPipeline around `transformer`; with `boundary_ratio`, a second random expert as `transformer_2`
        (Wan2.2 A14B). A TI2V transformer gets the Wan2.2 VAE and per-token timesteps (`expand_timesteps`)."""
        import diffusers as d

        from ..zoo import tiny_tokenizer

        ti2v = is_ti2v(transformer.config)
        encoder, vae = tiny_text_encoder(), tiny_vae(wan22=ti2v)
        # built after the other parts, from the random state they leave: weights other than `transformer`'s
        expert = type(transformer).from_config(transformer.config).eval() if boundary_ratio is not None else None
        return d.WanPipeline(tiny_tokenizer(), encoder, vae, d.FlowMatchEulerDiscreteScheduler(shift=3.0), transformer,
                             transformer_2=expert, boundary_ratio=boundary_ratio, expand_timesteps=ti2v)


def tiny_vae(wan22: bool = False):
    """Wan's 3D causal VAE at test size: Wan2.1's (z_dim 16, 4x temporal and 8x spatial downsampling)
    or Wan2.2's (z_dim 48, 2x2 pixel patches and residual down/up-sampling: 16x spatial)."""
    import diffusers as d

    wan22_options = dict(z_dim=TI2V_CHANNELS, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                         scale_factor_spatial=16, latents_mean=[0.0] * TI2V_CHANNELS, latents_std=[1.0] * TI2V_CHANNELS)
    return d.AutoencoderKLWan(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                              **(wan22_options if wan22 else dict(z_dim=16)))


def tiny_text_encoder():
    """A one-layer UMT5 encoder (Wan's text encoder family) over the zoo's tiny vocabulary."""
    import transformers as tf

    from ..zoo import WORDS

    return tf.UMT5EncoderModel(tf.UMT5Config(vocab_size=len(WORDS) + 3, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                             num_heads=2)).eval()


def _real(heads: int, ffn: int, layers: int, resolution: str, channels: int = 16, vae_factor: int = 8,
          frames: int = 81, **config) -> RealModel:
    """A Wan T2V transformer (Wan2.1 1.3B: 12 heads, 14B and each Wan2.2 A14B expert: 40, Wan2.2 TI2V-5B: 24
    over 48 latent channels) at the size it was released for; `config`: its class's other config keys."""
    return RealModel(dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=channels,
                          out_channels=channels, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers,
                          cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, **config),
                     latent_channels=channels, vae_factor=vae_factor, temporal_factor=4, resolution=resolution,
                     text_tokens=512, frames=frames)


FAMILY = Wan(
    "wan", ("WanTransformer3DModel",), MHLAWanAttnProcessor,
    tiny=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
              out_channels=16, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    real={"wan2.1-1.3b": _real(12, 8960, 30, "480p"), "wan2.1-14b": _real(40, 13824, 40, "720p"),
          # Wan2.2: TI2V-5B (3072 = 24 x 128, 30 layers, ffn 14336, 48 in/out channels; VAE 16x spatial, 4x
          # temporal) at 704 x 1280 x 121; one A14B expert (T2V `transformer` or `transformer_2`) = Wan2.1-14B
          "wan2.2-ti2v-5b": _real(24, 14336, 30, "704x1280", channels=TI2V_CHANNELS, vae_factor=16, frames=121),
          "wan2.2-t2v-a14b": _real(40, 13824, 40, "720p")},
    # tiny Wan2.2 members: TI2V over the 48-channel latent, and a two-expert A14B pipeline (T2V boundary 0.875)
    variants={"wan2.2-ti2v": Variant(config=dict(in_channels=TI2V_CHANNELS, out_channels=TI2V_CHANNELS)),
              "wan2.2-a14b": Variant(pipeline=dict(boundary_ratio=0.875))},
    block_list="blocks",
    # The released Wan2.1 MHLA: no normalizer, per-head RMSNorm on the output, RoPE on the numerator.
    defaults={"normalize": False, "output_norm": True},
    # 480p x 81 frames: the VAE's latent is 21 frames of 60 x 104.
    default_latent=(21, 60, 104), default_size_name="480p x 81 frames",
    video=True,  # context parallelism: diffusers' own `_cp_plan`
)
