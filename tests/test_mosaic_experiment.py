"""The mosaic setting of the digits experiment (--preset mosaic-toy) run as users run it, on CPU,
and the pieces it adds: mosaics of real scans, per-cell scoring, the attention diagnostic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from mhla_diffusion.experiments import digits_data, pixel_dit
from mhla_diffusion.experiments.digits import PRESETS, table_rows, variants
from test_digits_experiment import run, toy_outputs  # tests/ is on sys.path (no package): one runner for both

TOY = PRESETS["mosaic-toy"]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    return toy_outputs(tmp_path_factory.mktemp("mosaic"), "mosaic-toy")


def test_toy_run_scores_cells_and_images_of_four_variants(toy_run):
    out, stdout = toy_run
    results = json.loads((out / "results.json").read_text())
    assert variants(TOY) == ("softmax", "linear", "mhla", "hybrid")
    keys = [key for *_, key in table_rows(TOY)]
    assert sorted(results["runs"]) == sorted(keys) and len(keys) == 8
    cells = TOY.samples * TOY.mosaic ** 2
    for key in keys:
        for r in results["runs"][key].values():
            assert r["n"] == TOY.samples and r["cells"] == cells
            assert math.isfinite(r["fid"]) and math.isfinite(r["image_fid"]) and r["image_fid"] >= 0
            assert 0 <= r["accuracy"] <= 1
    for variant in ("mhla", "hybrid"):  # the MHLA parameters moved, at their own rate
        assert all(r["mhla/mixing_change"] > 0 for r in results["runs"][f"{variant}/finetuned"].values())
    real = results["real_heldout"]
    assert real["n"] == TOY.samples and real["cells"] == cells and math.isfinite(real["image_fid"])
    assert results["mosaics"]["layouts"] == digits_data.layouts(TOY.mosaic).tolist()
    table = (out / "results.md").read_text()
    assert "# Mosaic experiment (256 tokens)" in table and "| real held-out mosaics (n = 20) |" in table
    for label, *_ in table_rows(TOY):
        assert f"| {label} |" in table
    for name in ("loss_curves.png", "attention.png", "samples.png", "samples_real.png", "samples_hybrid_finetuned.png"):
        with Image.open(out / name) as img:
            assert img.size[0] > 100 and img.size[1] > 100
    assert "hybrid/finetuned seed 0: FID" in stdout


def test_block_grids_join_a_finished_run_as_rows_of_their_own(toy_run, tmp_path):
    """--other-grids adds MHLA on other block grids (here one that cuts across the 2 x 2 cells) to a
    finished run: only the new variant is trained, the rows made before stay as they were."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(toy_run[0], out)
    before = json.loads((out / "results.json").read_text())["runs"]
    done = run("--preset", "mosaic-toy", "--out", out, "--device", "cpu", "--no-progress", "--other-grids", "1,3,3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((out / "results.json").read_text())
    assert {k: v for k, v in results["runs"].items() if k in before} == before
    assert sorted(set(results["runs"]) - set(before)) == ["mhla_1x3x3/converted", "mhla_1x3x3/finetuned"]
    assert all(r["mhla/mixing_change"] > 0 for r in results["runs"]["mhla_1x3x3/finetuned"].values())
    assert [(r["kind"], r["num_blocks"]) for r in results["attention"]["mhla_1x3x3"]] == [("mhla", 9)] * 3
    assert "| MHLA (9 blocks, grid 1 x 3 x 3), fine-tuned |" in (out / "results.md").read_text()
    assert "finetune softmax" not in done.stdout and "pretrain" not in done.stdout

    # a seed added later, in --jobs processes, without the flag: the recorded grid stays a row and gets the new
    # seed too; nothing done before is trained again
    done = run("--preset", "mosaic-toy", "--out", out, "--device", "cpu", "--no-progress", "--seeds", "0,1,2", "--jobs", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    again = json.loads((out / "results.json").read_text())
    assert sorted(again["runs"]["mhla_1x3x3/finetuned"]) == ["0", "1", "2"]
    assert all(again["runs"][k][seed] == r for k, runs in results["runs"].items() for seed, r in runs.items())
    assert "| MHLA (9 blocks, grid 1 x 3 x 3), fine-tuned | 9 | 4 | 3 |" in (out / "results.md").read_text()
    assert done.stdout.count("finetune mhla_1x3x3") == 1  # seed 2's only

    bad = run("--preset", "mosaic-toy", "--out", tmp_path / "bad", "--other-grids", "2,2")  # = mhla_blocks (1, 2, 2)
    assert bad.returncode == 2 and "other_grids repeat (1, 2, 2)" in bad.stderr
    bad = run("--preset", "mosaic-toy", "--out", tmp_path / "bad", "--other-grids", "auto")
    assert bad.returncode == 2 and "each grid must be 'bt,bh,bw'" in bad.stderr


def test_attention_diagnostic_reads_each_models_own_attention(toy_run):
    out, _ = toy_run
    attention = json.loads((out / "results.json").read_text())["attention"]
    assert sorted(attention) == sorted(variants(TOY))
    kinds = {v: [r["kind"] for r in rows] for v, rows in attention.items()}
    assert kinds == {"softmax": ["softmax"] * 3, "linear": ["linear"] * 3, "mhla": ["mhla"] * 3,
                     "hybrid": ["mhla", "mhla", "softmax"]}  # hybrid:3 keeps the third layer softmax
    n = (TOY.resolution // TOY.patch_size) ** 2
    for rows in attention.values():
        for r in rows:
            assert r["tokens"] == n and 0 < r["entropy"] <= math.log(n) + 1e-9
            if r["kind"] == "linear":
                assert r["rank"] <= TOY.head_dim  # one D x D summary: the collapse
            if r["kind"] == "mhla":
                assert r["rank"] <= math.prod(TOY.mhla_blocks) * TOY.head_dim


def test_rerun_resumes(toy_run):
    out, _ = toy_run
    before = json.loads((out / "results.json").read_text())["runs"]
    again = run("--preset", "mosaic-toy", "--out", out, "--device", "cpu", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "pretrain" not in again.stdout and "finetune" not in again.stdout
    assert json.loads((out / "results.json").read_text())["runs"] == before


def test_mosaics_are_real_scans_in_their_layouts_cells():
    scans = digits_data.load_digits(8)
    table = digits_data.layouts(4)
    assert table.shape == (10, 16) and all(torch.bincount(row, minlength=10).max() <= 2 for row in table)
    assert torch.equal(digits_data.layouts(4), table)  # fixed
    assert torch.equal(digits_data.layouts(1), torch.arange(10)[:, None])  # plain digits
    ids = torch.arange(30) % 10
    mosaics = digits_data.compose_mosaics(scans.test_images, scans.test_labels, ids, 4, seed=2)
    assert mosaics.shape == (30, 1, 32, 32)
    cells = digits_data.split_cells(mosaics, 4)
    flat = scans.test_images.flatten(1)
    match = (cells.flatten(1)[:, None] == flat[None]).all(-1)  # each cell is one of the held-out scans...
    assert match.any(1).all()
    found = scans.test_labels[match.float().argmax(1)]
    assert torch.equal(found, table[ids].flatten())  # ...of its layout's digit, at its row-major place
    assert torch.equal(digits_data.join_cells(cells, 4), mosaics)


def test_bad_mosaic_settings_fail_before_training(tmp_path, capsys):
    from mhla_diffusion.experiments.digits import main

    for args, message in ((["--mosaic", "3"], "must divide resolution"), (["--mosaic", "4"], "at least the scans' 8 pixels"),
                          (["--hybrid", "5"], "hybrid 5 must be 0")):
        with pytest.raises(SystemExit) as exit_:
            main(["--preset", "mosaic-toy", "--out", str(tmp_path / "out"), *args])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_projection_capture_matches_the_mhla_capture():
    """record_projections (any attention) reads the same q, k, blocks and mixing matrix as the
    processor-level record_attention on an MHLA model."""
    from mhla_diffusion.evaluation.attention_capture import record_attention, record_projections

    base = pixel_dit.build_dit(16, pixel_dit.ModelSize(2, 2, 8, 2), 0)
    model = pixel_dit.converted_copy(base, (1, 2, 2), "hybrid:2")
    attentions = {str(i): b.attn1 for i, b in enumerate(model.transformer_blocks)}
    with record_attention(model) as mhla, record_projections(attentions) as every:
        pixel_dit.sample(model, torch.tensor([3]), 2, 1.5, 0)
    assert sorted(every) == ["0", "1"] and len(mhla) == 1  # the second layer kept softmax
    a, b = next(iter(mhla.values())), every["0"]
    torch.testing.assert_close(a.q, b.q)
    torch.testing.assert_close(a.k, b.k)
    assert a.blocks == b.blocks == (1, 2, 2) and torch.equal(a.mix, b.mix)
    assert every["1"].blocks == (1, 1, 1) and every["1"].q.shape == (64, 2, 8)


def test_random_layouts_are_unconditional_and_scored_by_confidence(tmp_path):
    """--layout random: every cell a random scan, one label for all, cells scored by the classifier's
    confidence; with the mhla_lr ablation variant, whose mixing moves less than MHLA's at its own rate.
    Trained and sampled as rectified flow, as mosaic-random-flow runs (--preset mosaic-random-toy: its CI size)."""
    done = run("--preset", "mosaic-random-toy", "--out", tmp_path, "--device", "cpu", "--no-progress")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert "mhla_base_lr/finetuned" in results["runs"]
    for runs in results["runs"].values():
        assert all(0 < r["confidence"] <= 1 and "accuracy" not in r for r in runs.values())
    assert 0 < results["real_heldout"]["confidence"] <= 1
    moved = {v: results["runs"][f"{v}/finetuned"]["0"]["mhla/mixing_change"] for v in ("mhla", "mhla_base_lr")}
    assert moved["mhla"] > moved["mhla_base_lr"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "position decides nothing about content" in table and "cell confidence (mean ± std)" in table
    assert "| MHLA (4 blocks), its parameters at the fine-tune rate, fine-tuned |" in table
    assert "rectified flow (velocity target), Euler 2 steps" in table and "DDIM" not in table
    assert json.loads((tmp_path / "settings.json").read_text())["objective"] == "flow"


def test_random_mosaics_are_real_scans_drawn_independently():
    scans = digits_data.load_digits(8)
    mosaics = digits_data.random_mosaics(scans.test_images, 200, 2, seed=2)
    cells = digits_data.split_cells(mosaics, 2)
    match = (cells.flatten(1)[:, None] == scans.test_images.flatten(1)[None]).all(-1)
    assert mosaics.shape == (200, 1, 16, 16) and match.any(1).all()
    digits = scans.test_labels[match.float().argmax(1)].view(200, 4)
    assert len(torch.unique(digits, dim=0)) > 150  # no fixed layouts
    assert all(torch.bincount(digits[:, c], minlength=10).min() > 5 for c in range(4))  # every digit in every cell
    assert torch.equal(digits_data.random_mosaics(scans.test_images, 200, 2, seed=2), mosaics)
