"""The digits experiment (recipes/experiments/digits.py) run as users run it, at toy size on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mhla_diffusion.experiments import classifier, digits_data, report
from mhla_diffusion.experiments.digits import PRESETS, main, table_rows

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "experiments" / "digits.py"


def run_script(script: Path, *args) -> subprocess.CompletedProcess:
    """`python script args` from the repo root, as a user runs a recipe experiment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def run(*args) -> subprocess.CompletedProcess:
    return run_script(SCRIPT, *args)


def toy_outputs(out: Path, preset: str) -> tuple[Path, str]:
    """A preset's whole run on CPU into `out`: (out, its stdout)."""
    done = run("--preset", preset, "--out", out, "--device", "cpu", "--no-progress")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out, done.stdout


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    return toy_outputs(tmp_path_factory.mktemp("digits"), "toy")


def test_toy_run_writes_every_output(toy_run):
    out, stdout = toy_run
    results = json.loads((out / "results.json").read_text())
    toy = PRESETS["toy"]
    assert results["settings"]["seeds"] == list(toy.seeds)
    assert results["card"].startswith("CPU") and results["date"] and "--preset toy" in results["command"]
    assert 0 <= results["classifier"]["test_accuracy"] <= 1
    assert math.isfinite(results["real_heldout"]["fid"]) and results["real_heldout"]["fid"] >= 0
    keys = [key for *_, key in table_rows(toy)]
    assert sorted(results["runs"]) == sorted(keys)
    for key in keys:
        runs = results["runs"][key]
        assert sorted(runs, key=int) == [str(s) for s in toy.seeds]
        for r in runs.values():
            assert math.isfinite(r["fid"]) and r["fid"] >= 0
            assert 0 <= r["accuracy"] <= 1 and r["n"] == toy.samples
            assert r["finetune_steps"] == (0 if key.endswith("converted") else toy.finetune_steps)
    for key in ["pretrain", *(f"{v}/seed{s}" for v in ("softmax", "linear", "mhla") for s in toy.seeds)]:
        c = results["curves"][key]
        assert c["loss"] and all(math.isfinite(v) and v > 0 for v in c["loss"])
    table = (out / "results.md").read_text()
    for label, *_ in table_rows(toy):
        assert f"| {label} |" in table
    for key in keys:
        assert f"{key} seed {toy.seeds[0]}: FID" in stdout
    pngs = ["loss_curves.png", "samples_real.png", *(f"samples_{k.replace('/', '_')}.png" for k in keys)]
    for name in pngs:
        with Image.open(out / name) as img:
            assert img.size[0] > 100 and img.size[1] > 100


