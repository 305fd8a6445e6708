"""SANA-Video (`SanaVideoTransformer3DModel`): its global linear attention as MHLA blocks over frames x rows x columns."""

import json

import numpy as np
import pytest
import torch

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.cli import main
from mhla_diffusion.cli.demo import sample
from mhla_diffusion.context_parallel import cp_plan
from mhla_diffusion.conversion import mhla_modules
from mhla_diffusion.families import default_grid, family_by_name, real_model

from dense import dense_mhla

FAMILY = "sana_video"


def inputs(frames=3, size=(8, 8), batch=1, dtype=torch.float32, seed=0):
    """Transformer kwargs: a (B, 16, F, H, W) latent and 5 text tokens of the tiny encoder's width 8."""
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 16, frames, *size, generator=g, dtype=dtype),
                timestep=torch.tensor([10, 500][:batch]),
                encoder_hidden_states=torch.randn(batch, 5, 8, generator=g, dtype=dtype), return_dict=False)


def run(model, **kw):
    return model(**inputs(dtype=model.dtype, **kw))[0]


def test_single_block_is_sana_videos_own_linear_attention_in_float64(monkeypatch):
    """blocks (1,1,1): MHLA is SANA-Video's processor (ReLU, RoPE on the numerator, un-rotated denominator,
    eps 1e-15). diffusers casts the numerator to fp32 (`.float()`) even in a float64 model: lifted, the
    two agree to float64 rounding; as shipped, to fp32 rounding."""
    model = zoo.build_transformer(FAMILY).double()
    shipped = run(model)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "float", lambda self: self if self.dtype == torch.float64 else self.to(torch.float32))
        exact = run(model)
    md.convert(model, md.default_config(model, blocks=(1, 1, 1)))
    assert type(model.transformer_blocks[0].attn1.processor).__name__ == "MHLASanaVideoAttnProcessor"
    out = run(model)
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-13)
    torch.testing.assert_close(out, shipped, rtol=0, atol=1e-6)


def test_processor_is_dense_mhla_with_rope_on_the_numerator():
    model = zoo.build_transformer(FAMILY).double()
    md.convert(model, md.default_config(model, blocks=(2, 2, 2)))
    attn = model.transformer_blocks[1].attn1
    with torch.no_grad():
        attn.processor.mixing.logits.normal_()  # a non-uniform mixing matrix
    seen = {}
    attn.register_forward_hook(lambda m, a, kw, out: seen.update(x=a[0], rope=kw["rotary_emb"], out=out), with_kwargs=True)
    run(model, frames=2, size=(8, 12))
    x, rope = seen["x"], seen["rope"]
    q, k = attn.norm_q(attn.to_q(x)), attn.norm_k(attn.to_k(x))  # RMSNorm across heads, before the head split
    q, k, v = (t.unflatten(2, (2, 12)) for t in (q, k, attn.to_v(x)))
    mix = attn.processor.mixing((2, 2, 2))
    o = dense_mhla(q, k, v, mix, (2, 4, 6), (2, 2, 2), eps=1e-15, rope=rope).flatten(2)
    torch.testing.assert_close(seen["out"], attn.to_out[0](o), rtol=1e-9, atol=1e-12)


def test_convert_forward_at_two_sizes_backward_save_reload(tmp_path):
    model = zoo.build_transformer(FAMILY)
    before = run(model)
    md.convert(model)
    assert sorted(mhla_modules(model)) == [f"transformer_blocks.{i}.attn1.processor" for i in range(2)]
    assert model.config["mhla"]["eps"] == 1e-15 and model.config["mhla"]["rope"] == "numerator"
    out = run(model)
    assert out.shape == before.shape == (1, 16, 3, 8, 8) and not torch.allclose(out, before)
    other = run(model, frames=5, size=(12, 16), batch=2)  # another frame count and size, no grid passed
    assert other.shape == (2, 16, 5, 12, 16) and torch.isfinite(other).all()
    assert model._mhla_token_grid.grid == (5, 6, 8)

    model.train()
    (run(model).square().mean() + run(model, frames=5, size=(12, 16)).square().mean()).backward()
    mixing = [p for n, p in model.named_parameters() if n.endswith(".mixing.logits")]
    assert len(mixing) == 2 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixing)
    with torch.no_grad():
        for p in mixing:
            p.add_(torch.randn_like(p))
    model.eval()
    expected = run(model, frames=5, size=(12, 16))
    model.save_pretrained(tmp_path)
    reloaded = md.from_pretrained(tmp_path)
    assert type(reloaded).__name__ == "MHLASanaVideoTransformer3DModel"
    torch.testing.assert_close(run(reloaded, frames=5, size=(12, 16)), expected, rtol=0, atol=0)


