"""Wan's family members: Wan2.2 TI2V-5B and the two-expert A14B pipelines (variants of `wan`), and the
Wan-derived families SkyReels-V2 (`families/skyreels.py`) and Wan-VACE (`families/vace.py`).

Conversion of every self-attention layer (and every expert), a forward at two sizes, save/reload
through plain diffusers and `md.from_pretrained`, the CLI (`convert`, `info`), the real configs of
`bench model`, and the recipe training one expert.
"""

import json

import numpy as np
import pytest
import torch

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.cli import main
from mhla_diffusion.cli.demo import sample
from mhla_diffusion.conversion import converted_indices, mhla_modules
from mhla_diffusion.families import default_grid, family_of, real_model, self_attentions

from dense import dense_mhla


def video_inputs(model, size, frames, batch=1, seed=0):
    """Transformer kwargs of a (frames, h, w) latent from the model's own config (VACE: a control video too)."""
    h, w = size
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    kw = dict(hidden_states=torch.randn(batch, cfg.in_channels, frames, h, w, generator=g), timestep=torch.tensor([500] * batch),
              encoder_hidden_states=torch.randn(batch, 5, cfg.text_dim, generator=g))
    if "vace_in_channels" in cfg:
        kw["control_hidden_states"] = torch.randn(batch, cfg.vace_in_channels, frames, h, w, generator=g)
    return kw


def forward(model, size, frames, **kw):
    return model(**video_inputs(model, size, frames, **kw), return_dict=False)[0]


def check_converts_runs_two_sizes_and_reloads(name, tmp_path):
    """Every self-attention layer converted; forwards at two sizes; the saved dir reloads exactly."""
    model = zoo.build_transformer(name)
    before = forward(model, (8, 8), 3)
    md.convert(model)
    assert len(mhla_modules(model)) == len(self_attentions(model)) and converted_indices(model) == list(range(len(self_attentions(model))))
    out = forward(model, (8, 8), 3)
    assert out.shape == before.shape and torch.isfinite(out).all() and not torch.allclose(out, before)
    other = forward(model, (12, 16), 5)
    assert other.shape[-3:] == (5, 12, 16) and torch.isfinite(other).all()
    with torch.no_grad():
        for p in md.mhla_parameters(model):
            p.add_(torch.randn_like(p))
    expected = forward(model, (12, 16), 5)
    model.save_pretrained(tmp_path / "t")
    torch.testing.assert_close(forward(md.from_pretrained(tmp_path / "t"), (12, 16), 5), expected, rtol=0, atol=0)
    return model