def test_rerun_resumes_and_refuses_other_settings(toy_run, capsys):
    out, _ = toy_run
    before = json.loads((out / "results.json").read_text())["runs"]
    again = run("--preset", "toy", "--out", out, "--device", "cpu", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "pretrain" not in again.stdout and "finetune" not in again.stdout  # nothing retrained
    assert json.loads((out / "results.json").read_text())["runs"] == before

    # an interrupted run: the last fine-tune never finished; the rerun redoes it alone, identically
    last = str(PRESETS["toy"].seeds[-1])
    results = json.loads((out / "results.json").read_text())
    del results["runs"]["mhla/finetuned"][last]
    (out / "results.json").write_text(json.dumps(results))
    again = run("--preset", "toy", "--out", out, "--device", "cpu", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("[digits] finetune ") == 1 and "[digits] finetune mhla:" in again.stdout
    redone = json.loads((out / "results.json").read_text())["runs"]["mhla/finetuned"][last]
    assert redone["fid"] == pytest.approx(before["mhla/finetuned"][last]["fid"], rel=1e-6)
    assert redone["accuracy"] == before["mhla/finetuned"][last]["accuracy"]
    assert main(["--preset", "toy", "--out", str(out), "--device", "cpu", "--finetune-steps", "3"]) == 2
    assert "finetune_steps differ" in capsys.readouterr().err
    pinned = json.loads((out / "settings.json").read_text())
    old = {k: v for k, v in pinned.items() if k != "label_dropout"}  # a dir made before the label-dropout fix
    (out / "settings.json").write_text(json.dumps(old))
    assert main(["--preset", "toy", "--out", str(out), "--device", "cpu"]) == 2
    assert "label_dropout differ" in capsys.readouterr().err
    (out / "settings.json").write_text(json.dumps(pinned))


@pytest.mark.parametrize("args, message", [
    (["--mhla-blocks", "1,1,1"], "MHLA needs M > 1"),
    (["--mhla-blocks", "auto"], "explicit block grid"),
    (["--mhla-blocks", "1,16,16"], "does not fit token grid"),
    (["--samples", "5"], "samples must be at least"),
    (["--resolution", "9", "--patch-size", "2"], "not a multiple of patch size"),
    (["--seeds", "a,b"], "invalid"),
    (["--curve-steps", "6"], "strictly between 0 and finetune_steps"),
    (["--guided-target", "true"], "guided_target needs data_free"),
    (["--layout", "random"], "layout random needs mosaic > 1"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--objective", "edm"], "objective 'edm' is not one of ddpm, flow"),
    (["--precision", "fp8"], "precision 'fp8' is not one of fp32, bf16"),
])
def test_bad_settings_fail_before_training(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--preset", "toy", "--out", str(tmp_path / "out"), *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_digits_are_real_scans_split_once():
    a, b = digits_data.load_digits(8), digits_data.load_digits(16)
    assert len(a.train_labels) + len(a.test_labels) == 1797
    assert torch.equal(a.train_labels, b.train_labels)  # one split at every resolution
    assert a.train_images.min() == -1 and a.train_images.max() == 1
    counts = torch.bincount(a.test_labels)
    assert len(counts) == 10 and counts.max() - counts.min() <= 4  # stratified: the classes hold 174..183 scans


def test_fid_features_follow_the_uint8_path():
    torch.manual_seed(0)
    net = classifier.DigitClassifier().eval()
    feat = classifier.FIDFeatures(net, 8)
    images = torch.rand(4, 1, 8, 8) * 2 - 1
    pixels = digits_data.to_uint8_rgb(images)
    assert pixels.dtype == torch.uint8 and pixels.shape == (4, 3, 8, 8)
    expected = net.features(pixels[:, :1].float() / 127.5 - 1).double()
    torch.testing.assert_close(feat(pixels), expected)
    assert feat(torch.zeros(1, 3, 299, 299, dtype=torch.uint8)).shape == (1, feat.num_features)


def test_grid_puts_each_class_on_its_row():
    images = torch.linspace(-1, 1, 10).view(10, 1, 1, 1).expand(10, 1, 4, 4)
    labels = torch.arange(10)
    g = report.grid(images, labels, cols=1, cell=4)
    rows = [g[c * 6, 0, 0] for c in range(10)]  # cell 4 + gap 2
    assert rows == sorted(rows) and rows[0] == 0 and rows[-1] == 255
    assert np.all(g[4:6] == 255)  # the gap between rows


def test_data_free_stages_run_without_scans_and_keep_old_runs_resumable(tmp_path, toy_run):
    """--data-free adds attention transfer and teacher-only fine-tuning per seed (linear, MHLA); the
    options added since the first full run stay out of a run's pinned settings at their defaults."""
    from mhla_diffusion.experiments.digits import LATER_DEFAULTS

    out, _ = toy_run
    # curve_steps alone is pinned at its default ([]) in every run made since it exists, so those runs resume
    assert set(LATER_DEFAULTS) & set(json.loads((out / "settings.json").read_text())) == {"curve_steps"}
    done = run("--preset", "toy", "--out", tmp_path, "--device", "cpu", "--no-progress", "--seeds", "0",
               "--data-free", "true", "--transfer-steps", "3", "--teacher-samples", "20", "--curve-steps", "2,4",
               "--guided-target", "true")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    steps = PRESETS["toy"].finetune_steps
    for variant in ("linear", "mhla"):
        transferred, teacher = results["runs"][f"{variant}/transferred"]["0"], results["runs"][f"{variant}/teacher"]["0"]
        assert transferred["finetune_steps"] == 0 and len(transferred["layers"]) == PRESETS["toy"].layers
        assert teacher["finetune_steps"] == steps and math.isfinite(teacher["fid"])
        for kind in ("finetuned", "teacher"):  # the quality curves: scored along the way with the EMA weights
            assert [results["runs"][f"{variant}/{kind}@{n}"]["0"]["finetune_steps"] for n in (2, 4)] == [2, 4]
    guided = results["runs"]["mhla/teacher_guided"]["0"]
    assert guided["finetune_steps"] == steps and math.isfinite(guided["fid"])
    assert "mhla/teacher_guided seed 0: FID" in done.stdout
    table = (tmp_path / "results.md").read_text()
    assert "| MHLA (4 blocks), attention transfer (no scans) |" in table
    assert "| MHLA (4 blocks), transfer + teacher-only fine-tune (no scans) |" in table
    assert "guided target (no scans; sampled at guidance 1) |" in table
    assert "| run | N = 0 | N = 2 | N = 4 | N = 6 |" in table
    assert "| MHLA (4 blocks), attention transfer + teacher-only fine-tune (no scans) |" in table
    with Image.open(tmp_path / "quality_curves.png") as img:
        assert img.size[0] > 100


def test_seeds_in_parallel_processes_give_the_serial_results(tmp_path, toy_run):
    """--jobs 2: each seed in its own process, merged into one results.json, the same as one process."""
    out, _ = toy_run
    done = run("--preset", "toy", "--out", tmp_path, "--device", "cpu", "--no-progress", "--jobs", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    serial = json.loads((out / "results.json").read_text())["runs"]
    parallel = json.loads((tmp_path / "results.json").read_text())
    assert sorted(parallel["runs"]) == sorted(serial)
    for key, runs in serial.items():
        assert sorted(parallel["runs"][key]) == sorted(runs)
        for seed, r in runs.items():
            assert parallel["runs"][key][seed]["fid"] == pytest.approx(r["fid"], rel=1e-5)
    assert sorted(parallel["jobs"]) == ["0", "1"]
    assert "seeds in 2 parallel processes" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "samples_mhla_finetuned.png").is_file()  # the first seed's grids

    # a run made without --jobs goes on with it: its finished seeds are not redone
    again = run("--preset", "toy", "--out", out, "--device", "cpu", "--no-progress", "--jobs", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finetune" not in again.stdout and json.loads((out / "results.json").read_text())["runs"] == serial


def test_teacher_gets_the_students_labels(monkeypatch):
    """Teacher-only training: the labels the loop drops (10 %) reach teacher and student alike, and
    the student's own per-block dropout is off; the guided target is uncond + g (cond - uncond)."""
    from mhla_diffusion.experiments import pixel_dit

    base = pixel_dit.build_dit(8, pixel_dit.ModelSize(1, 2, 8, 2), 0).eval()  # a teacher, as trained models are
    student = pixel_dit.converted_copy(base, (1, 2, 2))
    seen = []
    original = base.forward
    monkeypatch.setattr(base, "forward", lambda **kw: seen.append(kw["class_labels"]) or original(**kw))
    images, labels = torch.zeros(64, 1, 8, 8), torch.arange(64) % 10
    settings = pixel_dit.TrainSettings(steps=3, batch_size=64, lr=1e-4, warmup=1, ema_decay=0.9)
    pixel_dit.train(student, images, labels, settings, 0, "t", False, teacher=pixel_dit.Teacher(base))
    assert all(m.dropout_prob == 0 for m in student.modules() if type(m).__name__ == "LabelEmbedding")
    dropped = torch.cat(seen) == 10  # the null class
    assert 0 < dropped.sum() < len(dropped) / 3
    seen.clear()  # without a teacher (pre-training, data fine-tuning) labels drop the same way, once per sample
    fresh = pixel_dit.build_dit(8, pixel_dit.ModelSize(1, 2, 8, 2), 1)
    plain = fresh.forward
    monkeypatch.setattr(fresh, "forward", lambda **kw: seen.append(kw["class_labels"]) or plain(**kw))
    pixel_dit.train(fresh, images, labels, settings, 0, "t", False)
    dropped = torch.cat(seen) == 10
    assert 0 < dropped.sum() < len(dropped) / 3
    assert all(m.dropout_prob == 0 for m in fresh.modules() if type(m).__name__ == "LabelEmbedding")
    inputs = {"hidden_states": torch.randn(2, 1, 8, 8), "timestep": torch.tensor([5, 500]), "class_labels": torch.tensor([1, 2])}
    seen.clear()
    guided = pixel_dit._distill_target(pixel_dit.Teacher(base, 2.0), inputs)
    cond, uncond = (base(**{**inputs, "class_labels": y}).sample for y in (torch.tensor([1, 2]), torch.tensor([10, 10])))
    torch.testing.assert_close(guided, uncond + 2.0 * (cond - uncond))
