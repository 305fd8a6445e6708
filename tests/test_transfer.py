"""`mhla-diffusion transfer`: convert without data, each layer fitted to its softmax original."""

import json

import pytest

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.cli import main

from test_convert import run


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("originals")
    zoo.build_pipeline("dit").save_pretrained(root / "dit")
    zoo.build_pipeline("wan").save_pretrained(root / "wan")
    (root / "prompts.txt").write_text("a red cat\na blue dog on a tree\n")
    return root


def error_to_teacher(model, teacher, family):
    """Relative squared error of the model's output against the teacher's on inputs no fit has seen."""
    errs = []
    for seed in (7, 8):
        target = run(teacher, 8, seed=seed)
        errs.append(((run(model, 8, seed=seed) - target).pow(2).mean() / target.pow(2).mean()).item())
    return sum(errs) / len(errs)


def test_transfer_fits_each_layer_and_moves_the_model_toward_the_teacher(originals, tmp_path, capsys):
    dst = tmp_path / "dit-transfer"
    assert main(["transfer", str(originals / "dit"), str(dst), "--num-samples", "4", "--steps", "5",
                 "--guidance-scale", "1", "--steps-per-layer", "80", "--blocks", "2,2"]) == 0
    out = capsys.readouterr().out
    assert "| transformer/transformer_blocks.0.attn1 |" in out and "2 self-attention layers MHLA" in out
    report = json.loads((dst / "transfer.json").read_text())
    assert [r["layer"] for r in report] == ["transformer/transformer_blocks.0.attn1", "transformer/transformer_blocks.1.attn1"]
    assert all(r["after"] < r["before"] and len(r["curve"]) == 80 for r in report)
    assert any((dst / "transfer_logs").iterdir())

    teacher = md.persistence.load(originals / "dit").transformer
    untrained = md.convert(md.persistence.load(originals / "dit").transformer, md.MHLAConfig(blocks=(2, 2)))
    transferred = md.from_pretrained(dst).transformer
    assert error_to_teacher(transferred, teacher, "dit") < error_to_teacher(untrained, teacher, "dit")


def test_transfer_with_projections_and_a_data_driven_hybrid(originals, tmp_path, capsys):
    import diffusers

    dst = tmp_path / "wan-transfer"
    argv = ["transfer", str(originals / "wan"), str(dst), "--prompts", str(originals / "prompts.txt"),
            "--num-samples", "2", "--batch-size", "2", "--steps", "3", "--height", "16", "--width", "16",
            "--num-frames", "5", "--steps-per-layer", "40", "--projection-lr", "1e-3", "--keep-softmax-worst", "1",
            "--keep-calls", "4"]  # of 12 calls per layer (2 samples x 3 steps x 2 CFG branches)
    assert main([*argv, "--layers-per-pass", "1"]) == 0
    report = json.loads((dst / "transfer.json").read_text())
    assert all(r["after"] < r["before"] for r in report)
    argv[2] = str(tmp_path / "one-pass")  # all layers recorded in one pass: the same calls, the same fit
    assert main(argv) == 0
    assert json.loads((tmp_path / "one-pass" / "transfer.json").read_text()) == report
    best = min(report, key=lambda r: r["after"])["layer"]
    pipe = diffusers.DiffusionPipeline.from_pretrained(dst)  # loads like any converted dir
    assert sorted(md.conversion.mhla_modules(pipe.transformer)) == [f"{best.split('/')[1]}.processor"]
    assert pipe.transformer.config["mhla"]["layers"] == [int(best.split(".")[1])]


@pytest.mark.parametrize("case,message", [
    ("converted", "already converted to MHLA: the teacher must be the original model"),
    ("empty prompts", "holds no prompts"),
    ("transformer dir", "needs its pipeline dir"),
])
def test_transfer_bad_input_is_one_line_and_writes_nothing(case, message, originals, tmp_path, capsys):
    src, extra = originals / "wan", ["--prompts", str(originals / "prompts.txt")]
    if case == "converted":
        pipe = zoo.build_pipeline("wan")
        md.convert(pipe)
        pipe.save_pretrained(tmp_path / "converted")
        src = tmp_path / "converted"
    elif case == "empty prompts":
        (tmp_path / "empty.txt").write_text("\n \n")
        extra = ["--prompts", str(tmp_path / "empty.txt")]
    else:
        src = originals / "wan" / "transformer"
    assert main(["transfer", str(src), str(tmp_path / "out"), "--steps-per-layer", "1", *extra]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