def test_family_grid_real_config_and_context_parallel_refusal():
    model = zoo.build_transformer(FAMILY)
    assert default_grid(model) == ((21, 30, 52), "480p x 81 frames")
    fam, real = real_model("sana-video-2b")
    assert fam is family_by_name("SanaVideoTransformer3DModel")
    assert real.latent_shape("480p", 81) == (16, 21, 60, 104)  # 21 x 30 x 52 = 32,760 tokens
    with pytest.raises(ValueError, match="Mix-FFN convolves"):
        cp_plan(model)


def test_pipeline_samples_after_conversion_and_cli_convert_info(tmp_path, capsys):
    pipe = zoo.build_pipeline(FAMILY)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == "SanaVideoPipeline" and type(pipe.vae).__name__ == "AutoencoderKLWan"
    before = sample(pipe, FAMILY, seed=0, steps=2)
    assert before.shape == (5, 64, 64, 3)  # frames=5: the pipeline's own name for the frame count
    pipe.save_pretrained(tmp_path / "pipe")
    assert main(["convert", str(tmp_path / "pipe"), str(tmp_path / "mhla"), "--blocks", "1,2,2", "--layers", "0"]) == 0
    assert "1 self-attention layer converted" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "mhla"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["models"]["transformer"]
    assert info["converted"] and info["converted_layers"] == [0] and info["mhla"]["blocks"] == [1, 2, 2]
    assert list(info["mhla_layers"]) == ["transformer_blocks.0.attn1"]
    loaded = md.from_pretrained(tmp_path / "mhla")
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.transformer.transformer_blocks[1].attn1.processor).__name__ == "SanaLinearAttnProcessor3_0"
    after = sample(loaded, FAMILY, seed=0, steps=2)
    assert after.shape == before.shape and np.isfinite(after).all() and not np.allclose(after, before)


def test_recipe_trains_mhla_on_video_clips(tmp_path):
    """`accelerate launch recipes/train.py` on SANA-Video: flow matching on frame folders and Gemma-2 text,
    full training of the converted model (the shipped recipe's mode), gradient checkpointing."""
    from test_recipes import COMMON, launch, noise_image, scalars, transformer_weights, write_metadata

    zoo.build_pipeline(FAMILY).save_pretrained(tmp_path / "pipe")
    rng = np.random.default_rng(0)
    videos = tmp_path / "videos"
    for i in range(2):
        (videos / f"clip{i}").mkdir(parents=True)
        for f in range(5):
            noise_image(rng, (32, 40)).save(videos / f"clip{i}" / f"{f:03d}.png")
    write_metadata(videos, [(f"clip{i}", "a cat on a tree") for i in range(2)])
    out = tmp_path / "out"
    launch("train.py", "--pretrained", tmp_path / "pipe", "--family", FAMILY, "--data_dir", videos, "--resolution", "[32, 32]",
           "--num_frames", "5", "--train_mode", "full", "--mhla_blocks", "1,2,2", "--objective", "flow", "--flow_shift", "8.0",
           "--learning_rate", "1e-2", "--train_batch_size", "2", "--max_steps", "2", "--gradient_checkpointing", "true",
           "--validation_steps", "2", "--validation_prompts", '["a red cat"]', "--validation_inference_steps", "2",
           "--output_dir", out, *COMMON)
    assert (out / "samples" / "step-0000002" / "00.mp4").is_file()  # the pipeline's own frame argument (`frames`)
    assert len(scalars(out, "loss")) == 2 and all(np.isfinite(scalars(out, "loss")))
    before, after = transformer_weights(tmp_path / "pipe"), transformer_weights(out / "final")
    changed = {k for k in after if k not in before or not torch.equal(before[k], after[k])}
    assert any(k.endswith(".mixing.logits") for k in changed) and any(".attn1.to_q.weight" in k for k in changed)
    assert any(".ff.conv_temp." in k for k in changed)  # full mode: the Mix-FFN trains too
    assert json.loads((out / "final" / "transformer" / "config.json").read_text())["mhla"]["blocks"] == [1, 2, 2]
