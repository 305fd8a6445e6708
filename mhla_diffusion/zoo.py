"""Model configs without downloads: tiny random-weight pipelines (demo, tests) and real-size
transformers with random weights (speed and memory measurements).

The tiny configs are the ones diffusers' own tests use; the real ones are the published
checkpoints' configs (DiT-XL/2, PixArt-Sigma, SANA-1.6B, Wan2.1-T2V 1.3B and 14B).
"""

from __future__ import annotations

import torch

FAMILIES = ("dit", "pixart", "sana", "wan")

TINY = {
    "dit": dict(in_channels=4, out_channels=8, activation_fn="gelu-approximate", num_attention_heads=2,
                attention_head_dim=4, attention_bias=True, num_layers=2, norm_type="ada_norm_zero",
                num_embeds_ada_norm=1000, patch_size=2, sample_size=8),  # DiTPipeline's null class is 1000
    "pixart": dict(sample_size=8, num_layers=2, patch_size=2, attention_head_dim=2, num_attention_heads=2,
                   in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
                   activation_fn="gelu-approximate", num_embeds_ada_norm=8, norm_type="ada_norm_single",
                   norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False, caption_channels=None),
    "sana": dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=4,
                 num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
                 cross_attention_dim=8, caption_channels=8, sample_size=8),
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                out_channels=16, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
}

REAL = {
    "dit-xl-2": ("dit", dict(in_channels=4, out_channels=8, num_attention_heads=16, attention_head_dim=72,
                             num_layers=28, activation_fn="gelu-approximate", attention_bias=True,
                             norm_type="ada_norm_zero", num_embeds_ada_norm=1000, patch_size=2, sample_size=32)),
    "pixart-sigma": ("pixart", dict(sample_size=128, num_layers=28, patch_size=2, attention_head_dim=72,
                                    num_attention_heads=16, in_channels=4, out_channels=8, cross_attention_dim=1152,
                                    caption_channels=4096, attention_bias=True, activation_fn="gelu-approximate",
                                    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False,
                                    norm_eps=1e-6, use_additional_conditions=False, interpolation_scale=2)),
    "sana-1.6b": ("sana", dict(patch_size=1, in_channels=32, out_channels=32, num_layers=20, attention_head_dim=32,
                               num_attention_heads=70, num_cross_attention_heads=20, cross_attention_head_dim=112,
                               cross_attention_dim=2240, caption_channels=2304, mlp_ratio=2.5, sample_size=32)),
    "wan2.1-1.3b": ("wan", dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)),
    "wan2.1-14b": ("wan", dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                               out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                               cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)),
}

CLASSES = {"dit": "DiTTransformer2DModel", "pixart": "PixArtTransformer2DModel",
           "sana": "SanaTransformer2DModel", "wan": "WanTransformer3DModel"}

WORDS = "a an the of and with on in photo painting cat dog red blue green small large tree house sky".split()


def _family(name: str) -> str:
    if name in TINY:
        return name
    if name in REAL:
        return REAL[name][0]
    raise ValueError(f"unknown model {name!r}; tiny: {', '.join(TINY)}; real: {', '.join(REAL)}")


def build_transformer(name: str, seed: int = 0, device=None, dtype=None, **overrides):
    """A transformer with random weights: a family name gives the tiny config, a REAL key the real one.

    `device` builds the weights there directly (a 14B model initialised on the CPU takes minutes).
    """
    import diffusers

    family = _family(name)
    config = {**(TINY[name] if name in TINY else REAL[name][1]), **overrides}
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = getattr(diffusers, CLASSES[family])(**config)
    return (model if dtype is None else model.to(dtype=dtype)).eval()


def tiny_tokenizer():
    """A word-level fast tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def _text_encoder(family: str):
    import transformers as tf

    vocab = len(WORDS) + 3
    if family == "pixart":
        return tf.T5EncoderModel(tf.T5Config(vocab_size=vocab, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    if family == "sana":
        return tf.Gemma2Model(tf.Gemma2Config(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=4))
    return tf.UMT5EncoderModel(tf.UMT5Config(vocab_size=vocab, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))


def build_pipeline(family: str, seed: int = 0):
    """A complete tiny pipeline of `family` with random weights, built offline in about a second."""
    import diffusers as d

    if family not in TINY:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(TINY)}")
    transformer = build_transformer(family, seed)
    torch.manual_seed(seed)
    if family == "dit":
        vae = d.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
        return d.DiTPipeline(transformer, vae, d.DDIMScheduler(), id2label={i: f"class {i}" for i in range(8)})
    if family == "wan":
        vae = d.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
        return d.WanPipeline(tiny_tokenizer(), _text_encoder(family).eval(), vae, d.FlowMatchEulerDiscreteScheduler(shift=3.0), transformer)
    if family == "sana":
        vae = d.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2,
                              encoder_block_types=("ResBlock", "EfficientViTBlock"),
                              decoder_block_types=("ResBlock", "EfficientViTBlock"),
                              encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                              encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
                              encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1],
                              downsample_block_type="conv", upsample_block_type="interpolate",
                              decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407)
        return d.SanaPipeline(tiny_tokenizer(), _text_encoder(family).eval(), vae, transformer, d.FlowMatchEulerDiscreteScheduler(shift=3.0))
    vae = d.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    return d.PixArtSigmaPipeline(tiny_tokenizer(), _text_encoder(family).eval(), vae, transformer, d.DDIMScheduler())
