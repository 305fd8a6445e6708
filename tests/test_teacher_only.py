"""Fine-tuning without a dataset: a latent cache of the original model's own samples, then the recipe on it."""

import json

import pytest
import torch

import mhla_diffusion
from mhla_diffusion import zoo
from mhla_diffusion.families import family_of
from mhla_diffusion.training import conditioning, distill, model
from mhla_diffusion.training.objectives import model_output
from mhla_diffusion.training.train_config import load_config

from test_recipes import REPO, launch, scalars

OVERLAY = REPO / "recipes" / "configs" / "teacher_only.yaml"  # the shipped teacher-only mode, for every family

# (family, training resolution in pixels, extra arguments, the training run's guidance options)
CASES = [("dit", "8", [], ["--uncond_prob", "1.0", "--train_mode", "full", "--learning_rate", "1e-3"]),
         ("pixart", "8", [], ["--uncond_prob", "0.5", "--distill_guidance_scale", "3.0", "--distill_layers", "1.0"]),
         ("sana", "32", [], ["--uncond_prob", "0", "--distill_guidance_scale", "2.0"]),
         ("wan", "16", ["--num_frames", "5"], [])]  # the default uncond_prob


@pytest.mark.parametrize("family,resolution,extra,guidance", CASES)
def test_teacher_only_cache_then_distillation(family, resolution, extra, guidance, tmp_path):
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
    launch("train.py", *common, "--config", OVERLAY, "--data_dir", cache, "--max_steps", "2",
           "--train_batch_size", "1", "--num_workers", "0", "--log_every", "1", "--output_dir", out, *guidance)
    assert len(scalars(out, "distill_output")) == 2
    pipe = mhla_diffusion.from_pretrained(out / "final")
    assert mhla_diffusion.is_converted(pipe.transformer)
    if family == "dit":  # every sample unconditional: the null class's embedding row trained, in every block
        original = zoo.build_pipeline(family).transformer.state_dict()
        rows = [k for k in original if k.endswith("class_embedder.embedding_table.weight")]
        null = pipe.transformer.config.num_embeds_ada_norm
        assert rows and all(not torch.equal(pipe.transformer.state_dict()[k][null], original[k][null]) for k in rows)


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


def test_teacher_and_student_get_the_pipelines_unconditional_input(tmp_path):
    """The unconditional input is the one the pipeline's guidance evaluates (DiT: the null class, the text
    families: the empty negative prompt), and it replaces the conditioning of the chosen samples only."""
    dit = zoo.build_transformer("dit")
    uncond = conditioning.unconditional(None, dit, family_of(dit), 0, "cpu", torch.float32)
    labels = torch.tensor([3, 5, 7])
    dropped = conditioning.drop_conditioning({"class_label": labels}, uncond, torch.tensor([False, True, False]))
    assert dropped["class_label"].tolist() == [3, 1000, 7]

    pipe = zoo.build_pipeline("pixart")
    uncond = conditioning.unconditional(pipe, pipe.transformer, family_of(pipe.transformer), 16, "cpu", torch.float32)
    _, _, negative, negative_mask = pipe.encode_prompt("a red cat", negative_prompt="", max_sequence_length=16)
    assert torch.equal(uncond["prompt_embeds"], negative) and torch.equal(uncond["prompt_attention_mask"], negative_mask)
    pipe.text_encoder.to(torch.bfloat16)  # encoded where training runs, in its dtype; the encoder stays where it was
    assert conditioning.unconditional(pipe, pipe.transformer, family_of(pipe.transformer), 16, "cpu", torch.float32)["prompt_embeds"].dtype == torch.float32
    assert pipe.text_encoder.device.type == "cpu" and pipe.text_encoder.dtype == torch.float32
    embeds, mask = conditioning.encode_text(pipe, ["a red cat", "a small house"], 16, "cpu")
    batch = {"prompt_embeds": embeds, "prompt_attention_mask": mask, "latents_mean": torch.zeros(2, 4, 8, 8)}
    dropped = conditioning.drop_conditioning(batch, uncond, torch.tensor([True, False]))
    assert torch.equal(dropped["prompt_embeds"][0], negative[0]) and torch.equal(dropped["prompt_embeds"][1], embeds[1])
    assert torch.equal(dropped["prompt_attention_mask"][0], negative_mask[0]) and dropped["latents_mean"] is batch["latents_mean"]
    with pytest.raises(ValueError, match="set max_sequence_length to the one the latent cache was made with"):
        conditioning.drop_conditioning(batch, conditioning.unconditional(pipe, pipe.transformer, family_of(pipe.transformer),
                                                                         8, "cpu", torch.float32), torch.tensor([True, False]))
    with pytest.raises(ValueError, match="a bare transformer has no text encoder"):
        conditioning.unconditional(None, pipe.transformer, family_of(pipe.transformer), 16, "cpu", torch.float32)


