"""recipes/train.py with `context_parallel 2`: two CPU processes (gloo) that split a tiny Wan's
27 latent tokens train the same weights, with the same losses, as one process without it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mhla_diffusion import zoo
from mhla_diffusion.training import conditioning

from test_recipes import launch, noise_image, scalars, transformer_weights, write_metadata

FRAMES, SIZE = 9, 48  # latent (3 frames, 6 x 6) in (1, 2, 2) patches: 27 tokens, odd


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A tiny Wan pipeline dir and two 9-frame clips."""
    root = tmp_path_factory.mktemp("cp")
    pipe = zoo.build_pipeline("wan")
    pipe.save_pretrained(root / "wan")
    latent = conditioning.latent_shape(pipe.vae, [SIZE, SIZE], FRAMES, True)
    tokens = math.prod(latent[1:]) // math.prod(pipe.transformer.config.patch_size)
    assert tokens % 2 == 1
    rng = np.random.default_rng(0)
    clips = root / "clips"
    for i in range(2):
        (clips / f"clip{i}").mkdir(parents=True)
        for f in range(FRAMES):
            noise_image(rng, (SIZE, SIZE)).save(clips / f"clip{i}" / f"{f:03d}.png")
    write_metadata(clips, [(f"clip{i}", ["a cat", "a red dog"][i]) for i in range(2)])
    return root


def args(wan, out):
    # Adam's epsilon 1 keeps each update proportional to its gradient: with the default 1e-8 a
    # parameter whose true gradient is ~0 (cross-attention over a tiny text encoder) moves by
    # lr * sign(rounding noise), and the weights would not be comparable.
    return ["--pretrained", wan / "wan", "--data_dir", wan / "clips", "--resolution", SIZE, "--num_frames", FRAMES,
            "--mhla_blocks", "2,2,2", "--train_batch_size", "1", "--learning_rate", "1",
            "--adam_epsilon", "1", "--ema_decay", "0.5", "--distill_output", "0.5", "--num_workers", "0",
            "--log_every", "1", "--output_dir", out]


def test_two_process_context_parallel_matches_one_process(wan):
    """Full fine-tuning with EMA and output distillation, 3 steps over an epoch boundary: the same
    batches, noise and timesteps on both ranks, and rank-summed gradients, give one process's run,
    also when the two-process run stops after step 1 (mid-epoch) and resumes."""
    one, two = wan / "one", wan / "two"
    launch("train.py", *args(wan, one), "--max_steps", "3")
    cp = [*args(wan, two), "--context_parallel", "2", "--checkpointing_steps", "1"]
    launch("train.py", *cp, "--max_steps", "1", processes=2)
    out = launch("train.py", *cp, "--max_steps", "3", "--resume", "latest", processes=2)
    assert "resumed from" in out and "skipping 1 batches" in out
    for tag in ("loss", "diffusion", "distill_output"):
        assert len(scalars(one, tag)) == 3
        assert scalars(two, tag) == pytest.approx(scalars(one, tag), rel=1e-5), tag
    before, a, b = transformer_weights(wan / "wan"), transformer_weights(one / "final"), transformer_weights(two / "final")
    assert a.keys() == b.keys() and before.keys() <= a.keys()
    assert all(not torch.equal(a[k], before[k]) for k in before)  # every weight trained
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_context_parallel_refuses_sana(tmp_path):
    """SANA's Mix-FFN convolves over the image grid, which a token split cuts: refused on both ranks."""
    zoo.build_pipeline("sana").save_pretrained(tmp_path / "sana")
    images = tmp_path / "images"
    images.mkdir()
    for i in range(2):
        noise_image(np.random.default_rng(i), (32, 32)).save(images / f"{i}.png")
    write_metadata(images, [("0.png", "a cat"), ("1.png", "a dog")])
    out = launch("train.py", "--pretrained", tmp_path / "sana", "--data_dir", images, "--resolution", "32",
                 "--num_workers", "0", "--output_dir", tmp_path / "out", "--context_parallel", "2", processes=2, ok=False,
                 env={"MHLA_DEBUG": "1"})  # every rank's traceback: without it only rank 0 prints the error
    assert out.count("no context-parallel plan for SanaTransformer2DModel") >= 2, out[-3000:]
