"""SkyReels-V2 (`SkyReelsV2Transformer3DModel`, `SkyReelsV2Pipeline`): Wan2.1's architecture, retrained.

Its blocks are Wan's (`blocks[i].attn1`: q/k RMSNorm across heads, the same 3D RoPE, the same processor
call), so it takes Wan's MHLA processor, released variant, VAE and text encoder. Diffusion forcing
(`num_frame_per_block > 1`, the DF pipelines' `causal_block_size`) masks self-attention frame-causally;
MHLA here is bidirectional, so such a call is refused, as is any other masked self-attention call.
"""

from __future__ import annotations

from .wan import FAMILY as WAN
from .wan import MHLAWanAttnProcessor, Wan, _real, tiny_text_encoder, tiny_vae


class MHLASkyReelsV2AttnProcessor(MHLAWanAttnProcessor):
    """SkyReels-V2 self-attention: Wan's, refusing diffusion forcing's frame-causal mask by name."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("SkyReels-V2 diffusion forcing (num_frame_per_block > 1) masks self-attention frame-causally; "
                             "MHLA is bidirectional: run converted models with num_frame_per_block 1 (no causal_block_size)")
        return super().__call__(attn, hidden_states, encoder_hidden_states, rotary_emb=rotary_emb)


class SkyReels(Wan):
    def transformer_inputs(self, transformer, latents, timestep, batch: dict) -> dict:
        inputs = super().transformer_inputs(transformer, latents, timestep, batch)
        if transformer.config.inject_sample_info:  # DF checkpoints: an fps embedding, 0 for 16 fps, 1 otherwise (24)
            inputs["fps"] = batch.get("fps", [1] * latents.shape[0])
        return inputs

    def build_pipeline(self, transformer):
        import diffusers as d

        from ..zoo import tiny_tokenizer

        scheduler = d.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
        return d.SkyReelsV2Pipeline(tiny_tokenizer(), tiny_text_encoder(), transformer, tiny_vae(), scheduler)


FAMILY = SkyReels(
    "skyreels", ("SkyReelsV2Transformer3DModel",), MHLASkyReelsV2AttnProcessor,
    tiny=WAN.tiny,  # Wan's tiny transformer (16 latent channels, as the tiny Wan VAE makes)
    real={"skyreels-v2-t2v-14b-720p": _real(40, 13824, 40, "720p", frames=121),
          "skyreels-v2-df-1.3b-540p": _real(12, 8960, 30, "544x960", frames=97, inject_sample_info=True)},
    block_list="blocks",
    defaults=WAN.defaults,
    # SkyReelsV2Pipeline's default size, 544 x 960 x 97 frames: a 25 x 68 x 120 latent
    default_latent=(25, 68, 120), default_size_name="544 x 960 x 97 frames",
    video=True,
    no_context_parallel="diffusers 0.42.1 gives SkyReelsV2Transformer3DModel no _cp_plan (its RoPE tables, made before "
                        "the blocks, would have to be split with the tokens); run it on one GPU",
)
