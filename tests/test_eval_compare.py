"""`eval compare`: same seeds and prompts through teacher and student, metrics and the PNG grid."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

import mhla_diffusion
from mhla_diffusion import zoo
from mhla_diffusion.cli.main import main


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for family in ("dit", "pixart"):
        pipe = zoo.build_pipeline(family)
        pipe.save_pretrained(root / f"{family}_orig")
        mhla_diffusion.convert(pipe)
        pipe.save_pretrained(root / f"{family}_mhla")
        out[family] = (root / f"{family}_orig", root / f"{family}_mhla")
    (root / "prompts.txt").write_text("a red cat\n\na blue house on the sky\n")
    out["prompts"] = root / "prompts.txt"
    return out


def compare(teacher, student, out, *extra):
    return main(["eval", "compare", "--teacher", str(teacher), "--student", str(student), "--out", str(out),
                 "--num-samples", "3", "--steps", "2", "--batch-size", "2", *extra])


def test_dit_teacher_vs_mhla_student(dirs, tmp_path):
    orig, mhla = dirs["dit"]
    assert compare(orig, mhla, tmp_path, "--guidance-scale", "1") == 0
    r = json.loads((tmp_path / "compare.json").read_text())
    assert len(r["per_image"]["psnr"]) == len(r["per_image"]["ssim"]) == len(r["per_image"]["latent_mse"]) == 3
    assert math.isfinite(r["psnr_mean"]) and r["psnr_mean"] > 0
    assert -1 <= r["ssim_mean"] < 1
    assert r["latent_mse_mean"] > 0
    grid = np.asarray(Image.open(tmp_path / "compare.png").convert("L"))
    assert grid.shape[0] > 3 * 96 and grid.shape[1] > 3 * 96  # 3 samples x (teacher, student, difference) at 96 px
    assert (grid[:, :40] < 128).any()  # each row's label (sample, PSNR, SSIM) left of its images


def test_same_model_gives_identical_samples(dirs, tmp_path):
    _, mhla = dirs["pixart"]
    assert compare(mhla, mhla, tmp_path, "--prompts", str(dirs["prompts"]), "--height", "16", "--width", "16") == 0
    r = json.loads((tmp_path / "compare.json").read_text())
    assert r["latent_mse_mean"] == 0 and r["psnr_mean"] == math.inf and r["ssim_mean"] == pytest.approx(1.0)


def test_pixart_student_differs_and_text_families_need_prompts(dirs, tmp_path, capsys):
    orig, mhla = dirs["pixart"]
    assert compare(orig, mhla, tmp_path, "--prompts", str(dirs["prompts"])) == 0
    assert json.loads((tmp_path / "compare.json").read_text())["latent_mse_mean"] > 0
    assert compare(orig, mhla, tmp_path) == 2
    assert "need prompts" in capsys.readouterr().err
