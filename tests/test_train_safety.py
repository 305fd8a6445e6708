"""recipes/train.py never loses or silently corrupts a run, under `accelerate launch` on the CPU:
an unreadable file is counted once however many epochs meet it."""

from __future__ import annotations

import numpy as np
import pytest
from test_recipes import launch, noise_image, scalars

from mhla_diffusion import zoo


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny DiT pipeline and 2 classes x 5 images, one of them corrupt (10%, the default limit)."""
    root = tmp_path_factory.mktemp("safety")
    zoo.build_pipeline("dit").save_pretrained(root / "dit")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / "data" / c).mkdir(parents=True)
        for i in range(5):
            noise_image(rng, (10, 10)).save(root / "data" / c / f"{i}.png")
    (root / "data" / "dog" / "4.png").write_bytes(b"not an image")
    return root


def args(work, out, *more):
    return ["--pretrained", work / "dit", "--data_dir", work / "data", "--resolution", "8", "--train_batch_size", "5",
            "--num_workers", "0", "--output_dir", out, *more]


def test_unreadable_file_is_counted_once_over_epochs(work):
    out = work / "epochs"
    log = launch("train.py", *args(work, out, "--max_steps", "6", "--checkpointing_steps", "6"))
    skipped = scalars(out, "data/skipped_files")  # 2 steps an epoch: 3 epochs meet the corrupt file
    assert len(skipped) == 6 and skipped[-1] == max(skipped) == 1, log
    assert f"skipped 1 unreadable file(s): {work / 'data' / 'dog' / '4.png'}" in log
