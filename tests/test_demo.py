"""`mhla-diffusion demo` on the bundled trained digits DiT: converted, fitted without data, reloaded, scored."""

import json

import numpy as np
from PIL import Image

import mhla_diffusion as md
from mhla_diffusion.cli import main


def test_demo_converts_fits_reloads_and_scores_the_bundled_model(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--per-class", "1", "--steps", "8", "--transfer-steps", "40",
                 "--no-progress"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    scores = summary["scores"]
    assert list(scores) == ["original (softmax)", "MHLA, converted", "MHLA + attention transfer"]
    assert scores["original (softmax)"] >= 0.8  # a really trained model (MODEL_CARD.md: 0.947 over 1,000 samples)
    assert scores["MHLA + attention transfer"] > scores["MHLA, converted"]
    assert all(layer["after"] < layer["before"] for layer in summary["layers"])
    picture = np.asarray(Image.open(tmp_path / "demo.png").convert("L"))
    assert picture.shape[0] > 3 * 40 and picture.shape[1] > 10 * 40  # 3 labelled rows of 10 digits at 40 px
    assert type(md.from_pretrained(tmp_path / "mhla")).__name__ == "MHLADiTTransformer2DModel"
    assert "accuracy" in capsys.readouterr().out
