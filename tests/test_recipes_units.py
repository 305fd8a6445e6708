"""Recipe pieces in-process: config errors, bad inputs caught before training, objectives,
what LoRA trains, precompute's skip count, and an overfit run of the real loop."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mhla_diffusion import zoo
from mhla_diffusion.conversion import convert, default_config, mhla_modules
from mhla_diffusion.training import model, objectives
from mhla_diffusion.training.train_config import load_config, parse_overrides

REPO = Path(__file__).resolve().parents[1]


def recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def sana_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sana") / "pipe"
    zoo.build_pipeline("sana").save_pretrained(path)
    return path


@pytest.fixture
def one_image(tmp_path):
    data = tmp_path / "one"
    data.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(data / "a.png")
    (data / "bad.png").write_bytes(b"garbage")
    (data / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "a red cat"}) + "\n"
                                         + json.dumps({"file_name": "bad.png", "text": "a dog"}))
    return data


def test_unknown_keys_are_named(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pretrained: x\nlearning_rat: 0.1\n")
    with pytest.raises(ValueError, match=r"'learning_rat' \(did you mean 'learning_rate'\?\)"):
        load_config(cfg)
    with pytest.raises(ValueError, match="unknown config key.*'bogus'"):
        load_config(None, parse_overrides(["--pretrained", "x", "--bogus", "1"]))
    with pytest.raises(ValueError, match="train_mode must be one of"):
        load_config(None, {"pretrained": "x", "train_mode": "half"})
    c = load_config(None, parse_overrides(["--pretrained=x", "--learning_rate", "1e-4", "--resolution", "[32, 64]"]))
    assert c.learning_rate == 1e-4 and c.resolution == [32, 64]
    assert load_config(None, parse_overrides(["--overwrite_output_dir", "--pretrained", "x"])).overwrite_output_dir
    with pytest.raises(ValueError, match="--train_mode needs a value"):
        parse_overrides(["--train_mode", "--pretrained", "x"])
    with pytest.raises(ValueError, match="resume continues the run in output_dir and overwrite_output_dir deletes it"):
        load_config(None, parse_overrides(["--pretrained", "x", "--resume", "latest", "--overwrite_output_dir"]))
    guidance = {"pretrained": "x", "distill_output": "1.0"}
    for bad, message in [({"uncond_prob": "1.5"}, r"uncond_prob is the fraction .*give a value in \[0, 1\], got 1.5"),
                         ({"distill_guidance_scale": "0.5"}, r"distill_guidance_scale must be >= 1 \(1: the teacher's unguided"),
                         ({"distill_guidance_scale": "3", "distill_output": "0"}, "set distill_output > 0, or distill_guidance_scale 1"),
                         ({"distill_guidance_scale": "3", "validation_steps": "10"}, "samples at guidance 1: set validation_guidance_scale 1")]:
        with pytest.raises(ValueError, match=message):
            load_config(None, {**guidance, **bad})


def test_bad_yaml_is_a_one_line_value_error(tmp_path):
    """A YAML syntax error in the config file or in a list/dict override names where it is."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pretrained: x\nresolution: [32, 64\n")
    with pytest.raises(ValueError, match=r"c\.yaml is not valid YAML: .*line 3") as err:
        load_config(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"config key 'resolution': cannot read '\[32,' as list"):
        load_config(None, parse_overrides(["--pretrained", "x", "--resolution", "[32,"]))


def test_all_shipped_configs_load():
    overlay = REPO / "recipes" / "configs" / "teacher_only.yaml"  # layered on a family's config, not alone
    for path in sorted((REPO / "recipes" / "configs").glob("*.yaml")):
        assert load_config([path, overlay] if path != overlay else path, {"pretrained": "x"} if path == overlay else {}).pretrained


def test_layered_configs_name_the_file_of_a_bad_key(tmp_path):
    base, overlay = tmp_path / "base.yaml", tmp_path / "overlay.yaml"
    base.write_text("pretrained: x\nlearning_rate: 1.0e-4\n")
    overlay.write_text("learning_rate: 2.0e-5\nbogus: 1\n")
    with pytest.raises(ValueError, match=r"overlay\.yaml.*'bogus'|'bogus'.*overlay\.yaml"):
        load_config([base, overlay])
    overlay.write_text("learning_rate: 2.0e-5\n")
    assert load_config([base, overlay]).learning_rate == 2e-5 and load_config([overlay, base]).learning_rate == 1e-4


