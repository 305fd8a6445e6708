"""Tiny offline pipelines after conversion, pipeline save/reload, and the command line."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.cli import main
from mhla_diffusion.cli.demo import sample
from mhla_diffusion.conversion import mhla_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", zoo.FAMILIES)
@pytest.mark.parametrize("how", ["convert", "set_attn_processor"])
def test_pipelines_generate_after_conversion(family, how):
    pipe = zoo.build_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    before = sample(pipe, family, seed=0, steps=2)
    if how == "convert":
        md.convert(pipe)
    else:
        md.set_attn_processor(pipe.transformer, md.mhla_processors(pipe.transformer))
    assert mhla_modules(pipe.transformer)
    after = sample(pipe, family, seed=0, steps=2)
    assert after.shape == before.shape and np.isfinite(after).all()
    assert not np.allclose(after, before)


def test_pipeline_dir_roundtrip(tmp_path):
    pipe = zoo.build_pipeline("sana")
    pipe.set_progress_bar_config(disable=True)
    md.convert(pipe, md.default_config(pipe.transformer, blocks=(1, 2, 2), output_gate=True))
    with torch.no_grad():
        for p in md.mhla_parameters(pipe.transformer):
            p.add_(0.1 * torch.randn_like(p))
    expected = sample(pipe, "sana", seed=3, steps=2)
    pipe.save_pretrained(tmp_path)
    reloaded = md.from_pretrained(tmp_path)
    reloaded.set_progress_bar_config(disable=True)
    np.testing.assert_array_equal(sample(reloaded, "sana", seed=3, steps=2), expected)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    zoo.build_pipeline("dit").save_pretrained(root / "dit-pipe")
    zoo.build_transformer("wan").save_pretrained(root / "wan-transformer")
    return root


def test_cli_convert_pipeline_then_info_and_reload(checkpoints, capsys):
    dst = checkpoints / "dit-mhla"
    assert main(["convert", str(checkpoints / "dit-pipe"), str(dst), "--blocks", "2,2", "--layers", "0", "--dtype", "fp16"]) == 0
    assert "1 self-attention layer converted" in capsys.readouterr().out
    assert main(["info", str(dst), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["models"]["transformer"]
    assert info["converted"] and info["converted_layers"] == [0] and info["mhla"]["blocks"] == [1, 2, 2]
    assert info["dtypes"] == ["F16"] and list(info["mhla_layers"]) == ["transformer_blocks.0.attn1"]
    pipe = md.from_pretrained(dst)  # in the dtype it was saved in
    assert pipe.transformer.dtype == pipe.vae.dtype == torch.float16
    assert type(pipe.transformer.transformer_blocks[1].attn1.processor).__name__ == "AttnProcessor2_0"
    assert main(["info", str(checkpoints / "dit-pipe")]) == 0
    assert "not converted" in capsys.readouterr().out


def test_cli_convert_transformer_dir_released_wan_variant(checkpoints):
    dst = checkpoints / "wan-mhla"
    assert main(["convert", str(checkpoints / "wan-transformer"), str(dst), "--layers", "hybrid:2"]) == 0
    cfg = md.persistence.stored_config(dst)
    assert (cfg.normalize, cfg.output_norm, cfg.layers) == (False, True, "hybrid:2")
    model = md.from_pretrained(dst)
    assert sorted(mhla_modules(model)) == ["blocks.0.attn1.processor"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["convert", "{tmp}/missing", "{tmp}/out"], "does not exist"),
        (["convert", "{tmp}", "{tmp}/out"], "is not a diffusers dir"),
        (["convert", "{ckpt}/dit-pipe", "{tmp}/out", "--blocks", "3,5,10"], "does not fit"),
        (["convert", "{ckpt}/dit-pipe", "{tmp}/out", "--blocks", "a,b"], "blocks must be"),
        (["convert", "{ckpt}/dit-pipe", "{tmp}/out", "--layers", "0,9"], "out of range"),
        (["convert", "{ckpt}/unet", "{tmp}/out"], "unsupported model class UNet2DModel; supported: DiTTransformer2DModel"),
        (["info", "{ckpt}/dit-pipe/vae"], "unsupported"),
    ],
)
def test_cli_errors_are_one_line(argv, message, checkpoints, tmp_path, capsys):
    import diffusers

    if not (checkpoints / "unet").exists():
        diffusers.UNet2DModel(block_out_channels=(8,), norm_num_groups=4, down_block_types=("DownBlock2D",),
                              up_block_types=("UpBlock2D",)).save_pretrained(checkpoints / "unet")
    argv = [a.format(tmp=tmp_path, ckpt=checkpoints) for a in argv]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after any loading progress bar
    assert last.startswith(f"mhla-diffusion {argv[0]}: error: ") and message in last


def test_unknown_option_and_console_entry_points(checkpoints):
    """`python cli.py` from the repo root and the installed script behave the same."""
    bad = subprocess.run([sys.executable, "cli.py", "convert", "a", "b", "--bogus"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
    ok = subprocess.run([sys.executable, "cli.py", "info", str(checkpoints / "dit-pipe")], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "DiTTransformer2DModel" in ok.stdout


def test_random_weight_demo_writes_a_labelled_picture_and_save_writes_a_pipeline(tmp_path, capsys):
    assert main(["demo", "--family", "dit", "--out", str(tmp_path), "--steps", "2"]) == 0
    from PIL import Image

    img = np.asarray(Image.open(tmp_path / "demo.png").convert("L"))
    assert img.shape[1] > img.shape[0] > 2 * 96  # two labelled rows of 4 samples, each drawn at 96 px
    assert (img[:, :60] < 128).any()  # the row labels left of the samples
    assert md.persistence.stored_config(tmp_path / "mhla") is not None
    assert main(["demo", "--save", str(tmp_path / "tiny-wan"), "--family", "wan"]) == 0
    assert "mhla-diffusion convert" in capsys.readouterr().out
    assert type(md.persistence.load(tmp_path / "tiny-wan")).__name__ == "WanPipeline"


def test_help_shows_defaults_version_and_dtype_names(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("mhla-diffusion ")
    with pytest.raises(SystemExit):
        main(["transfer", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer steps per layer (default: 200)" in text and "SRC the original (unconverted) pipeline dir" in text
    with pytest.raises(SystemExit):
        main(["bench", "op", "--help"])
    assert "'Wan2.1-1.3B 480p'" in " ".join(capsys.readouterr().out.split())


def test_convert_takes_long_dtype_names(checkpoints, tmp_path, capsys):
    assert main(["convert", str(checkpoints / "dit-pipe"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "bf16"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"]["transformer"]["dtypes"] == ["BF16"]
