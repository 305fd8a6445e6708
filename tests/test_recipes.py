"""The training recipes end to end, run as users run them: `accelerate launch` on the CPU.

Tiny random-weight pipelines (mhla_diffusion.zoo) and generated data with one corrupt file
each; a handful of optimizer steps per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import mhla_diffusion
from mhla_diffusion import zoo

REPO = Path(__file__).resolve().parents[1]


def launch_command(script: str, *args, processes: int = 1, launcher=(), env=None, precision="no") -> tuple[list, dict]:
    """(command, environment) of a recipe under `accelerate launch [launcher options]` on the CPU.

    accelerate's `--cpu` starts one process whatever `--num_processes` says; `--multi_gpu` with
    ACCELERATE_USE_CPU starts them through torchrun and they join a gloo group."""
    mode = "--cpu" if processes == 1 else "--multi_gpu"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(processes), "--num_machines", "1",
           mode, "--mixed_precision", precision, "--dynamo_backend", "no", str(REPO / "recipes" / script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return cmd, env


def launch(script: str, *args, processes: int = 1, ok: bool = True, launcher=(), env=None, precision="no") -> str:
    """Run a recipe under `accelerate launch` on the CPU; its output. `ok=False`: it must fail."""
    cmd, env = launch_command(script, *args, processes=processes, launcher=launcher, env=env, precision=precision)
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert (run.returncode == 0) == ok, f"{' '.join(cmd)}\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    return run.stdout + run.stderr


def scalars(output_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for events in sorted((output_dir / "logs").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return [values[k] for k in sorted(values)]


def images(output_dir: Path, tag: str) -> list[int]:
    """The steps at which tensorboard got an image under `tag`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = set()
    for events in sorted((output_dir / "logs").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["images"]:
            steps.update(e.step for e in acc.Images(tag))
    return sorted(steps)


def transformer_weights(pipeline_dir: Path) -> dict:
    return {k: v for f in sorted((pipeline_dir / "transformer").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def noise_image(rng, size) -> Image.Image:
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def write_metadata(root: Path, rows: list[tuple[str, str]]) -> None:
    (root / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": f, "text": t}) for f, t in rows))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Tiny pipelines saved as pretrained dirs, and a data folder per layout."""
    root = tmp_path_factory.mktemp("recipes")
    for family in ("dit", "pixart", "sana", "wan"):
        zoo.build_pipeline(family).save_pretrained(root / family)
    rng = np.random.default_rng(0)
    classes = root / "classes"
    for c in ("cat", "dog"):
        (classes / c).mkdir(parents=True)
        for i in range(3):
            noise_image(rng, (12, 10)).save(classes / c / f"{i}.png")
    (classes / "dog" / "broken.png").write_bytes(b"not an image")
    captions = root / "captions"
    captions.mkdir()
    for i in range(4):
        noise_image(rng, (40, 36)).save(captions / f"{i}.png")
    (captions / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    rows = [(f"{i}.png", ["a red cat", "the blue dog"][i % 2]) for i in range(4)]
    write_metadata(captions, rows + [("broken.jpg", "a tree")])
    clean = root / "captions_clean"  # the same pairs without the corrupt file
    clean.mkdir()
    for f, _ in rows:
        (clean / f).write_bytes((captions / f).read_bytes())
    write_metadata(clean, rows)
    videos = root / "videos"
    videos.mkdir()
    for i in range(3):
        (videos / f"clip{i}").mkdir()
        for f in range(5):
            noise_image(rng, (32, 40)).save(videos / f"clip{i}" / f"{f:03d}.png")
    import imageio.v3 as iio

    iio.imwrite(videos / "clip3.mp4", rng.integers(0, 255, (6, 32, 32, 3), dtype=np.uint8), plugin="pyav", codec="libx264", fps=8)
    (videos / "broken.mp4").write_bytes(b"\x00" * 64)
    write_metadata(videos, [(f"clip{i}", "a cat on a tree") for i in range(3)] + [("clip3.mp4", "a dog"), ("broken.mp4", "sky")])
    return root


COMMON = ["--num_workers", "0", "--log_every", "1", "--max_unreadable", "0.5"]  # one corrupt file in 5-7


def test_dit_full_ema_distill_resume_matches_uninterrupted(work):
    """DiT: DDPM+VLB, EMA, output and per-layer distillation, hybrid layers, accumulation.
    Stopping at a mid-epoch checkpoint and resuming gives the same weights as one run."""
    args = ["--pretrained", work / "dit", "--family", "dit", "--data_dir", work / "classes", "--resolution", "8",
            "--train_batch_size", "1", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--ema_decay", "0.9", "--distill_output", "0.5", "--distill_layers", "0.5", "--mhla_layers", "hybrid:2",
            "--checkpointing_steps", "2", "--validation_steps", "4", "--validation_classes", "[1, 2]",
            "--validation_inference_steps", "2", *COMMON]
    straight, split = work / "dit_straight", work / "dit_split"
    launch("train.py", *args, "--max_steps", "4", "--output_dir", straight)
    launch("train.py", *args, "--max_steps", "2", "--output_dir", split)
    out = launch("train.py", *args, "--max_steps", "4", "--output_dir", split, "--resume", "latest")
    assert "resumed from" in out and "skipping 4 batches" in out  # 7 batches/epoch -> 3 steps; step 2 is mid-epoch
    a, b = transformer_weights(straight / "final"), transformer_weights(split / "final")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = scalars(straight, "loss")
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert scalars(straight, "distill_layers") and scalars(straight, "data/skipped_files")[-1] >= 1
    assert len(scalars(straight, "mhla/mixing_change")) == 4 and scalars(straight, "mhla/mixing_entropy")
    assert (straight / "samples" / "step-0000004" / "00.png").is_file()
    grid = np.asarray(Image.open(straight / "samples" / "step-0000004" / "grid.png").convert("L"))
    assert grid.shape[0] > 2 * 96 and (grid[:, :30] < 128).any()  # two labelled rows (class 1, class 2)
    assert images(straight, "validation") == [4]
    assert len(list((straight / "checkpoints").iterdir())) == 2
    pipe = mhla_diffusion.from_pretrained(straight / "final")
    assert sorted(mhla_diffusion.conversion.mhla_modules(pipe.transformer)) == ["transformer_blocks.0.attn1.processor"]
    import diffusers

    plain = diffusers.DiffusionPipeline.from_pretrained(straight / "final")  # model_index.json names the MHLA class
    assert sorted(mhla_diffusion.conversion.mhla_modules(plain.transformer)) == ["transformer_blocks.0.attn1.processor"]


def test_sana_lora_on_two_processes_trains_only_lora_and_mixing(work):
    """SANA LoRA under DDP with 2 CPU processes: after merging, only self-attention projections
    and MHLA parameters differ from the original model."""
    out = work / "sana_lora"
    launch("train.py", "--pretrained", work / "sana", "--data_dir", work / "captions", "--resolution", "32",
           "--train_mode", "lora", "--lora_rank", "2", "--learning_rate", "1e-2", "--train_batch_size", "1",
           "--max_steps", "2", "--distill_layers", "1.0", "--validation_steps", "2", "--validation_prompts", '["a red cat"]',
           "--validation_inference_steps", "2", "--output_dir", out, *COMMON, processes=2)
    assert all(np.isfinite(scalars(out, "loss")))
    before, after = transformer_weights(work / "sana"), transformer_weights(out / "final")
    changed = {k for k in after if k not in before or not torch.equal(before[k], after[k])}
    assert changed and all(".processor." in k or (".attn1.to_" in k and ".weight" in k) for k in changed), sorted(changed)
    assert any(k.endswith(".mixing.logits") for k in changed) and any(".attn1.to_q.weight" in k for k in changed)
    assert (out / "samples" / "step-0000002" / "00.png").is_file()


def test_wan_mhla_mode_on_video_folder(work):
    """Wan: mhla mode trains only MHLA parameters, from frame folders and an mp4 (a corrupt mp4 is
    skipped), with gradient checkpointing and an mp4 validation sample."""
    out = work / "wan_mhla"
    launch("train.py", "--pretrained", work / "wan", "--data_dir", work / "videos", "--resolution", "[32, 32]",
           "--num_frames", "5", "--train_mode", "mhla", "--mhla_blocks", "1,2,2", "--learning_rate", "1e-2",
           "--train_batch_size", "2", "--max_steps", "3", "--gradient_checkpointing", "true", "--validation_steps", "3",
           "--validation_prompts", '["a cat"]', "--validation_inference_steps", "2", "--output_dir", out, *COMMON)
    assert all(np.isfinite(scalars(out, "loss")))
    before, after = transformer_weights(work / "wan"), transformer_weights(out / "final")
    changed = {k for k in after if k not in before or not torch.equal(before[k], after[k])}
    assert changed and all(".processor." in k for k in changed)
    assert (out / "samples" / "step-0000003" / "00.mp4").stat().st_size > 0


def test_pixart_precompute_then_cache_matches_raw_first_step(work):
    """PixArt: the first-step loss from a latent cache equals the loss from raw images."""
    common = ["--pretrained", work / "pixart", "--resolution", "8", "--train_batch_size", "2", "--max_steps", "1", *COMMON]
    launch("train.py", *common, "--data_dir", work / "captions_clean", "--output_dir", work / "pixart_raw")
    cache = work / "pixart_cache"
    out = launch("precompute.py", *common, "--data_dir", work / "captions_clean", "--out", cache)
    assert "wrote 4 samples" in out
    launch("train.py", *common, "--data_dir", cache, "--output_dir", work / "pixart_cached")
    raw, cached = scalars(work / "pixart_raw", "loss"), scalars(work / "pixart_cached", "loss")
    assert len(raw) == len(cached) == 1 and np.isfinite(raw[0])
    assert cached[0] == pytest.approx(raw[0], rel=1e-5)