def test_bad_inputs_fail_before_training(tmp_path, sana_dir, one_image):
    train = recipe("train")
    base = ["--pretrained", str(sana_dir), "--output_dir", str(tmp_path / "out"), "--resolution", "32", "--num_workers", "0"]
    with pytest.raises(FileNotFoundError, match="data_dir"):
        train.main([*base, "--data_dir", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="does not match"):
        train.main([*base, "--data_dir", str(one_image), "--family", "wan"])
    from diffusers import UNet2DModel

    UNet2DModel(sample_size=8, block_out_channels=(8, 8), norm_num_groups=4, layers_per_block=1,
                down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D")).save_pretrained(tmp_path / "unet")
    with pytest.raises(ValueError, match="unsupported model class UNet2DModel"):
        train.main([*base, "--pretrained", str(tmp_path / "unet"), "--data_dir", str(one_image)])
    ckpt = tmp_path / "out" / "checkpoints" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    (ckpt / "progress.json").write_text('{"step": 5, "epoch": 0, "batches_in_epoch": 5}')
    (ckpt / "train_config.yaml").write_text(f"pretrained: {sana_dir}\ntrain_mode: lora\n")
    with pytest.raises(ValueError, match="different recipe.*train_mode"):
        train.main([*base, "--data_dir", str(one_image), "--resume", "latest"])


def test_context_parallel_refusals(tmp_path, sana_dir, one_image):
    """What context_parallel does not do fails at once with the reason (one process here)."""
    train = recipe("train")
    base = ["--pretrained", str(sana_dir), "--output_dir", str(tmp_path / "out"), "--data_dir", str(one_image),
            "--resolution", "32", "--num_workers", "0", "--context_parallel", "2"]
    with pytest.raises(ValueError, match="context_parallel 2 needs exactly 2 processes, got 1"):
        train.main(base)
    with pytest.raises(ValueError, match="does not support validation samples"):
        train.main([*base, "--validation_steps", "1", "--validation_prompts", '["a cat"]'])
    with pytest.raises(ValueError, match="does not support per-layer distillation"):
        train.main([*base, "--distill_layers", "1.0"])
    with pytest.raises(ValueError, match="does not support partly converted models"):
        train.main([*base, "--mhla_layers", "hybrid:2"])
    with pytest.raises(ValueError, match="context_parallel must be >= 0"):
        load_config(None, {"pretrained": "x", "context_parallel": -1})


def test_lora_trains_only_lora_and_mhla_parameters():
    transformer = zoo.build_transformer("dit")  # DiT has no add_adapter: the inject path
    convert(transformer, default_config(transformer, blocks=(1, 2, 2)))
    cfg = load_config(None, {"pretrained": "x", "train_mode": "lora", "lora_rank": 2})
    params = {id(p) for p in model.set_trainable(transformer, cfg)}
    names = {n for n, p in transformer.named_parameters() if id(p) in params}
    assert names and all("lora_" in n or ".processor." in n for n in names)
    assert {id(p) for m in mhla_modules(transformer).values() for p in m.parameters()} <= params
    assert {t for n in names if "lora_A" in n for t in ("to_q", "to_k", "to_v", "to_out") if t in n} == {"to_q", "to_k", "to_v", "to_out"}
    model.merge_lora(transformer)
    assert not any("lora_" in n for n, _ in transformer.named_parameters())


def test_ddpm_vlb_is_zero_for_the_true_posterior():
    """With the true noise and v = -1 (the posterior variance), KL = 0 and the epsilon MSE = 0."""
    obj = objectives.DDPMObjective({"num_train_timesteps": 1000, "beta_schedule": "linear"}, learned_variance=True)
    x0 = torch.randn(4, 2, 3, 3).clamp(-0.9, 0.9)
    torch.manual_seed(0)
    nb = obj.noisy(x0)
    nb.t = nb.timestep = torch.tensor([1, 10, 500, 999])
    nb.model_input = obj._at("sqrt_ab", nb.t, x0) * x0 + obj._at("sqrt_1m_ab", nb.t, x0) * nb.target
    perfect = torch.cat([nb.target, -torch.ones_like(x0)], dim=1)
    assert obj.loss(perfect, nb).item() == pytest.approx(0.0, abs=1e-6)
    worse = torch.cat([nb.target, torch.ones_like(x0)], dim=1)
    assert obj.loss(worse, nb).item() > 1e-3


def test_flow_matching_target_and_timesteps():
    obj = objectives.FlowMatchingObjective(shift=3.0, logit_mean=0.0, logit_std=1.0)
    x0 = torch.randn(256, 2, 2, 2)
    nb = obj.noisy(x0)
    noise = nb.target + x0
    s = nb.t.view(-1, 1, 1, 1)
    torch.testing.assert_close(nb.model_input, (1 - s) * x0 + s * noise)
    assert torch.allclose(nb.timestep, nb.t * 1000) and 0 < nb.t.min() and nb.t.max() < 1
    assert nb.t.median() > 0.6  # shift 3 moves the logit-normal median 0.5 to 0.75
    assert obj.loss(nb.target, nb).item() == 0.0


def test_precompute_skips_and_counts_unreadable(tmp_path, sana_dir, one_image):
    from accelerate import Accelerator

    from mhla_diffusion.training.precompute import precompute

    cfg = load_config(None, {"pretrained": str(sana_dir), "data_dir": str(one_image), "resolution": 32, "num_workers": 0,
                             "max_unreadable": 0.5})
    info = precompute(cfg, tmp_path / "cache", Accelerator(cpu=True))
    assert (info["samples"], info["unreadable"]) == (1, 1)
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1


def test_overfit_one_batch_loss_falls(tmp_path, sana_dir, one_image):
    """The real loop on one fixed sample: the flow-matching loss drops well below its start."""
    out = tmp_path / "overfit"
    recipe("train").main(["--pretrained", str(sana_dir), "--data_dir", str(one_image), "--resolution", "32",
                          "--max_steps", "60", "--learning_rate", "3e-3", "--num_workers", "0", "--checkpointing_steps", "1000",
                          "--max_unreadable", "0.5",
                          "--output_dir", str(out), "--logit_std", "0.1", "--flow_shift", "1.0"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = []
    for events in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        losses += [e.value for e in acc.Scalars("loss")] if "loss" in acc.Tags()["scalars"] else []
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:10])


def test_mhla_learning_rate_moves_the_mixing_matrices_further():
    """The recipe's optimizer groups: MHLA parameters at mhla_learning_rate, by default (0) at M x
    learning_rate. A logit moves about its rate per AdamW step, so at the base rate the matrix stays at
    its init, the default moves it M times as far (M = 4 blocks here) and 1e-2 further still."""
    from test_convert import run

    drift = {}
    for mhla_lr, rate in ((1e-4, 1e-4), (0.0, 4e-4), (1e-2, 1e-2)):
        torch.manual_seed(0)
        transformer = zoo.build_transformer("dit")
        convert(transformer, default_config(transformer, blocks=(1, 2, 2)))
        cfg = load_config(None, {"pretrained": "x", "learning_rate": 1e-4, "mhla_learning_rate": mhla_lr})
        params = model.set_trainable(transformer, cfg)
        groups = model.param_groups(transformer, params, cfg.learning_rate, cfg.mhla_learning_rate)
        assert [g["lr"] for g in groups] == pytest.approx([1e-4] if rate == 1e-4 else [1e-4, rate])
        logits = {id(p) for proc in model.mhla_modules(transformer).values() for p in proc.mixing.parameters()}
        assert rate == 1e-4 or {id(p) for p in groups[1]["params"]} == logits
        opt = torch.optim.AdamW(groups, weight_decay=0.0)
        for step in range(20):
            opt.zero_grad()
            run(transformer.train(), 8, seed=step).square().mean().backward()
            opt.step()
        drift[rate] = model.mixing_drift(transformer)["mhla/mixing_change"]
    assert drift[1e-4] < 0.01 and 3 * drift[1e-4] < drift[4e-4] < drift[1e-2]


def test_train_help_lists_every_config_key_with_type_default_and_description():
    import subprocess
    import sys
    from dataclasses import fields

    from mhla_diffusion.training.train_config import TrainConfig

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "recipes" / "train.py"), "--help"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(root), "PATH": ""}, check=True).stdout
    for f in fields(TrainConfig):
        line = next(x for x in out.splitlines() if x.startswith(f"  --{f.name} ("))
        assert f"({f.type}, default " in line and not line.endswith(": -"), line
    assert "--mhla_learning_rate (float, default 0.0): the MHLA parameters' own rate" in out


