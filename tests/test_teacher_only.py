"""Fine-tuning without a dataset: a latent cache of the original model's own samples, then the recipe on it."""

import json

import pytest
import torch

import mhla_diffusion
from mhla_diffusion import zoo
from mhla_diffusion.training import distill, model
from mhla_diffusion.training.train_config import load_config

from test_recipes import launch, scalars

# (family, training resolution in pixels, extra arguments)
CASES = [("dit", "8", []), ("pixart", "8", []), ("sana", "32", []), ("wan", "16", ["--num_frames", "5"])]


@pytest.mark.parametrize("family,resolution,extra", CASES)
def test_teacher_only_cache_then_distillation(family, resolution, extra, tmp_path):
    zoo.build_pipeline(family).save_pretrained(tmp_path / "original")
    (tmp_path / "prompts.txt").write_text("a red cat\na small house with a green tree\n")
    prompts = [] if family == "dit" else ["--prompts", tmp_path / "prompts.txt"]
    common = ["--pretrained", tmp_path / "original", "--resolution", resolution, "--train_batch_size", "2", *extra]
    cache = tmp_path / "cache"
    precompute = ["precompute.py", *common, "--out", cache, "--teacher_samples", "3", "--teacher_steps", "2", *prompts]
    launch(*precompute)
    info = json.loads((cache / "cache.json").read_text())
    assert info["family"] == family and info["samples"] == 3 and info["teacher"]["steps"] == 2
    files = sorted(cache.glob("*.safetensors"))
    assert [f.name for f in files] == [f"{i:09d}.safetensors" for i in range(3)]

    if family == "wan":  # an interrupted run (a sample missing, no cache.json yet) resumes: only that sample is made
        kept = files[0].stat().st_mtime_ns
        files[2].unlink()
        (cache / "cache.json").unlink()
        launch(*precompute)
        assert files[2].is_file() and files[0].stat().st_mtime_ns == kept

    out = tmp_path / "out"
    launch("train.py", *common, "--data_dir", cache, "--distill_output", "1.0", "--max_steps", "2",
           "--train_batch_size", "1", "--num_workers", "0", "--log_every", "1", "--output_dir", out)
    assert len(scalars(out, "distill_output")) == 2
    pipe = mhla_diffusion.from_pretrained(out / "final")
    assert mhla_diffusion.is_converted(pipe.transformer)


def test_teacher_cache_refuses_bad_input(tmp_path):
    zoo.build_pipeline("wan").save_pretrained(tmp_path / "wan")
    common = ["--pretrained", tmp_path / "wan", "--resolution", "16", "--num_frames", "5", "--out", tmp_path / "cache"]
    out = launch("precompute.py", *common, "--teacher_samples", "2", ok=False)
    assert "need --prompts FILE" in out
    (tmp_path / "empty.txt").write_text("\n")
    out = launch("precompute.py", *common, "--teacher_samples", "2", "--prompts", tmp_path / "empty.txt", ok=False)
    assert "holds no prompts" in out
    pipe = zoo.build_pipeline("wan")
    mhla_diffusion.convert(pipe)
    pipe.save_pretrained(tmp_path / "converted")
    out = launch("precompute.py", "--pretrained", tmp_path / "converted", "--resolution", "16", "--num_frames", "5",
                 "--out", tmp_path / "cache2", "--teacher_samples", "2", "--prompts", tmp_path / "empty.txt", ok=False)
    assert "the teacher must be the original model" in out
    assert not (tmp_path / "cache" / "cache.json").exists() and not (tmp_path / "cache2").exists()



@pytest.mark.parametrize("family", ["dit", "pixart"])
def test_the_student_in_train_mode_computes_what_its_teacher_computes(family, tmp_path):
    """Teacher and student must see the same conditioning: with the same weights, the recipe's student in
    train mode predicts exactly what its frozen teacher (eval mode) predicts on the same inputs. diffusers'
    DiT drops class labels to its null class inside its forward in train mode (LabelEmbedding.token_drop),
    which would train the student's unconditional branch toward the teacher's conditional prediction."""
    zoo.build_pipeline(family).save_pretrained(tmp_path / "original")
    cfg = load_config(None, {"pretrained": str(tmp_path / "original"), "train_mode": "mhla"})
    _, transformer, fam = model.load_model(cfg)
    teacher = distill.build_teacher(transformer, model.frozen_parameter_ids(transformer, cfg))
    transformer.train()
    c = transformer.config
    inputs = fam.example_inputs(transformer, (c.in_channels, c.sample_size, c.sample_size), batch=32,
                                generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        student_out, teacher_out = (m(**inputs, return_dict=False)[0] for m in (transformer, teacher))
    differing = (student_out - teacher_out).flatten(1).abs().amax(1) > 0
    assert not differing.any(), f"{int(differing.sum())} of 32 samples differ"
