"""Models without downloads: tiny random-weight pipelines (demo, tests) and real-size
transformers with random weights (speed and memory measurements).

The configs live in the family modules (`families/`): tiny ones as diffusers' own tests size
them, real ones as the published checkpoints' configs.
"""

from __future__ import annotations

import torch

from .families import FAMILIES as _FAMILIES
from .families import real_model, tiny_names, tiny_variant

FAMILIES = tuple(f.name for f in _FAMILIES)
VARIANTS = tuple(n for n in tiny_names() if n not in FAMILIES)  # named tiny members (families/*.py `variants`)

WORDS = "a an the of and with on in photo painting cat dog red blue green small large tree house sky".split()


def build_transformer(name: str, seed: int = 0, device=None, dtype=None, resolution=None, **overrides):
    """A transformer with random weights: a family or variant name gives its tiny config, a real
    model name (`families.real_model_names()`) the published one (with `resolution`, the one published for it:
    `RealModel.checkpoints`).

    `device` builds the weights there directly (a 14B model initialised on the CPU takes minutes).
    """
    import diffusers

    if name in FAMILIES or name in VARIANTS:
        family, variant = tiny_variant(name)
        config = {**family.tiny, **variant.config}
    else:
        family, real = real_model(name)
        config = real.config if resolution is None else real.config_at(resolution)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = getattr(diffusers, family.class_names[0])(**{**config, **overrides})
    return (model if dtype is None else model.to(dtype=dtype)).eval()


def tiny_tokenizer():
    """A word-level fast tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def build_pipeline(name: str, seed: int = 0):
    """A complete tiny pipeline of a family or variant with random weights, built offline in about a second."""
    family, variant = tiny_variant(name)
    transformer = build_transformer(name, seed)
    torch.manual_seed(seed)
    return family.build_pipeline(transformer, **variant.pipeline)