def test_save_trained_writes_the_given_state_dict_into_the_pipeline(tmp_path):
    """The state dict is what the recipe gathered (under FSDP the module's own tensors are shards): a pipeline
    save must write it, not the module's parameters."""
    import mhla_diffusion as md

    pipe = zoo.build_pipeline("dit")
    convert(pipe)
    gathered = {k: v + 1.0 if v.is_floating_point() else v for k, v in pipe.transformer.state_dict().items()}
    model.save_trained(tmp_path / "final", pipe.transformer, gathered, pipe)
    saved = md.from_pretrained(tmp_path / "final").transformer.state_dict()
    assert all(torch.equal(saved[k], gathered[k]) for k in gathered)

def test_gpu_check_tiny_runs_every_variant(capsys):
    """The GPU check's code paths (data step, teacher-only distillation, attention transfer's pieces) on a CPU."""
    gpu_check = recipe("gpu_check")
    rows = gpu_check.main(["--preset", "tiny", "--steps", "1", "--warmup", "0", "--variants", ",".join(gpu_check.VARIANTS)])
    assert [r["variant"] for r in rows] == list(gpu_check.VARIANTS)
    assert all(r["step_s"] > 0 and np.isfinite(r["loss"]) for r in rows)
    assert "transfer at its defaults" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_check.main(["--preset", "tiny", "--variants", "mhla,teacher_only"])


