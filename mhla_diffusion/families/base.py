"""What a model family is to MHLA: one `Family` per module of this package.

A family module holds everything that differs between diffusers model families: where the
self-attention lives, the processor, the released MHLA variant's defaults, how the token grid
comes from the inputs, the context-parallel plan, tiny (offline) and real configs, the
transformer's training/benchmark inputs and the pipeline's sampling arguments. The rest of the
library asks the family (`families.family_of(transformer)`) and never branches on its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The sizes `bench model --resolution` names for video: (height, width) in pixels; "HxW" names any other.
VIDEO_SIZES = {"480p": (480, 832), "720p": (720, 1280)}


def pixel_size(resolution: str) -> tuple[int, int]:
    """(height, width) of a VIDEO_SIZES name, an "HxW" string ("704x1280") or one number (square)."""
    if resolution in VIDEO_SIZES:
        return VIDEO_SIZES[resolution]
    h, _, w = str(resolution).partition("x")
    return int(h), int(w or h)


@dataclass(frozen=True)
class RealModel:
    """A published checkpoint's transformer config, built with random weights for speed and memory runs."""

    config: dict
    latent_channels: int
    vae_factor: int  # spatial VAE downsampling
    resolution: str  # the size it runs at: pixels, or a VIDEO_SIZES name
    text_tokens: int = 0  # prompt tokens its text encoder gives the transformer (0: class-conditional)
    temporal_factor: int | None = None  # temporal VAE downsampling (video); None for images
    frames: int = 81  # the video length it runs at (`bench model --frames` default)
    # config changes of the checkpoint published for a resolution (pixels): the transformer a user runs there. DiT-XL/2
    # 512 px is facebook/DiT-XL-2-512 (sample_size 64), not the 256 px one run at 512: its positions and MHLA's mixing
    # logits are then defined at the grid it runs, as after converting that checkpoint
    checkpoints: dict = field(default_factory=dict)

    def latent_shape(self, resolution: str, frames: int) -> tuple:
        """(C, H, W) or (C, F, H, W) of the latent at `resolution` (pixels, "HxW" or a VIDEO_SIZES name)."""
        h, w = pixel_size(resolution)
        f = self.vae_factor
        if h % f or w % f:
            raise ValueError(f"resolution {resolution} is not a multiple of the VAE factor {f}")
        if self.temporal_factor is None:
            return (self.latent_channels, h // f, w // f)
        if (frames - 1) % self.temporal_factor:
            raise ValueError(f"--frames must be {self.temporal_factor}k+1 for this video model (e.g. 81), got {frames}")
        return (self.latent_channels, (frames - 1) // self.temporal_factor + 1, h // f, w // f)

    def checkpoint(self, resolution: str) -> dict:
        """The config changes of the checkpoint published for `resolution` (none where none is listed)."""
        return self.checkpoints.get(str(resolution), {})

    def config_at(self, resolution: str) -> dict:
        """The config of the checkpoint published for `resolution`, the base config where none is listed."""
        return {**self.config, **self.checkpoint(resolution)}


@dataclass(frozen=True)
class Variant:
    """A named tiny member of a family (`zoo.build_transformer(name)`, `zoo.build_pipeline(name)`)."""

    config: dict = field(default_factory=dict)  # overrides of the family's tiny config
    pipeline: dict = field(default_factory=dict)  # keyword arguments of the family's `build_pipeline`


@dataclass(frozen=True)
class Family:
    name: str
    class_names: tuple[str, ...]  # the diffusers transformer classes of the family
    processor: type  # the MHLA processor of its self-attention layers
    tiny: dict  # a tiny transformer config (diffusers' own tests' sizes), built offline in tests and the demo
    real: dict[str, RealModel] = field(default_factory=dict)  # `bench model` names -> published configs
    variants: dict[str, Variant] = field(default_factory=dict)  # tiny members by name (e.g. "wan2.2-ti2v")
    block_list: str = "transformer_blocks"  # attribute holding the blocks; self-attention is `<block>.attn1`
    defaults: dict = field(default_factory=dict)  # MHLAConfig fields of the released variant
    # pipeline arguments to sample at the asked height/width (PixArt and SANA snap to aspect-ratio bins)
    any_size: dict = field(default_factory=dict)
    # the latent (frames, height, width) of the size the released models run at, for models whose config
    # declares none (Wan has no sample_size); image models use their config's sample_size
    default_latent: tuple[int, int, int] | None = None
    default_size_name: str = ""
    validation_kwargs: dict = field(default_factory=dict)  # extra pipeline arguments of training-time samples
    objective: str = "flow"  # training: "ddpm" (epsilon + learned variance at 2x channels) or "flow"
    text: bool = True  # conditioned on text embeddings (else on class labels at the trained size)
    video: bool = False
    # the context-parallel plan's (split before, gather after) modules, for models without diffusers' own
    # plan; None with the reason as `no_context_parallel`
    context_parallel: tuple[str, str] | None = None
    no_context_parallel: str = ""

    # --- the model ---
    def class_of(self, transformer) -> str:
        """The diffusers class a transformer is (an MHLA model class names the class it extends)."""
        return next(c.__name__ for c in type(transformer).__mro__ if c.__name__ in self.class_names)

    def self_attentions(self, transformer) -> list:
        """The self-attention modules MHLA converts, in layer order."""
        return [block.attn1 for block in getattr(transformer, self.block_list)]

    def self_attention_paths(self, config: dict) -> list[str]:
        """Module paths of `self_attentions` from a config.json alone (`info` checks dirs without building)."""
        return [f"{self.block_list}.{i}.attn1" for i in range(config["num_layers"])]

    def token_grid(self, transformer, hidden_states) -> tuple[int, int, int]:
        """Post-patch (T, H, W) grid of a transformer input (B, C, H, W) or (B, C, F, H, W)."""
        spatial = tuple(hidden_states.shape[2:])
        return patched(transformer.config.patch_size, spatial if len(spatial) == 3 else (1, *spatial))

    def default_grid(self, transformer) -> tuple[tuple[int, int, int], str]:
        """The token grid at the model's default size, and that size in words (for messages)."""
        patch = transformer.config.patch_size
        if self.default_latent is not None:
            return patched(patch, self.default_latent), self.default_size_name
        size = transformer.config.sample_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        return patched(patch, (1, *size)), f"its sample_size {size[0]} x {size[1]} latent"

    def rope_module(self, transformer):
        """The submodule that makes the model's RoPE tables (cos, sin) once a forward for all its layers (diffusers
        names it `rope`: Wan, its VACE and SkyReels-V2 kin, SANA-Video), or None."""
        return getattr(transformer, "rope", None)

    def cp_plan(self, transformer) -> dict:
        """Where diffusers' context parallelism splits the token sequence and gathers it back."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        if transformer._cp_plan is not None:
            return transformer._cp_plan
        if self.context_parallel is None:
            raise ValueError(f"no context-parallel plan for {self.class_of(transformer)}: {self.no_context_parallel}")
        split, gather = self.context_parallel
        return {split: {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
                gather: ContextParallelOutput(gather_dim=1, expected_dims=3)}

    # --- training and benchmarks ---
    def expert_sigmas(self, pipe, component: str) -> tuple[float, float] | None:
        """The flow sigmas `pipe`'s transformer `component` denoises, if the pipeline splits them between experts."""
        return None

    def transformer_inputs(self, transformer, latents, timestep, batch: dict) -> dict:
        """Keyword arguments of `transformer(...)` for one batch (`prompt_embeds` [+ `prompt_attention_mask`])."""
        return {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": batch["prompt_embeds"]}

    def text_width(self, config) -> int:
        """Width of the prompt embeddings the transformer takes."""
        return config.caption_channels or config.cross_attention_dim

    def example_inputs(self, transformer, latent: tuple, batch: int = 1, text_tokens: int = 5, generator=None) -> dict:
        """Random `transformer(...)` inputs at `latent` ((C, H, W), or (C, F, H, W) for video), on its device
        and in its dtype, timesteps spread over [10, 500]: speed runs (`bench model`) and tests."""
        device, dtype = transformer.device, transformer.dtype
        x = torch.randn(batch, *latent, generator=generator).to(device, dtype)
        t = torch.linspace(10, 500, batch).long().to(device)
        cond = self.example_conditioning(transformer, latent, batch, text_tokens, generator)
        return self.transformer_inputs(transformer, x, t, {k: v.to(device, dtype if v.is_floating_point() else v.dtype)
                                                           for k, v in cond.items()})

    def example_conditioning(self, transformer, latent: tuple, batch: int, text_tokens: int, generator=None) -> dict:
        """The random conditioning of `example_inputs` (on the CPU), as the batch dict `transformer_inputs` reads."""
        if self.text:
            return {"prompt_embeds": torch.randn(batch, text_tokens, self.text_width(transformer.config), generator=generator)}
        return {"class_label": torch.arange(1, 2 * batch, 2) % transformer.config.num_embeds_ada_norm}

    # --- classifier-free guidance ---
    def unconditional(self, transformer, encode) -> dict:
        """One sample's conditioning in the unconditional branch of the pipeline's classifier-free guidance, as
        the batch dict `transformer_inputs` reads; `encode(prompts)`: (embeddings, mask) as training encodes
        prompts. Text families: the empty prompt, the pipelines' default negative prompt."""
        embeds, mask = encode([""])
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def stop_conditioning_dropout(self, transformer) -> None:
        """Stop the model from dropping its conditioning inside its forward in train mode (the text families'
        diffusers models do not): the recipe chooses the unconditional samples itself, once per sample and the
        same for teacher and student."""

    # --- sampling ---
    def call_kwargs(self, pipe, indices: list[int], settings) -> dict:
        """The pipeline's conditioning and size arguments for samples `indices` (a SamplingSettings)."""
        if not settings.prompts:
            raise ValueError(f"{self.name} samples need prompts (a prompts file, one per line)")
        if settings.num_frames is not None and not self.video:
            raise ValueError(f"{self.name} makes images; frames apply to video models only")
        return {"prompt": [settings.prompts[i % len(settings.prompts)] for i in indices], **self.any_size,
                **self.size_kwargs(settings.height, settings.width, settings.num_frames)}

    def size_kwargs(self, height=None, width=None, frames=None) -> dict:
        """The pipeline's arguments for a sample size (those given)."""
        sizes = (("height", height), ("width", width), ("num_frames", frames if self.video else None))
        return {k: v for k, v in sizes if v is not None}

    def demo_kwargs(self) -> dict:
        """What the demo passes its tiny pipeline: a small size, a prompt its tiny text encoder reads."""
        return dict(prompt="a photo of a red cat", max_sequence_length=16, **self.size_kwargs(32, 32, 5), **self.any_size,
                    **self.validation_kwargs)

    def build_pipeline(self, transformer, **options):
        """A complete tiny pipeline around `transformer` (random-weight VAE, text encoder, scheduler);
        `options`: a variant's `pipeline` arguments."""
        raise NotImplementedError(f"{self.name} has no tiny pipeline")


def patched(patch, latent) -> tuple[int, int, int]:
    """(T, H, W) tokens of a latent (frames, height, width) under the model's patch size."""
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1, patch, patch)
    return tuple(s // p for s, p in zip(latent, patch))