def check_pipeline_roundtrip_and_cli(name, tmp_path, capsys, experts=("transformer",), sampling=True):
    """The tiny pipeline samples after conversion; plain diffusers and md reload it as MHLA; the CLI converts
    the saved original and `info` reports every expert converted. `sampling=False`: the CLI part only (a
    family's sampling and reload are in the family-parametrized tests of test_pipelines_cli/test_model_contract)."""
    pipe = zoo.build_pipeline(name)
    pipe.save_pretrained(tmp_path / "original")
    if sampling:
        check_samples_and_reloads(pipe, tmp_path, experts)
    assert main(["convert", str(tmp_path / "original"), str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out
    assert all(f"{e} (MHLA" in out for e in experts)
    assert main(["info", str(tmp_path / "cli"), "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert sorted(models) == sorted(experts) and all(m["converted"] for m in models.values())
    return pipe


def check_samples_and_reloads(pipe, tmp_path, experts):
    import diffusers

    pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe.transformer).name
    before = sample(pipe, family, seed=0, steps=2)
    md.convert(pipe)
    assert all(md.is_converted(getattr(pipe, e)) for e in experts)
    after = sample(pipe, family, seed=0, steps=2)
    assert after.shape == before.shape and np.isfinite(after).all() and not np.allclose(after, before)
    pipe.save_pretrained(tmp_path / "mhla")
    for load in (diffusers.DiffusionPipeline.from_pretrained, md.from_pretrained):
        loaded = load(tmp_path / "mhla")
        loaded.set_progress_bar_config(disable=True)
        np.testing.assert_array_equal(sample(loaded, family, seed=0, steps=2), after)


# --- Wan2.2 TI2V-5B: the 48-channel latent, its VAE and default size


def test_ti2v_converts_every_layer_runs_at_two_sizes_and_reloads(tmp_path):
    model = check_converts_runs_two_sizes_and_reloads("wan2.2-ti2v", tmp_path)
    assert model.config.in_channels == model.config.out_channels == 48
    # its default size is the released 704 x 1280 x 121 frames: the auto blocks live on that token grid
    assert default_grid(model) == ((31, 22, 40), "704 x 1280 x 121 frames")
    assert md.from_pretrained(tmp_path / "t").config["mhla"]["mix_blocks"] == list(md.auto_blocks((31, 22, 40)))


def test_ti2v_pipeline_has_the_wan22_vae_and_round_trips_through_the_cli(tmp_path, capsys):
    pipe = check_pipeline_roundtrip_and_cli("wan2.2-ti2v", tmp_path, capsys)
    assert (pipe.vae.config.z_dim, pipe.vae.config.scale_factor_spatial, pipe.vae.config.scale_factor_temporal) == (48, 16, 4)
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None


def test_a14b_pipeline_converts_both_experts():
    pipe = zoo.build_pipeline("wan2.2-a14b")
    assert pipe.config.boundary_ratio == 0.875 and type(pipe.transformer_2) is type(pipe.transformer)
    assert not torch.equal(pipe.transformer.blocks[0].attn1.to_q.weight, pipe.transformer_2.blocks[0].attn1.to_q.weight)
    md.convert(pipe)
    assert [len(mhla_modules(t)) for t in (pipe.transformer, pipe.transformer_2)] == [2, 2]
    # save/reload and the CLI of both experts: test_model_contract.py::test_every_transformer_of_a_pipeline_converts...


def test_a14b_i2v_pipeline_converts_both_experts_and_plain_diffusers_reloads_them(tmp_path):
    """Wan2.2 I2V-A14B's layout: two 36-channel experts (latent + mask + image latent), no image encoder."""
    import diffusers
    from PIL import Image

    from mhla_diffusion.families.wan import tiny_text_encoder, tiny_vae

    experts = [zoo.build_transformer("wan", seed=s, in_channels=36) for s in (0, 1)]
    pipe = diffusers.WanImageToVideoPipeline(zoo.tiny_tokenizer(), tiny_text_encoder(), tiny_vae(),
                                             diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=experts[0],
                                             transformer_2=experts[1], boundary_ratio=0.9)
    pipe.set_progress_bar_config(disable=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    call = lambda p: p(image=image, prompt="a red cat", max_sequence_length=16, height=32, width=32, num_frames=5,  # noqa: E731
                       num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).frames[0]
    md.convert(pipe)
    assert md.is_converted(pipe.transformer) and md.is_converted(pipe.transformer_2)
    expected = call(pipe)
    pipe.save_pretrained(tmp_path)
    loaded = diffusers.DiffusionPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.transformer_2).__name__ == "MHLAWanTransformer3DModel"
    np.testing.assert_array_equal(call(loaded), expected)


def test_wan22_real_configs_are_the_published_ones():
    _, ti2v = real_model("wan2.2-ti2v-5b")
    cfg = ti2v.config
    assert (cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["num_layers"], cfg["ffn_dim"]) == (3072, 30, 14336)
    assert (cfg["in_channels"], cfg["out_channels"], ti2v.vae_factor, ti2v.temporal_factor) == (48, 48, 16, 4)
    assert ti2v.latent_shape(ti2v.resolution, ti2v.frames) == (48, 31, 44, 80)  # 31 x 22 x 40 = 27,280 tokens
    _, a14b = real_model("wan2.2-t2v-a14b")
    assert a14b.config == real_model("wan2.1-14b")[1].config  # each expert is Wan2.1-14B's transformer
    with torch.device("meta"):
        params = sum(p.numel() for p in zoo.build_transformer("wan2.2-ti2v-5b", device="meta").parameters())
    assert 4.9e9 < params < 5.1e9


@pytest.mark.parametrize("name,layer", [("wan2.2-ti2v", 0), ("skyreels", 0), ("vace", 0), ("vace", -1)])
def test_wan_processor_matches_the_dense_formula(name, layer):
    """fp64: the converted layer (VACE: a main block's and a control block's) is the dense MHLA formula."""
    check_dense(zoo.build_transformer(name).double(), lambda m: self_attentions(m)[layer])


def check_dense(model, pick, blocks=(1, 2, 2), frames=2, size=(4, 4)):
    md.convert(model, md.default_config(model, blocks=blocks))
    attn = pick(model)
    seen = {}
    attn.register_forward_hook(lambda m, a, out: seen.update(x=a[0], rope=a[3], out=out))
    kw = {k: v.double() if v.is_floating_point() else v for k, v in video_inputs(model, size, frames).items()}
    model(**kw)
    x, rope = seen["x"], seen["rope"]
    heads = attn.heads
    q, k, v = (attn.norm_q(attn.to_q(x)), attn.norm_k(attn.to_k(x)), attn.to_v(x))
    q, k, v = (t.unflatten(2, (heads, -1)) for t in (q, k, v))
    grid = (frames, size[0] // 2, size[1] // 2)
    o = dense_mhla(q, k, v, attn.processor.mixing(blocks).double(), grid, blocks, normalize=False, rope=rope)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.processor.norm_gain
    torch.testing.assert_close(seen["out"], attn.to_out[0](o.flatten(2)), rtol=1e-6, atol=1e-8)


# --- the recipe: one expert of a two-expert pipeline per run


def test_expert_noise_levels_and_refusals(tmp_path):
    from mhla_diffusion.training import model as recipe_model
    from mhla_diffusion.training.objectives import FlowMatchingObjective
    from mhla_diffusion.training.train_config import TrainConfig

    pipe = zoo.build_pipeline("wan2.2-a14b")
    high, low = (TrainConfig(pretrained="x", component=c) for c in ("transformer", "transformer_2"))
    assert recipe_model.expert_sigmas(pipe, high) == (0.875, 1.0) and recipe_model.expert_sigmas(pipe, low) == (0.0, 0.875)
    assert recipe_model.expert_sigmas(zoo.build_pipeline("wan"), high) is None
    torch.manual_seed(0)
    sigmas = FlowMatchingObjective(12.0, 0.0, 1.0, sigma_range=(0.0, 0.875)).noisy(torch.zeros(4096, 1)).t
    assert 0 <= sigmas.min() and sigmas.max() < 0.875

    pipe.register_modules(transformer=md.convert(pipe.transformer))  # the high-noise expert trained already
    pipe.save_pretrained(tmp_path / "half")
    loaded, transformer, _ = recipe_model.load_model(TrainConfig(pretrained=str(tmp_path / "half"), component="transformer_2"))
    assert transformer is loaded.transformer_2 and not md.is_converted(transformer) and md.is_converted(loaded.transformer)
    with pytest.raises(ValueError, match="already converted"):
        recipe_model.load_model(TrainConfig(pretrained=str(tmp_path / "half")))
    zoo.build_transformer("wan").save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="bare transformer"):
        recipe_model.load_model(TrainConfig(pretrained=str(tmp_path / "bare"), component="transformer_2"))


def test_recipe_trains_the_low_noise_expert_of_a_pipeline_whose_other_expert_is_converted(tmp_path):
    """`--component transformer_2` from a pipeline whose `transformer` is MHLA already: both are MHLA after,
    the trained expert's MHLA parameters moved, the other expert is saved as it was; validation samples run
    both experts, and a latent cache of the two-expert pipeline loads neither."""
    from safetensors.torch import load_file

    from test_recipes import COMMON, launch, noise_image, write_metadata

    pipe = zoo.build_pipeline("wan2.2-a14b")
    pipe.register_modules(transformer=md.convert(pipe.transformer))
    pipe.save_pretrained(tmp_path / "half")
    rng = np.random.default_rng(0)
    for i in range(2):
        (tmp_path / "videos" / f"clip{i}").mkdir(parents=True)
        for f in range(5):
            noise_image(rng, (32, 32)).save(tmp_path / "videos" / f"clip{i}" / f"{f:03d}.png")
    write_metadata(tmp_path / "videos", [(f"clip{i}", "a cat on a tree") for i in range(2)])
    out = tmp_path / "out"
    launch("train.py", "--pretrained", tmp_path / "half", "--component", "transformer_2", "--data_dir", tmp_path / "videos",
           "--resolution", "[32, 32]", "--num_frames", "5", "--train_mode", "mhla", "--mhla_blocks", "1,2,2",
           "--learning_rate", "1e-2", "--train_batch_size", "2", "--max_steps", "2", "--output_dir", out,
           "--validation_steps", "2", "--validation_prompts", '["a red cat"]', "--validation_inference_steps", "2", *COMMON)
    assert (out / "samples" / "step-0000002" / "00.mp4").is_file() and (out / "samples" / "step-0000002" / "grid.png").is_file()
    launch("precompute.py", "--pretrained", tmp_path / "half", "--component", "transformer_2", "--data_dir",
           tmp_path / "videos", "--resolution", "[32, 32]", "--num_frames", "5", "--train_batch_size", "2",
           "--out", tmp_path / "cache", *COMMON)
    assert json.loads((tmp_path / "cache" / "cache.json").read_text())["samples"] == 2
    weights = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}  # noqa: E731
    index = json.loads((out / "final" / "model_index.json").read_text())
    assert index["transformer"] == index["transformer_2"] == ["mhla_diffusion", "MHLAWanTransformer3DModel"]
    before, after = weights(tmp_path / "half" / "transformer_2"), weights(out / "final" / "transformer_2")
    changed = {k for k in after if k not in before or not torch.equal(before[k], after[k])}
    assert changed and all(".processor." in k for k in changed)
    high_before, high_after = weights(tmp_path / "half" / "transformer"), weights(out / "final" / "transformer")
    assert high_before.keys() == high_after.keys() and all(torch.equal(high_before[k], high_after[k]) for k in high_before)
    final = md.from_pretrained(out / "final")
    assert md.is_converted(final.transformer) and md.is_converted(final.transformer_2)


# --- SkyReels-V2: Wan's blocks, processor and variant


def test_skyreels_converts_every_layer_runs_at_two_sizes_and_reloads(tmp_path):
    model = check_converts_runs_two_sizes_and_reloads("skyreels", tmp_path)
    assert type(model).__name__ == "MHLASkyReelsV2Transformer3DModel"
    assert default_grid(model) == ((25, 34, 60), "544 x 960 x 97 frames")
    cfg = md.persistence.stored_config(tmp_path / "t")
    assert (cfg.normalize, cfg.output_norm) == (False, True)  # the released Wan variant


def test_skyreels_pipeline_through_the_cli(tmp_path, capsys):
    pipe = check_pipeline_roundtrip_and_cli("skyreels", tmp_path, capsys, sampling=False)
    assert type(pipe).__name__ == "SkyReelsV2Pipeline"


def test_skyreels_diffusion_forcing_mask_is_refused_and_the_fps_embedding_is_fed():
    model = zoo.build_transformer("skyreels", num_frame_per_block=2)  # diffusion forcing: frame-causal mask
    md.convert(model)
    with pytest.raises(ValueError, match="diffusion forcing"):
        forward(model, (4, 4), 4)
    model = zoo.build_transformer("skyreels", inject_sample_info=True)  # DF checkpoints embed the fps
    md.convert(model)
    inputs = family_of(model).example_inputs(model, (16, 3, 4, 4), 2)  # as `bench model` builds them
    assert inputs["fps"] == [1, 1] and torch.isfinite(model(**inputs, return_dict=False)[0]).all()


def test_skyreels_real_configs():
    _, df = real_model("skyreels-v2-df-1.3b-540p")
    assert (df.config["num_attention_heads"], df.config["num_layers"], df.config["inject_sample_info"]) == (12, 30, True)
    assert df.latent_shape(df.resolution, df.frames) == (16, 25, 68, 120)
    _, t2v = real_model("skyreels-v2-t2v-14b-720p")
    assert t2v.config == real_model("wan2.1-14b")[1].config and t2v.latent_shape(t2v.resolution, t2v.frames) == (16, 31, 90, 160)


# --- Wan-VACE: main blocks and control blocks


def test_vace_converts_main_and_control_blocks_runs_at_two_sizes_and_reloads(tmp_path):
    model = check_converts_runs_two_sizes_and_reloads("vace", tmp_path)
    paths = family_of(model).self_attention_paths(dict(model.config))
    assert paths == ["blocks.0.attn1", "blocks.1.attn1", "blocks.2.attn1", "blocks.3.attn1", "vace_blocks.0.attn1",
                     "vace_blocks.1.attn1"]
    assert sorted(mhla_modules(md.from_pretrained(tmp_path / "t"))) == sorted(f"{p}.processor" for p in paths)


def test_vace_control_blocks_can_keep_softmax():
    """layers count the main blocks first: 0..3 converts them and leaves the control blocks as they were."""
    model = zoo.build_transformer("vace")
    original = type(model.vace_blocks[0].attn1.processor)
    md.convert(model, md.default_config(model, layers=[0, 1, 2, 3]))
    assert converted_indices(model) == [0, 1, 2, 3] and all(type(b.attn1.processor) is original for b in model.vace_blocks)
    assert torch.isfinite(forward(model, (8, 8), 3)).all()


def test_vace_pipeline_through_the_cli(tmp_path, capsys):
    pipe = check_pipeline_roundtrip_and_cli("vace", tmp_path, capsys, sampling=False)
    assert type(pipe).__name__ == "WanVACEPipeline"
    assert main(["info", str(tmp_path / "cli"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["models"]["transformer"]
    assert info["converted_layers"] == list(range(6)) and "vace_blocks.1.attn1" in info["mhla_layers"]


def test_vace_training_needs_a_control_video_and_bench_feeds_one():
    model = zoo.build_transformer("vace")
    fam = family_of(model)
    x = torch.randn(1, 16, 3, 8, 8)
    with pytest.raises(ValueError, match="control_hidden_states"):
        fam.transformer_inputs(model, x, torch.tensor([500]), {"prompt_embeds": torch.randn(1, 5, 16)})
    inputs = fam.example_inputs(model, (16, 3, 8, 8), 1)
    assert inputs["control_hidden_states"].shape == (1, 96, 3, 8, 8)
    assert torch.isfinite(model(**inputs, return_dict=False)[0]).all()


def test_vace_real_configs():
    for name, layers, control in (("wan2.1-vace-1.3b", 30, 15), ("wan2.1-vace-14b", 40, 8)):
        _, real = real_model(name)
        base = real_model(name.replace("vace-", ""))[1].config
        assert {k: v for k, v in real.config.items() if not k.startswith("vace_")} == base
        assert (real.config["num_layers"], len(real.config["vace_layers"]), real.config["vace_in_channels"]) == (layers, control, 96)


def test_vace_samples_one_prompt_per_call_and_transfer_fits_its_control_blocks(tmp_path, capsys):
    from mhla_diffusion.evaluation.sampling import SamplingSettings, call_kwargs

    pipe = zoo.build_pipeline("vace")
    settings = SamplingSettings(prompts=["a red cat", "a blue dog"], seed=3)
    kwargs = call_kwargs(pipe, [1], settings)
    assert kwargs["prompt"] == "a blue dog" and kwargs["generator"].initial_seed() == 4
    with pytest.raises(ValueError, match="batch size 1"):
        call_kwargs(pipe, [0, 1], settings)
    pipe.save_pretrained(tmp_path / "src")
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    assert main(["transfer", str(tmp_path / "src"), str(tmp_path / "dst"), "--prompts", str(tmp_path / "prompts.txt"),
                 "--num-samples", "1", "--batch-size", "1", "--steps-per-layer", "2", "--steps", "2", "--height", "32",
                 "--width", "32", "--num-frames", "5"]) == 0
    assert "transformer/vace_blocks.1.attn1" in capsys.readouterr().out
    assert converted_indices(md.from_pretrained(tmp_path / "dst").transformer) == list(range(6))