def test_gpu_check_profile_says_where_a_training_step_goes(capsys):
    """`--profile`: one training step's ops by time under the variant's row (target 4 of the speed issue asks where
    the step's time goes): the forward and the backward both in it."""
    gpu_check = recipe("gpu_check")
    rows = gpu_check.main(["--preset", "tiny", "--steps", "1", "--warmup", "0", "--variants", "mhla", "--profile"])
    out = capsys.readouterr().out
    assert "-- mhla: one step --" in out and "per call: wall" in out
    assert "aten::linear" in rows[0]["profile"] and "Backward0" in rows[0]["profile"]


def test_attention_tap_keeps_the_forward_outputs_under_gradient_checkpointing():
    """The backward's recomputation (gradient checkpointing) must not replace what the tap kept: those outputs
    would hold every block's recomputed activations until the next step."""
    from mhla_diffusion.conversion import converted_indices
    from mhla_diffusion.families import family_of
    from mhla_diffusion.training import distill

    transformer = zoo.build_transformer("wan")
    convert(transformer, default_config(transformer, blocks=(1, 2, 2)))
    tap = distill.AttentionTap(transformer, converted_indices(transformer))
    transformer.train().enable_gradient_checkpointing()
    out = transformer(**family_of(transformer).example_inputs(transformer, (16, 3, 8, 8)), return_dict=False)[0]
    kept = dict(tap.outputs)
    (out.square().mean() + sum(t.square().mean() for t in kept.values())).backward()
    assert tap.outputs.keys() == kept.keys() and all(tap.outputs[i] is kept[i] for i in kept)


def test_a_checkpoint_older_than_a_resume_key_resumes_with_the_value_it_trained_with():
    """train_config.yaml of a run made before uncond_prob / distill_guidance_scale existed: those runs trained
    without unconditional samples and without a guided target; resuming says so instead of 'None'."""
    from mhla_diffusion.training.train_config import RESUME_KEYS, resume_mismatch, to_dict

    old = {k: v for k, v in to_dict(load_config(None, {"pretrained": "x"})).items()
           if k in RESUME_KEYS and k not in ("uncond_prob", "distill_guidance_scale")}
    assert resume_mismatch(load_config(None, {"pretrained": "x"}), old) == ["uncond_prob: 0.0 -> 0.1"]
    assert resume_mismatch(load_config(None, {"pretrained": "x", "uncond_prob": 0}), old) == []


def test_the_default_mhla_rate_scales_the_mixing_logits_only():
    """M x learning_rate is an argument about the row-softmax logits: an output gate (a dense layer) and the
    output norm's gains stay at learning_rate unless mhla_learning_rate names a rate for all of them."""
    transformer = zoo.build_transformer("dit")
    convert(transformer, default_config(transformer, blocks=(1, 2, 2), output_gate=True, output_norm=True))
    params = [p for p in transformer.parameters()]
    rate = {id(p): g["lr"] for g in model.param_groups(transformer, params, 1e-4) for p in g["params"]}
    for proc in model.mhla_modules(transformer).values():
        logits = {id(p) for p in proc.mixing.parameters()}
        others = [p for p in proc.parameters() if id(p) not in logits]
        assert others and all(rate[id(p)] == 1e-4 for p in others)
        assert all(rate[i] == pytest.approx(4e-4) for i in logits)
    rate = {id(p): g["lr"] for g in model.param_groups(transformer, params, 1e-4, 1e-2) for p in g["params"]}
    assert all(rate[id(p)] == 1e-2 for p in model.mhla_parameters(transformer))
