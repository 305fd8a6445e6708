"""The teacher probe (recipes/experiments/teacher_probe.py) run as users run it, at toy size on CPU,
and its measures: attention on the own cell, the per-pixel bound, the flow sampler."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from mhla_diffusion.experiments import pixel_dit
from mhla_diffusion.experiments.digits import PRESETS, load_data
from mhla_diffusion.experiments.digits_data import load_digits
from mhla_diffusion.experiments.teacher_probe import cell_ids, heldout_loss, own_cell_share, pixel_bound
from test_digits_experiment import REPO, run_script  # tests/ is on sys.path (no package): one runner for the experiments

SCRIPT = REPO / "recipes" / "experiments" / "teacher_probe.py"


def probe(*args):
    return run_script(SCRIPT, *args)


def test_probe_records_each_teacher_along_the_way_and_resumes(tmp_path):
    args = ("--preset", "mosaic-random-toy", "--runs", "ddpm@1e-3", "flow@1e-3", "--steps", 4, "--every", 2, "--score-at", 4,
            "--out", tmp_path, "--device", "cpu", "--no-progress")
    done = probe(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((tmp_path / "probe.json").read_text())
    assert sorted(results["runs"]) == ["ddpm@0.001", "flow@0.001"]
    for key, rec in results["runs"].items():
        assert rec["done"] and rec["steps"] == 4 and rec["step_ms"] > 0 and 0 < rec["bound"] < 2
        assert [p["step"] for p in rec["points"]] == [2, 4]
        for p in rec["points"]:
            assert math.isfinite(p["heldout_loss"]) and p["heldout_loss"] > 0
            assert len(p["own_cell_share"]) == 3 and all(0 < v < 1 for v in p["own_cell_share"])
        assert "scores" not in rec["points"][0] and math.isfinite(rec["points"][1]["scores"]["fid"])
        assert f"[probe] {key} step 4: held-out loss" in done.stdout
    table = (tmp_path / "probe.md").read_text()
    assert "| ddpm@0.001 | 4 |" in table and "| flow@0.001 | 2 |" in table and "uniform 0.250" in table and "confidence" in table
    with Image.open(tmp_path / "probe.png") as img:
        assert img.size[0] > 300
    again = probe(*args)  # finished runs are not trained again
    assert again.returncode == 0 and "[probe] ddpm" not in again.stdout and "[probe] flow" not in again.stdout
    assert json.loads((tmp_path / "probe.json").read_text())["runs"] == results["runs"]
    other = probe(*args, "--precision", "bf16")  # a record holds one preset and precision
    assert other.returncode == 2 and "other settings (precision differ)" in other.stderr


@pytest.mark.parametrize("args, message", [
    (["--runs", "ddpm3e-4"], "expected OBJECTIVE@LR"),
    (["--runs", "edm@3e-4"], "objective 'edm' is not one of ddpm, flow"),
    (["--runs", "flow@0"], "the learning rate must be positive"),
    (["--steps", "4", "--every", "2", "--score-at", "3"], "each must be a recorded step"),
    (["--preset", "mosaic-full"], "invalid choice: 'mosaic-full'"),  # fixed layouts: the bound would not hold
])
def test_bad_arguments_fail_in_one_line(tmp_path, args, message):
    done = probe("--out", tmp_path / "out", "--device", "cpu", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_heldout_loss_leaves_the_training_run_as_it_was():
    """Scoring along the way draws its own noise: a run with a point every 2 steps trains as one without."""
    s = PRESETS["mosaic-random-toy"]
    data = load_data(s)[1]
    losses = []
    for with_points in (False, True):
        model = pixel_dit.build_dit(s.resolution, s.model_size(), 0)
        at_step = lambda step: heldout_loss(model, data.test_images[:4], s)  # noqa: E731
        losses.append(pixel_dit.train(model, data.train_images, data.train_labels, replace(s.train_settings("pretrain"), steps=6),
                                      0, "t", False, at_steps=[2, 4] if with_points else [], at_step=at_step))
    assert losses[0] == losses[1]


class _Zero(torch.nn.Module):
    """Predicts 0 everywhere: its loss is the mean square of the objective's target."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, hidden_states, timestep, class_labels):
        return (hidden_states * self.w,)


