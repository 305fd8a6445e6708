"""Recipe configuration: a YAML file of flat keys plus `--key value` overrides.

Flat keys keep command-line overrides one-to-one with the file. Unknown keys are errors that
name the key (a typo must never silently fall back to a default), and values are coerced to
the field's type so that `--learning_rate 1e-4` and YAML's `1e-4` (a string in YAML 1.1) work.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

TRAIN_MODES = ("full", "mhla", "lora")
OBJECTIVES = ("auto", "ddpm", "flow")
DATA_TYPES = ("auto", "images", "videos", "latents")
PRECISIONS = ("no", "fp16", "bf16")


@dataclass
class TrainConfig:
    # model
    pretrained: str = ""  # local diffusers dir or hub id of the *unconverted* pipeline
    family: str = ""  # optional guard: a family name of mhla_diffusion.families ("dit", "wan", ...); must match the model
    component: str = "transformer"  # the pipeline's transformer to train ("transformer_2": Wan2.2 A14B's low-noise expert; an expert trains on its own noise levels)
    # conversion (MHLAConfig fields); blocks "auto" is resolved from the training resolution
    mhla_blocks: str = "auto"  # block grid "bt,bh,bw" (or "bh,bw"), or "auto"
    mhla_layers: str = "all"  # "all", "hybrid:3", or "0,1,5"
    mhla_options: dict = field(default_factory=dict)  # other MHLAConfig fields over the family default
    # what trains
    train_mode: str = "full"  # full | mhla (MHLA params [+ q/k/v/out]) | lora (+ MHLA params)
    train_qkv: bool = False  # mhla mode: also train self-attention to_q/to_k/to_v/to_out.0
    lora_rank: int = 16  # rank of the LoRA adapters on the self-attention projections
    lora_alpha: float = 16.0  # LoRA scale numerator (scale = alpha / rank)
    # objective
    objective: str = "auto"  # auto: ddpm for dit/pixart, flow for sana/wan
    flow_shift: float = 3.0  # flow matching: timestep shift (Wan and SANA use 3)
    logit_mean: float = 0.0  # flow matching: mean of the logit-normal timestep density
    logit_std: float = 1.0  # flow matching: std of the logit-normal timestep density
    uncond_prob: float = 0.1  # fraction of samples given guidance's unconditional input (DiT: null class; text: empty prompt), teacher and student alike; 0.1 is DiT's own label dropout; 0: off
    # distillation from the unconverted model (weights of the loss terms; 0 = off)
    distill_output: float = 0.0  # the student's prediction against the teacher's at the same input
    distill_layers: float = 0.0  # each converted layer's output against the teacher's softmax layer
    distill_guidance_scale: float = 1.0  # s > 1: distill_output's target is the teacher guided, uncond + s (cond - uncond) (one more teacher forward); the student then samples at guidance 1
    # data
    data_dir: str = ""  # image or video folder with captions, or a latent cache (recipes/precompute.py)
    data_type: str = "auto"  # auto | images | videos | latents
    resolution: list = field(default_factory=lambda: [256, 256])  # pixels (h, w); one int = square
    num_frames: int = 81  # video families: frames per clip (1 + a multiple of the VAE's temporal factor)
    max_sequence_length: int = 0  # 0: the pipeline's default
    num_workers: int = 2  # data loader processes
    max_unreadable: float = 0.1  # unreadable files are skipped, each counted once; more than this fraction stops the run
    # optimization
    train_batch_size: int = 1  # samples per process and micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = 1000  # optimizer steps
    learning_rate: float = 1e-4  # AdamW learning rate
    mhla_learning_rate: float = 0.0  # the MHLA parameters' own rate; 0: M x learning_rate per layer (M blocks: the paper's step on Mc itself)
    lr_scheduler: str = "constant_with_warmup"  # a diffusers.optimization scheduler name
    lr_warmup_steps: int = 0  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.999  # AdamW beta2
    adam_epsilon: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradient clipping norm (0: off)
    mixed_precision: str = "no"  # no | fp16 | bf16 (weights of the frozen parts and autocast)
    gradient_checkpointing: bool = False  # recompute activations in the backward (less memory)
    allow_tf32: bool = True  # TF32 matmuls on Ampere and later GPUs
    ema_decay: float = 0.0  # 0 = no EMA
    seed: int = 0  # every random draw of step k derives from (seed, k, micro-batch, rank)
    context_parallel: int = 0  # >1: split each sample's tokens over this many processes (all of them); 0 = off
    # checkpoints, logs, samples
    output_dir: str = "outputs/run"  # checkpoints/, logs/ (tensorboard), samples/, final/
    checkpointing_steps: int = 500  # save a resumable checkpoint every this many steps
    checkpoints_total_limit: int = 3  # keep at most this many checkpoints (0: all)
    resume: str = ""  # "", "latest", or a checkpoint dir
    overwrite_output_dir: bool = False  # delete a previous run in output_dir (checkpoints, final, logs, samples) first
    log_every: int = 1  # log losses every this many steps
    validation_steps: int = 0  # 0 = no periodic samples
    validation_prompts: list = field(default_factory=list)  # text families
    validation_classes: list = field(default_factory=list)  # class-conditional (DiT)
    validation_inference_steps: int = 25  # denoising steps of the validation samples
    validation_guidance_scale: float = 4.0  # classifier-free guidance of the validation samples

    def __post_init__(self):
        res = self.resolution if isinstance(self.resolution, (list, tuple)) else [self.resolution]
        res = [int(r) for r in res]
        self.resolution = res * 2 if len(res) == 1 else res
        checks = [("train_mode", TRAIN_MODES), ("objective", OBJECTIVES), ("data_type", DATA_TYPES), ("mixed_precision", PRECISIONS)]
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if len(self.resolution) != 2:
            raise ValueError(f"resolution must be one int or [height, width], got {self.resolution}")
        if not self.pretrained:
            raise ValueError("pretrained is required: a local diffusers dir or a hub id")
        if self.train_qkv and self.train_mode != "mhla":
            raise ValueError("train_qkv applies to train_mode 'mhla' only")
        for name in ("train_batch_size", "gradient_accumulation_steps", "max_steps", "checkpointing_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.uncond_prob <= 1:
            raise ValueError(f"uncond_prob is the fraction of samples trained unconditional: give a value in [0, 1], got {self.uncond_prob}")
        if self.distill_guidance_scale < 1:
            raise ValueError(f"distill_guidance_scale must be >= 1 (1: the teacher's unguided prediction), got {self.distill_guidance_scale}")
        if self.distill_guidance_scale != 1 and not self.distill_output:
            raise ValueError("distill_guidance_scale guides distill_output's target: set distill_output > 0, or distill_guidance_scale 1")
        if self.distill_guidance_scale != 1 and self.validation_steps and self.validation_guidance_scale != 1:
            raise ValueError(f"a student distilled from the guided teacher (distill_guidance_scale {self.distill_guidance_scale}) "
                             "samples at guidance 1: set validation_guidance_scale 1")
        if self.context_parallel < 0:
            raise ValueError(f"context_parallel must be >= 0 (0 = off), got {self.context_parallel}")
        if self.resume and self.overwrite_output_dir:
            raise ValueError("resume continues the run in output_dir and overwrite_output_dir deletes it: give one of them")


def check_family(config: TrainConfig, family, source) -> None:
    """The optional `family` guard: the model at `source` must be of that family."""
    if config.family and config.family != family.name:
        raise ValueError(f"config family {config.family!r} does not match {source}, which holds a {family.name} model")


def config_reference() -> str:
    """Every config key with its type, default and description, read off TrainConfig's own source
    (its section comments and each field's trailing comment), so it is written once."""
    import inspect

    found = {f.name: f for f in fields(TrainConfig)}
    lines = []
    for line in inspect.getsource(TrainConfig).splitlines()[2:]:
        text = line.strip()
        if text.startswith("def "):
            break
        if text.startswith("# "):
            lines.append(f"\n{text[2:]}:")
            continue
        code, _, comment = text.partition("  # ")
        name = code.split(":")[0]
        if name in found:
            f = found[name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            lines.append(f"  --{name} ({f.type}, default {default!r}): {comment or '-'}")
    return "\n".join(lines).strip()


def _coerce(name: str, kind, value):
    """`value` (from YAML or the command line) as the field's type."""
    origin = typing.get_origin(kind) or kind
    try:
        if origin in (list, dict) and isinstance(value, str):
            value = yaml.safe_load(value)
        if origin is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if origin is list:
            return list(value) if isinstance(value, (list, tuple)) else [value]
        if origin is dict:
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
        if origin is str:
            return "" if value is None else str(value)
        return origin(value)
    except (TypeError, ValueError, yaml.YAMLError):
        raise ValueError(f"config key {name!r}: cannot read {value!r} as {getattr(origin, '__name__', origin)}") from None


def _field_types() -> dict:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in fields(TrainConfig)}


def _check_known(keys, where: str) -> None:
    known = _field_types()
    unknown = [k for k in keys if k not in known]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, 1)) else "") for k in unknown]
        raise ValueError(f"unknown config key(s) in {where}: {', '.join(hints)}")


