"""recipes/train.py never loses or silently corrupts a run, under `accelerate launch` on the CPU:
a used output_dir is refused, errors are one line, Ctrl-C leaves only whole checkpoints and says
how to resume, and an unreadable file is counted once however many epochs meet it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_recipes import REPO, launch, launch_command, noise_image, scalars
from test_safe_convert import sigint_as_at_a_terminal

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


def one_error_line(out: str, text: str) -> None:
    """The recipe says it once. (accelerate launch >= 1.16 without --quiet quotes the child's stderr in
    its own report, as "RuntimeError: train.py: error: ...": that line is the launcher's.)"""
    lines = [line for line in out.splitlines() if line.startswith("train.py: error:")]
    assert len(lines) == 1 and text in lines[0], out
    assert 'train.py", line' not in out, out  # no traceback of the recipe


def test_used_output_dir_is_refused_unless_resumed_or_overwritten(work):
    """Also: the corrupt file, met in each of the 3 epochs (2 steps each), is counted once."""
    out = work / "run"
    log = launch("train.py", *args(work, out, "--max_steps", "6", "--checkpointing_steps", "2"))
    skipped = scalars(out, "data/skipped_files")
    assert len(skipped) == 6 and skipped[-1] == max(skipped) == 1, log
    assert f"skipped 1 unreadable file(s): {work / 'data' / 'dog' / '4.png'}" in log
    refused = launch("train.py", *args(work, out, "--max_steps", "6"), ok=False, launcher=["--quiet"])
    one_error_line(refused, f"output_dir {out} holds a previous run (3 checkpoint(s), final/)")
    assert "Traceback" not in refused and "--resume latest" in refused and "--overwrite_output_dir" in refused
    resumed = launch("train.py", *args(work, out, "--max_steps", "8", "--checkpointing_steps", "2", "--resume", "latest"))
    assert "resumed from" in resumed and "at step 6" in resumed
    launch("train.py", *args(work, out, "--max_steps", "2", "--checkpointing_steps", "2", "--overwrite_output_dir"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert len(scalars(out, "loss")) == 2  # steps 1-2 of the new run only: the old run's logs are gone


def test_training_error_is_one_line(tmp_path):
    """(MHLA_DEBUG=1 under accelerate launch: test_recipes_context_parallel's SANA refusal.)"""
    missing = tmp_path / "missing.yaml"
    out = launch("train.py", "--config", missing, ok=False)
    one_error_line(out, f"config file {missing} does not exist")
    assert out.count("Traceback") == 1 and "CalledProcessError" in out  # accelerate's own report (no --quiet)


def test_messages_name_the_key_to_change(work, tmp_path):
    """Too little data names the keys that set one step's size; a launch flag the YAML contradicts is refused."""
    out = launch("train.py", *args(work, tmp_path / "big", "--train_batch_size", "50"), ok=False, launcher=["--quiet"])
    one_error_line(out, "fewer than one optimizer step consumes (train_batch_size 50 x gradient_accumulation_steps 1 x 1")
    assert "lower --train_batch_size or add data" in out
    config = tmp_path / "fp32.yaml"
    config.write_text("mixed_precision: 'no'\n")
    out = launch("train.py", "--config", config, *args(work, tmp_path / "bf16"), ok=False, launcher=["--quiet"],
                 precision="bf16")
    one_error_line(out, f"accelerate launch --mixed_precision bf16 disagrees with mixed_precision no from {config}")


def test_ctrl_c_leaves_whole_checkpoints_and_prints_the_resume_command(work):
    """SIGINT to the launched process group while it saves a checkpoint every step."""
    out = work / "interrupted"
    cmd, env = launch_command("train.py", *args(work, out, "--max_steps", "100000", "--checkpointing_steps", "1",
                                             "--checkpoints_total_limit", "2", "--log_every", "100"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=sigint_as_at_a_terminal)
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("checkpoint-*/progress.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    hints = [line for line in output.splitlines() if "interrupted; continue with:" in line]
    assert len(hints) == 1 and hints[0].endswith("--resume latest") and "accelerate launch" in hints[0], output
    assert 'train.py", line' not in output, output
    checkpoints = [d for d in (out / "checkpoints").iterdir() if re.fullmatch(r"checkpoint-\d+", d.name)]
    assert checkpoints and all((d / "progress.json").is_file() for d in checkpoints)
    assert not (out / "final").exists()
    latest = max(int(d.name.split("-")[1]) for d in checkpoints)
    resumed = launch("train.py", *args(work, out, "--max_steps", latest + 1, "--resume", "latest"))
    assert f"at step {latest}" in resumed and (out / "final" / "model_index.json").is_file()


# A recipe whose step is stopped by `signals` sent to itself: what a scheduler's `kill` (SIGTERM), or
# accelerate launch >= 1.16 answering Ctrl-C (SIGINT to the group, then SIGTERM to its child while
# the child is still unwinding), does to a run.
SIGNALLED_RECIPE = """
import os, signal, sys, time
from mhla_diffusion.training.launch import run_recipe

def main(argv):
    first, *later = [getattr(signal, name) for name in sys.argv[1].split(",")]
    try:
        os.kill(os.getpid(), first)
        time.sleep(5)
    finally:  # the unwinding a training step does (a save's cleanup, dataloader workers)
        for sig in later:
            os.kill(os.getpid(), sig)
        time.sleep(0.2)
    print("NOT INTERRUPTED")

sys.argv[0] = "recipes/train.py"
sys.exit(run_recipe(main, resumable=True, argv=["--max_steps", "9"]))
"""


@pytest.mark.parametrize("signals", ["SIGTERM", "SIGINT,SIGTERM", "SIGTERM,SIGTERM"])
def test_terminate_ends_a_recipe_as_ctrl_c_does(signals):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-c", SIGNALLED_RECIPE, signals], env=env, capture_output=True, text=True,
                         timeout=60, preexec_fn=sigint_as_at_a_terminal)
    assert run.returncode == 130, (run.returncode, run.stderr)
    assert run.stdout == ("train.py: interrupted; continue with: accelerate launch recipes/train.py --max_steps 9 "
                          "--resume latest\n") and run.stderr == ""


def test_recipe_exit_statuses_and_resume_command(capsys, monkeypatch):
    """run_recipe, what `python recipes/train.py` ends through: 2 and 130 with one line each, the
    resume command without --resume or --overwrite_output_dir, and --debug re-raising."""
    from mhla_diffusion.training.launch import run_recipe

    def interrupted(argv):
        raise KeyboardInterrupt

    def bad(argv):
        raise ValueError(f"bad input {argv}")

    monkeypatch.setattr("sys.argv", ["recipes/train.py"])
    argv = ["--config", "my run.yaml", "--overwrite_output_dir", "--max_steps", "9", "--resume=x", "--overwrite_output_dir", "true"]
    assert run_recipe(interrupted, resumable=True, argv=argv) == 130
    assert capsys.readouterr().out == ("train.py: interrupted; continue with: accelerate launch recipes/train.py "
                                       "--config 'my run.yaml' --max_steps 9 --resume latest\n")
    assert run_recipe(bad, argv=["--a", "1"]) == 2
    assert capsys.readouterr().err == "train.py: error: bad input ['--a', '1']\n"
    with pytest.raises(ValueError, match="bad input"):
        run_recipe(bad, argv=["--debug", "--a", "1"])
    monkeypatch.setenv("MHLA_DEBUG", "1")
    with pytest.raises(KeyboardInterrupt):
        run_recipe(interrupted, resumable=True, argv=[])
