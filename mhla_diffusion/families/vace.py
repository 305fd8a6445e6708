"""Wan-VACE (`WanVACETransformer3DModel`, `WanVACEPipeline`): Wan2.1 plus control blocks.

The control ("VACE") blocks are Wan blocks over the control video's tokens (`vace_blocks[j].attn1`:
the same attention, the same token grid and RoPE tables); each adds a hint to the main stream after
main block `vace_layers[j]`. Both kinds convert, with Wan's processor and released variant. The
layer indices of `MHLAConfig.layers` count the main blocks first (0 .. num_layers-1), then the
control blocks (num_layers .. num_layers + len(vace_layers) - 1). Why the control blocks convert by
default: README, "Wan-VACE".
"""

from __future__ import annotations

import torch

from .wan import FAMILY as WAN
from .wan import MHLAWanAttnProcessor, Wan, _real, tiny_text_encoder, tiny_vae


class Vace(Wan):
    def self_attentions(self, transformer) -> list:
        return [b.attn1 for b in transformer.blocks] + [b.attn1 for b in transformer.vace_blocks]

    def self_attention_paths(self, config: dict) -> list[str]:
        return ([f"blocks.{i}.attn1" for i in range(config["num_layers"])]
                + [f"vace_blocks.{j}.attn1" for j in range(len(config["vace_layers"]))])

    def transformer_inputs(self, transformer, latents, timestep, batch: dict) -> dict:
        if batch.get("control_hidden_states") is None:
            raise ValueError("WanVACETransformer3DModel needs control_hidden_states (the encoded control video and mask), "
                             "which the recipe's data does not provide: fine-tune the Wan2.1 base model instead")
        return {**super().transformer_inputs(transformer, latents, timestep, batch),
                "control_hidden_states": batch["control_hidden_states"]}

    def example_conditioning(self, transformer, latent: tuple, batch: int, text_tokens: int, generator=None) -> dict:
        # a control video's latent and mask, at the latent's size
        control = torch.randn(batch, transformer.config.vace_in_channels, *latent[1:], generator=generator)
        return {**super().example_conditioning(transformer, latent, batch, text_tokens, generator),
                "control_hidden_states": control}

    def call_kwargs(self, pipe, indices: list[int], settings) -> dict:
        if len(indices) != 1:
            raise ValueError("WanVACEPipeline takes one prompt per call: sample with batch size 1 (--batch-size 1)")
        kwargs = super().call_kwargs(pipe, indices, settings)
        # one prompt and one generator, not lists of one (the same seed per sample as evaluation.sampling)
        return {**kwargs, "prompt": kwargs["prompt"][0], "generator": torch.Generator("cpu").manual_seed(settings.seed + indices[0])}

    def build_pipeline(self, transformer):
        import diffusers as d

        from ..zoo import tiny_tokenizer

        return d.WanVACEPipeline(tiny_tokenizer(), tiny_text_encoder(), tiny_vae(), d.FlowMatchEulerDiscreteScheduler(shift=3.0),
                                 transformer)


# Released VACE transformers: Wan2.1 configs with control blocks after `vace_layers` and 96 control channels
# (inactive and reactive latents, 16 each, and the 8x8-unshuffled mask, 64).
CONTROL_CHANNELS = 96


FAMILY = Vace(
    "vace", ("WanVACETransformer3DModel",), MHLAWanAttnProcessor,
    # diffusers' test sizes on Wan's tiny transformer; 96 control channels, as the tiny VAE's 8x mask unshuffle needs
    tiny={**WAN.tiny, "num_layers": 4, "vace_layers": [0, 2], "vace_in_channels": CONTROL_CHANNELS},
    real={"wan2.1-vace-1.3b": _real(12, 8960, 30, "480p", vace_layers=list(range(0, 30, 2)),
                                    vace_in_channels=CONTROL_CHANNELS),
          "wan2.1-vace-14b": _real(40, 13824, 40, "720p", vace_layers=list(range(0, 40, 5)),
                                   vace_in_channels=CONTROL_CHANNELS)},
    defaults=WAN.defaults,
    default_latent=WAN.default_latent, default_size_name=WAN.default_size_name,  # WanVACEPipeline's 480p x 81
    video=True,
    no_context_parallel="diffusers 0.42.1 gives WanVACETransformer3DModel no _cp_plan; run it on one GPU",
)