def parse_overrides(argv: list[str]) -> dict:
    """['--key', 'value', '--flag=value', '--bool_key', ...] -> {key: raw value}; a bool key
    without a value (`--overwrite_output_dir`) means true."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected --key value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            elif _field_types().get(key) is bool:
                value = "true"
            else:
                raise ValueError(f"--{key} needs a value")
        out[key] = value
        i += 1
    return out


def config_paths(path) -> list[Path]:
    """One YAML path, several (later ones override earlier ones' keys: a family's config with an overlay
    such as configs/teacher_only.yaml on top), or none."""
    return [] if not path else [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]


def config_source(path) -> str:
    """Where a run's keys came from, for messages."""
    return " + ".join(map(str, config_paths(path))) or "the recipe defaults"


def load_config(path=None, overrides: dict | None = None) -> TrainConfig:
    """TrainConfig from YAML files (optional, `config_paths`) with `overrides` on top; errors name bad keys."""
    raw = {}
    for path in config_paths(path):
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            layer = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            raise ValueError(f"{path} is not valid YAML: {getattr(err, 'problem', err)}"
                             + (f" (line {where.line + 1}, column {where.column + 1})" if where else "")) from None
        if not isinstance(layer, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
        _check_known(layer, str(path))
        raw.update(layer)
    overrides = overrides or {}
    _check_known(overrides, "command line")
    kinds = _field_types()
    values = {k: _coerce(k, kinds[k], v) for k, v in {**raw, **overrides}.items()}
    return TrainConfig(**values)


def to_dict(config: TrainConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def save_config(config: TrainConfig, path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


# Keys that must agree between a run and the checkpoint it resumes (anything else, such as
# max_steps or logging, may change on resume).
RESUME_KEYS = ("pretrained", "component", "mhla_blocks", "mhla_layers", "mhla_options", "train_mode", "train_qkv",
               "lora_rank", "lora_alpha", "objective", "uncond_prob", "distill_output", "distill_layers",
               "distill_guidance_scale", "ema_decay",
               "train_batch_size", "gradient_accumulation_steps", "data_dir", "resolution", "num_frames")


# What a checkpoint written before a resume-relevant key existed trained with (its train_config.yaml lacks the key).
BEFORE_KEY_EXISTED = {"uncond_prob": 0.0, "distill_guidance_scale": 1.0}


def resume_mismatch(config: TrainConfig, saved: dict) -> list[str]:
    """'key: saved -> now' for each resume-relevant key that differs (a key the checkpoint predates counts as the
    value it trained with: resume it with `--key value`)."""
    now = to_dict(config)
    was = {k: saved.get(k, BEFORE_KEY_EXISTED.get(k)) for k in RESUME_KEYS}
    return [f"{k}: {was[k]!r} -> {now[k]!r}" for k in RESUME_KEYS if was[k] != now[k]]


__all__ = ["TrainConfig", "load_config", "parse_overrides", "save_config", "resume_mismatch", "to_dict"]