def test_training_uses_the_objectives_target():
    """Against a zero prediction the loss is E|target|^2: epsilon (1) for DDPM, noise - x0 (1 + x0^2) for flow."""
    images, labels = torch.full((64, 1, 8, 8), 0.5), torch.zeros(64, dtype=torch.long)
    for objective, expected in (("ddpm", 1.0), ("flow", 1.25)):
        settings = pixel_dit.TrainSettings(20, 64, 0.0, 1, 0.9, process=pixel_dit.Process(objective))
        losses = pixel_dit.train(_Zero(), images, labels, settings, 0, "t", False)
        assert sum(losses) / len(losses) == pytest.approx(expected, abs=0.03)


def test_own_cell_share_against_the_dense_attention_in_fp64():
    torch.manual_seed(0)
    cells = cell_ids(4, 2)  # a 4 x 4 grid of 2 x 2 cells
    assert cells.view(4, 4).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    q, k = torch.randn(16, 3, 8), torch.randn(16, 3, 8)
    expected = 0.0
    for h in range(3):
        for i in range(16):
            w = torch.softmax(k[:, h].double() @ q[i, h].double() / math.sqrt(8), 0)
            expected += w[cells == cells[i]].sum().item() / 48
    assert own_cell_share(q, k, cells) == pytest.approx(expected, abs=1e-12)
    assert own_cell_share(torch.zeros(16, 3, 8), k, cells) == pytest.approx(4 / 16, abs=1e-12)  # uniform attention
    local = 30 * torch.nn.functional.one_hot(cells, 8).float()[:, None].expand(16, 3, 8)
    assert own_cell_share(local, local, cells) > 0.999


def test_per_pixel_bound_is_zero_for_one_image_and_below_the_trivial_predictor():
    scans = load_digits(8).train_images
    for objective in pixel_dit.OBJECTIVES:
        assert pixel_bound(scans[:1].expand(50, -1, -1, -1), pixel_dit.Process(objective), repeats=2) < 1e-6
    # ddpm: predicting eps = 0 scores 1; flow: predicting v = 0 scores E|noise - x0|^2 = 1 + E x0^2
    assert 0 < pixel_bound(scans, pixel_dit.Process("ddpm"), repeats=2) < 1
    assert 0 < pixel_bound(scans, pixel_dit.Process("flow"), repeats=2) < 1 + scans.pow(2).mean().item()
    # knowing each pixel's digit (the labels' own marginals) can only help the best per-pixel denoiser
    labels = load_digits(8).train_labels
    assert pixel_bound(scans, pixel_dit.Process("ddpm"), labels, repeats=2) < pixel_bound(scans, pixel_dit.Process("ddpm"), repeats=2)


class _PointMass(torch.nn.Module):
    """The exact prediction for data that is one image `x`: the flow velocity (x_t - x) / sigma, or DDPM's
    epsilon (x_t - sqrt(ab) x) / sqrt(1 - ab), read off the timestep the sampler passes."""

    def __init__(self, x: torch.Tensor, objective: str):
        super().__init__()
        self.x = torch.nn.Parameter(x)
        self.objective = objective
        self.config = SimpleNamespace(sample_size=x.shape[-1])
        self.tables = pixel_dit.Process().training_objective().tables

    def forward(self, hidden_states, timestep, class_labels):
        if self.objective == "flow":
            sigma = (timestep.double() / 1000).view(-1, 1, 1, 1)
            return (((hidden_states - self.x) / sigma).float(),)
        ab = self.tables["sqrt_ab"][timestep].view(-1, 1, 1, 1)
        return (((hidden_states - ab * self.x) / (1 - ab**2).sqrt()).float(),)


@pytest.mark.parametrize("objective", pixel_dit.OBJECTIVES)
def test_samplers_land_on_a_point_mass_from_its_exact_prediction(objective):
    x = torch.rand(1, 1, 8, 8) * 2 - 1
    images = pixel_dit.sample(_PointMass(x, objective), torch.zeros(3, dtype=torch.long), 5, 1.0, 0,
                              process=pixel_dit.Process(objective))
    torch.testing.assert_close(images, x.expand(3, -1, -1, -1), atol=1e-4, rtol=0)
