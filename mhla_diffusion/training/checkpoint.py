"""Checkpoints for resuming: `accelerator.save_state` plus where the data loader stood.

`output_dir/checkpoints/checkpoint-<step>/` holds accelerate's state (model, optimizer, LR
scheduler, EMA, RNG states) and `progress.json` (step, epoch, batches consumed in that epoch)
plus the recipe config it was written under. A resumed run checks that config before any
training starts and skips the consumed batches with `accelerator.skip_first_batches`.

A checkpoint (and final/) is written under a `.partial` name and renamed once whole, so a save
cut short (Ctrl-C, a lost node) is never taken for a finished one; older checkpoints are removed
only after the new one is in place, and renamed to `.removing` before they are deleted. A fresh
run refuses an output_dir that holds a previous run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import yaml

from .train_config import resume_mismatch, to_dict

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
PARTIAL, REMOVING = ".partial", ".removing"  # being written, being deleted: never a checkpoint
RUN_OUTPUTS = ("checkpoints", "final", "logs", "samples", "train_config.yaml")  # what a run writes in output_dir


def checkpoints_dir(config) -> Path:
    return Path(config.output_dir) / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (renamed from .partial, with progress.json), oldest first."""
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit()
             and (d / "progress.json").is_file()]
    return sorted(found, key=lambda d: int(d.name[len(PREFIX):]))


def find_resume(config) -> Path | None:
    """The checkpoint to resume from, validated against `config`; None for a fresh run, which is
    refused where it would overwrite a previous run (unless overwrite_output_dir)."""
    path = None
    if config.resume == "latest":
        found = list_checkpoints(checkpoints_dir(config))
        if found:
            path = found[-1]
        else:
            log.info("resume=latest: no checkpoint in %s, starting fresh", checkpoints_dir(config))
    elif config.resume:
        path = Path(config.resume)
        if not (path / "progress.json").is_file():
            raise FileNotFoundError(f"resume dir {path} is not a complete checkpoint (no progress.json)")
    if path is None:
        check_fresh(config)
        return None
    saved = yaml.safe_load((path / "train_config.yaml").read_text())
    diff = resume_mismatch(config, saved)
    if diff:
        raise ValueError(f"checkpoint {path} was written by a different recipe; differing keys: {'; '.join(diff)} "
                         "(to resume it, give the checkpoint's values: --key value)")
    return path


def check_fresh(config) -> None:
    """A fresh run must not overwrite another run's checkpoints or final model."""
    out = Path(config.output_dir)
    n = len(list_checkpoints(checkpoints_dir(config)))
    held = ([f"{n} checkpoint(s)"] if n else []) + (["final/"] if (out / "final").exists() else [])
    if held and not config.overwrite_output_dir:
        raise ValueError(f"output_dir {out} holds a previous run ({', '.join(held)}): continue it with --resume latest, "
                         "or pass --overwrite_output_dir to delete it and start over")


def clear_output_dir(config) -> None:
    """With overwrite_output_dir, remove what a previous run wrote (its logs too: no merged runs)."""
    if not config.overwrite_output_dir:
        return
    for name in RUN_OUTPUTS:
        path = Path(config.output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def partial(path: Path) -> Path:
    """Where `path` is written until it is complete."""
    return path.with_name(path.name + PARTIAL)


def publish(path: Path) -> None:
    """Move the finished `partial(path)` to `path`, replacing what was there."""
    if path.exists():
        discard(path)
    os.replace(partial(path), path)


def discard(path: Path) -> None:
    """Delete the directory `path`, renamed first: a deletion cut short leaves no half copy under its name."""
    gone = path.with_name(path.name + REMOVING)
    if gone.exists():
        shutil.rmtree(gone)
    os.replace(path, gone)
    shutil.rmtree(gone)


def read_progress(path: Path) -> dict:
    return json.loads((path / "progress.json").read_text())


def save_checkpoint(accelerator, config, step: int, steps_per_epoch: int) -> Path:
    """Save state for `step`, keeping at most `checkpoints_total_limit` checkpoints."""
    root = checkpoints_dir(config)
    path = root / f"{PREFIX}{step}"
    if accelerator.is_main_process and root.is_dir():
        for stale in [*root.glob(f"*{PARTIAL}"), *root.glob(f"*{REMOVING}")]:  # saves and deletions cut short
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial(path)))  # collective: every rank takes part
    if accelerator.is_main_process:
        progress = {"step": step, "epoch": step // steps_per_epoch,
                    "batches_in_epoch": (step % steps_per_epoch) * config.gradient_accumulation_steps}
        (partial(path) / "train_config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        (partial(path) / "progress.json").write_text(json.dumps(progress))
        publish(path)
        if config.checkpoints_total_limit > 0:
            for old in list_checkpoints(root)[: -config.checkpoints_total_limit]:
                discard(old)
    accelerator.wait_for_everyone()
    return path