def test_guided_target_and_the_unconditional_branch_is_trained(tmp_path):
    """The guided target is uncond + s (cond - uncond) on the predicted channels (DiT's learned variance stays
    the conditional one) with the teacher's taps on the conditional pass; and distilling on null-class
    samples, as the recipe does, brings the converted student's null-class prediction toward the teacher's."""
    zoo.build_pipeline("dit").save_pretrained(tmp_path / "original")
    cfg = load_config(None, {"pretrained": str(tmp_path / "original"), "train_mode": "full"})
    _, student, fam = model.load_model(cfg)
    teacher = distill.build_teacher(student, model.frozen_parameter_ids(student, cfg))
    model.convert_model(student, model.mhla_config(student, cfg, (4, 8, 8)))
    params = model.set_trainable(student, cfg)
    uncond = conditioning.unconditional(None, student, fam, 0, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    xt, t = torch.randn(8, 4, 8, 8, generator=gen), torch.randint(0, 1000, (8,), generator=gen)
    batch = {"class_label": torch.arange(8)}
    null_inputs = fam.transformer_inputs(student, xt, t, conditioning.drop_conditioning(batch, uncond, torch.ones(8, dtype=torch.bool)))
    inputs = fam.transformer_inputs(student, xt, t, batch)

    tap = distill.AttentionTap(teacher, [0, 1])
    with torch.no_grad():
        null, cond = (model_output(teacher(**x, return_dict=False)) for x in (null_inputs, inputs))
        cond_attention = dict(tap.outputs)  # the last pass's
        guided = distill.teacher_prediction(teacher, inputs, null_inputs, 3.0)
    assert torch.allclose(guided[:, :4], null[:, :4] + 3.0 * (cond[:, :4] - null[:, :4])) and torch.equal(guided[:, 4:], cond[:, 4:])
    assert all(torch.equal(tap.outputs[i], cond_attention[i]) for i in (0, 1))

    def null_error():
        with torch.no_grad():
            return (model_output(student(**null_inputs, return_dict=False)) - null).pow(2).mean().item()

    before = null_error()
    optimizer = torch.optim.Adam(params, lr=1e-3)
    student.train()
    for step in range(20):
        drop = torch.rand(8, generator=gen) < 0.5
        x = fam.transformer_inputs(student, xt, t, conditioning.drop_conditioning(batch, uncond, drop))
        with torch.no_grad():
            target = distill.teacher_prediction(teacher, x)
        loss = distill.distill_loss(model_output(student(**x, return_dict=False)), target, None, None, 1.0, 0.0)["distill_output"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    student.eval()
    assert null_error() < 0.5 * before


def test_the_teacher_only_overlay_layers_on_every_shipped_config():
    """--config FAMILY.yaml --config teacher_only.yaml: the overlay's keys win, the family's others stay."""
    bases = [p for p in sorted((REPO / "recipes" / "configs").glob("*.yaml")) if p != OVERLAY]
    assert len(bases) >= 7
    for base in bases:
        alone, layered = load_config(base), load_config([base, OVERLAY])
        assert (layered.data_dir, layered.distill_output, layered.uncond_prob) == ("data/teacher_samples", 1.0, 0.1)
        assert (layered.pretrained, layered.learning_rate, layered.mhla_blocks) == (alone.pretrained, alone.learning_rate, alone.mhla_blocks)
