"""A user's weights are never lost or silently changed by convert, loading or info (issue: never lose weights)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.cli import main


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tuned(tmp_path):
    """A converted DiT pipeline whose MHLA weights were 'trained' (moved off their init), layers=[0]."""
    pipe = zoo.build_pipeline("dit")
    md.convert(pipe, md.default_config(pipe.transformer, layers=[0]))
    with torch.no_grad():
        for p in md.mhla_parameters(pipe.transformer):
            p.add_(torch.randn_like(p))
    pipe.save_pretrained(tmp_path / "tuned")
    return tmp_path / "tuned", pipe


def logits(path):
    from safetensors.torch import load_file

    state = load_file(str(path / "transformer" / "diffusion_pytorch_model.safetensors"))
    return {k: v for k, v in state.items() if ".processor." in k}


def test_reconverting_a_converted_dir_keeps_its_weights_or_refuses(tuned, tmp_path, capsys):
    src, _ = tuned
    assert main(["convert", str(src), str(tmp_path / "fp16"), "--dtype", "fp16"]) == 0
    assert "re-saved" in capsys.readouterr().out
    for key, value in logits(src).items():
        torch.testing.assert_close(logits(tmp_path / "fp16")[key], value.half(), rtol=0, atol=0)
    stored = lambda p: json.loads((p / "transformer" / "config.json").read_text())["mhla"]  # noqa: E731
    assert stored(tmp_path / "fp16") == stored(src) and stored(src)["layers"] == [0]
    assert main(["convert", str(src), str(tmp_path / "again"), "--blocks", "1,1"]) == 2
    assert "already converted" in capsys.readouterr().err and not (tmp_path / "again").exists()
    assert main(["convert", str(src), str(src)]) == 2
    assert "is SRC or inside it" in capsys.readouterr().err


def test_existing_dst_is_refused_or_replaced_whole(tuned, tmp_path, capsys):
    src, _ = tuned
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "important.txt").write_text("keep me")
    assert main(["convert", str(src), str(dst)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (dst / "important.txt").read_text() == "keep me"
    assert main(["convert", str(src), str(dst), "--overwrite"]) == 0
    assert not (dst / "important.txt").exists() and (dst / "model_index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "tuned"]  # no temporary dirs left


def test_a_failed_write_leaves_dst_as_it_was(tuned, tmp_path, monkeypatch, capsys):
    """A full disk (ENOSPC from the writer) mid-save: one line, exit 2, the old DST intact, nothing behind."""
    import errno

    import diffusers

    src, _ = tuned
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst)]) == 0
    before = logits(dst)
    real = diffusers.ModelMixin.save_pretrained

    def full_disk(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diffusers.ModelMixin, "save_pretrained", full_disk)
    assert main(["convert", str(src), str(dst), "--overwrite", "--dtype", "fp16"]) == 2
    assert "No space left on device" in capsys.readouterr().err.strip().splitlines()[-1]
    assert logits(dst).keys() == before.keys() and all(torch.equal(logits(dst)[k], v) for k, v in before.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "tuned"]


SLOW_CONVERT = """
import sys, time, diffusers
from mhla_diffusion.cli import main
real = diffusers.ModelMixin.save_pretrained
def slow(self, path, *a, **k):
    real(self, path, *a, **k)
    print("WRITING", flush=True)
    time.sleep(60)
diffusers.ModelMixin.save_pretrained = slow
sys.exit(main(sys.argv[1:]))
"""


def sigint_as_at_a_terminal():
    """`preexec_fn` for a child that the test interrupts with SIGINT: a suite started in the background (`make test &`)
    ignores SIGINT, which its children inherit, and Python then installs no KeyboardInterrupt handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_convert_leaves_dst_untouched(sig, tuned, tmp_path):
    src, _ = tuned
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst)]) == 0
    before = logits(dst)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, "convert", str(src), str(dst), "--overwrite", "--dtype", "fp16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=sigint_as_at_a_terminal)
    assert proc.stdout.readline().strip() == "WRITING"  # mid-save: the transformer is written, the rest is not
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert all(torch.equal(logits(dst)[k], v) for k, v in before.items())
    partial = tmp_path / ".dst.mhla-partial"
    if sig == signal.SIGKILL:
        assert partial.is_dir()  # clearly named; the next run removes it
        assert main(["convert", str(src), str(tmp_path / "dst"), "--overwrite"]) == 0
    else:
        assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "tuned"]


def test_loading_names_missing_weights(tuned, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src, _ = tuned
    weights = src / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    del state["transformer_blocks.0.attn1.processor.mixing.logits"]
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="MHLA weights of transformer_blocks.0.attn1"):
        md.from_pretrained(src)
    assert main(["info", str(src)]) == 2
    assert "missing for transformer_blocks.0.attn1" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2 and not (tmp_path / "out").exists()
    del state["transformer_blocks.1.attn1.to_q.weight"]  # a base weight: diffusers' own warning, then our error
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="lacks 2 weights"):
        md.from_pretrained(src)


def test_live_lora_layers_are_refused_at_save(tmp_path):
    from peft import LoraConfig, inject_adapter_in_model

    model = zoo.build_transformer("wan")
    md.convert(model)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), model)
    with pytest.raises(ValueError, match="live peft LoRA layers"):
        model.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


def test_bf16_dir_loads_whole_in_bf16(tmp_path):
    pipe = zoo.build_pipeline("wan")
    pipe.save_pretrained(tmp_path / "wan")
    assert main(["convert", str(tmp_path / "wan"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    loaded = md.from_pretrained(tmp_path / "bf16")
    assert loaded.transformer.dtype == loaded.vae.dtype == loaded.text_encoder.dtype == torch.bfloat16
    loaded.set_progress_bar_config(disable=True)
    out = loaded(prompt="a red cat", height=16, width=16, num_frames=5, num_inference_steps=1, max_sequence_length=8,
                 output_type="np").frames[0]
    assert out.shape[0] == 5


def test_block_grids_are_checked_at_conversion_for_wan():
    model = zoo.build_transformer("wan")
    with pytest.raises(ValueError, match=r"480p x 81 frames \(T: 1000 blocks > 21 tokens\)"):
        md.convert(model, md.MHLAConfig(blocks=(1000, 1, 1)))
    assert not md.is_converted(model) and "mhla" not in model.config


@pytest.mark.parametrize("damage,message", [
    ("safetensors", "is not a readable safetensors file"),
    ("config", "config.json is not valid JSON"),
])
def test_info_and_loading_report_damaged_files_in_one_line(damage, message, tuned, capsys):
    src, _ = tuned
    if damage == "safetensors":
        (src / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 7)
    else:
        (src / "transformer" / "config.json").write_text('{"_class_name": "MHLADiT",\n')
    for argv in (["info", str(src)], ["convert", str(src), str(src.parent / "out")]):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert message in lines[-1] and "Traceback" not in "".join(lines)


def test_offline_hub_id_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["convert", "no-such-org/no-such-model", "out-never-written"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "could not load no-such-org/no-such-model from the Hugging Face hub" in err and "local diffusers dir" in err
    assert not Path("out-never-written").exists()
