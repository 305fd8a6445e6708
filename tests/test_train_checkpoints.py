"""Checkpoint rotation cut short by Ctrl-C: no half-deleted checkpoint is listed as complete.

The moment (inside the deletion of an old checkpoint) cannot be hit from `accelerate launch`,
so the save runs in-process with a one-process stand-in for the Accelerator."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mhla_diffusion.training import checkpoint
from mhla_diffusion.training.train_config import load_config


class OneProcess:
    is_main_process = True

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"weights")


def test_interrupted_rotation_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    cfg = load_config(None, {"pretrained": "x", "output_dir": str(tmp_path), "checkpoints_total_limit": 2})
    for step in (1, 2):
        checkpoint.save_checkpoint(OneProcess(), cfg, step, steps_per_epoch=10)

    def cut_short(path, *args, **kwargs):  # deletes the first file, then Ctrl-C
        if Path(path).exists():
            sorted(Path(path).iterdir())[0].unlink()
            raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", cut_short)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(OneProcess(), cfg, 3, steps_per_epoch=10)
    monkeypatch.undo()
    listed = checkpoint.list_checkpoints(checkpoint.checkpoints_dir(cfg))
    assert listed and all((d / "model.safetensors").is_file() for d in listed), listed
    assert listed[-1].name == "checkpoint-3"
    checkpoint.save_checkpoint(OneProcess(), cfg, 4, steps_per_epoch=10)  # the next save clears the leftovers
    assert sorted(d.name for d in checkpoint.checkpoints_dir(cfg).iterdir()) == ["checkpoint-3", "checkpoint-4"]
