"""Conversion of each family's tiny transformer: forward, backward, save, reload."""

import warnings

import pytest
import torch

import mhla_diffusion as md
from mhla_diffusion import zoo
from mhla_diffusion.conversion import mhla_modules
from mhla_diffusion.families import family_of, self_attentions

from dense import dense_mhla


def inputs(model, size, batch=2, frames=3, seed=0):
    """Transformer kwargs for a latent of `size` x `size` or (height, width) (and `frames` for video), from
    the model's family (as `bench model` builds them)."""
    h, w = (size, size) if isinstance(size, int) else size
    family, c = family_of(model), model.config.in_channels
    latent = (c, frames, h, w) if family.video else (c, h, w)
    return family.example_inputs(model, latent, batch, generator=torch.Generator().manual_seed(seed))


def run(model, size, **kw):
    """The model's output at `size` (a DDP/accelerate wrapper runs its module's inputs)."""
    return model(**inputs(getattr(model, "module", model), size, **kw), return_dict=False)[0]


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_convert_forward_backward_save_reload(family, tmp_path):
    model = zoo.build_transformer(family)
    before = run(model, 8)
    md.convert(model)
    assert len(mhla_modules(model)) == len(self_attentions(model))
    out = run(model, 8)
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, before)  # the processors really run
    other = run(model, 12, batch=1, frames=5)  # another resolution (and frame count), no grid passed
    assert other.shape[-2:] == (12, 12)

    model.train()
    loss = run(model, 8).square().mean() + run(model, 12, batch=1, frames=5).square().mean()
    loss.backward()
    mixing = [p for n, p in model.named_parameters() if n.endswith(".mixing.logits")]
    assert mixing and all(p.grad is not None and p.grad.abs().sum() > 0 for p in mixing)
    assert self_attentions(model)[0].to_q.weight.grad is not None

    with torch.no_grad():  # pretend training moved the mixing matrices
        for p in mixing:
            p.add_(torch.randn_like(p))
    model.eval()
    expected = run(model, 8)
    model.save_pretrained(tmp_path)
    reloaded = md.from_pretrained(tmp_path)
    torch.testing.assert_close(run(reloaded, 8), expected, rtol=0, atol=0)


def test_set_attn_processor_path_and_hybrid_layers():
    model = zoo.build_transformer("wan", num_layers=3)
    procs = md.mhla_processors(model, md.MHLAConfig(layers="hybrid:3", blocks=(1, 2, 2), normalize=False, output_norm=True))
    model.set_attn_processor(procs)
    converted = sorted(mhla_modules(model))
    assert converted == ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]
    assert type(model.blocks[2].attn1.processor).__name__ == "WanAttnProcessor"
    assert type(model.blocks[0].attn2.processor).__name__ == "WanAttnProcessor"  # cross-attention untouched
    out = run(model, 8)
    assert torch.isfinite(out).all()


def test_dit_gets_set_attn_processor():
    model = zoo.build_transformer("dit")
    assert not hasattr(model, "set_attn_processor")  # upstream lacks it; we provide the equivalent
    md.set_attn_processor(model, md.mhla_processors(model, md.MHLAConfig(blocks=(2, 2))))
    assert all(type(p).__name__ == "MHLAAttnProcessor" for p in md.attn_processors(model).values())
    assert torch.isfinite(run(model, 8)).all()


def test_sana_single_block_is_sanas_own_linear_attention():
    """M = 1 reduces MHLA to SANA's global ReLU linear attention: outputs must match the original."""
    model = zoo.build_transformer("sana")
    before = run(model, 8)
    md.convert(model, md.default_config(model, blocks=(1, 1, 1)))
    torch.testing.assert_close(run(model, 8), before, rtol=1e-5, atol=1e-6)


def test_legacy_processor_matches_dense_mhla_inside_dit():
    """The DiT processor feeds the layer's own projections to MHLA: check against a hand-built layer."""
    model = zoo.build_transformer("dit").double()
    md.convert(model, md.MHLAConfig(blocks=(2, 2)))
    attn = model.transformer_blocks[0].attn1
    seen = {}
    attn.register_forward_hook(lambda m, a, kw, out: seen.update(x=a[0] if a else kw["hidden_states"], out=out), with_kwargs=True)
    run(model, 8, batch=1)
    x = seen["x"]
    q, k, v = (p(x).view(1, 16, 2, 4) for p in (attn.to_q, attn.to_k, attn.to_v))
    mix = attn.processor.mixing((1, 2, 2)).double()
    o = dense_mhla(q, k, v, mix, (1, 4, 4), (1, 2, 2)).flatten(2)
    torch.testing.assert_close(seen["out"], attn.to_out[0](o), rtol=1e-6, atol=1e-8)


def test_wan_processor_matches_dense_mhla_with_rope_norm_and_gate():
    """Wan's processor: q/k norms, RoPE on the numerator, no normalizer, per-head RMSNorm gain, SiLU gate."""
    model = zoo.build_transformer("wan").double()
    md.convert(model, md.default_config(model, blocks=(1, 2, 2), output_gate=True))
    attn = model.blocks[0].attn1
    with torch.no_grad():  # a non-trivial gain and gate, so both are checked
        attn.processor.norm_gain.uniform_(0.5, 1.5)
        attn.processor.gate.weight.normal_(0, 0.1)
    seen = {}
    attn.register_forward_hook(lambda m, a, out: seen.update(x=a[0], rope=a[3], out=out))
    run(model, 4, batch=1, frames=2)
    x, rope = seen["x"], seen["rope"]
    q, k, v = (p(x) for p in (attn.to_q, attn.to_k, attn.to_v))
    q, k, v = (t.view(1, -1, 2, 12) for t in (attn.norm_q(q), attn.norm_k(k), v))
    mix = attn.processor.mixing((1, 2, 2)).double()
    o = dense_mhla(q, k, v, mix, (2, 2, 2), (1, 2, 2), normalize=False, rope=rope)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.processor.norm_gain
    o = o.flatten(2) * torch.nn.functional.silu(attn.processor.gate(x))
    torch.testing.assert_close(seen["out"], attn.to_out[0](o), rtol=1e-6, atol=1e-8)


def test_bf16_forward():
    model = zoo.build_transformer("pixart")
    md.convert(model)
    half = run(model.to(torch.bfloat16), 8)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()


@pytest.mark.parametrize("family", ["pixart", "wan"])
def test_gradient_checkpointing_gives_the_same_gradients(family):
    model = zoo.build_transformer(family)
    md.convert(model)
    model.train()
    grads = []
    for ckpt in (False, True):
        if ckpt:
            model.enable_gradient_checkpointing()
        model.zero_grad()
        run(model, 8).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.endswith(".mixing.logits") for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7)


def test_one_mixing_matrix_serves_every_resolution_and_reloads(tmp_path):
    """blocks="auto" picks another block grid per resolution; the logits are one parameter on the default
    size's grid, read resampled at other grids: what training changes shows at every resolution."""
    model = zoo.build_transformer("wan")
    md.convert(model)  # Wan: blocks="auto", logits on the 480p x 81 grid
    names = [n for n, _ in model.named_parameters()]
    small, large = run(model, 8, frames=3), run(model, 16, frames=5)
    assert [n for n, _ in model.named_parameters()] == names  # nothing created by a forward
    assert [n for n in names if n.startswith("blocks.0.attn1.processor.mixing")] == ["blocks.0.attn1.processor.mixing.logits"]
    with torch.no_grad():  # pretend training moved the logits
        for p in md.mhla_parameters(model):
            p.add_(torch.randn_like(p))
    assert not torch.allclose(run(model, 8, frames=3), small)
    expected = run(model, 16, frames=5)
    assert not torch.allclose(expected, large)
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(run(md.from_pretrained(tmp_path), 16, frames=5), expected, rtol=0, atol=0)


def test_torch_compile_of_converted_transformers():
    """fullgraph compile (no graph break in the MHLA processors) matches eager, also at a resolution
    whose block grid differs from the logits' (resampled inside the graph), with no Dynamo warning
    about the block-layout caches."""
    torch._dynamo.reset()
    torch._dynamo.utils.warn_once_cache.clear()  # Dynamo warns once per message and process
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wan = zoo.build_transformer("wan").eval()
        md.convert(wan)
        compiled = torch.compile(wan, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(**inputs(wan, 4), return_dict=False)[0], run(wan, 4))
        dit = zoo.build_transformer("dit").eval()
        md.convert(dit)
        compiled = torch.compile(dit, fullgraph=True, backend="aot_eager")
        for size in (8, 16):  # 16: 8 x 8 tokens, a block grid the logits are not defined on
            torch.testing.assert_close(compiled(**inputs(dit, size), return_dict=False)[0], run(dit, size))
    assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message)[:200] for w in seen]


@pytest.mark.parametrize("autocast", [False, True])
def test_torch_compile_without_the_builtins_older_dynamo_cannot_trace(monkeypatch, autocast):
    """torch 2.11's Dynamo cannot trace torch.amp.is_autocast_available (a C builtin): when the op's dispatch asked it,
    every converted layer broke the graph, and a DiT-XL/2 512 px compiled with CUDA graphs ran 4.5x slower than the
    original (H100, session 40). Here the builtin is made as untraceable; fullgraph compile must still go through,
    in and out of autocast, and match eager."""
    monkeypatch.setattr(torch.amp, "is_autocast_available", torch._dynamo.disable(torch.amp.is_autocast_available))
    torch._dynamo.reset()
    dit = zoo.build_transformer("dit").eval()
    md.convert(dit)
    compiled = torch.compile(dit, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.testing.assert_close(compiled(**inputs(dit, 8), return_dict=False)[0], run(dit, 8))


def test_mixing_stays_row_stochastic_after_steps():
    model = zoo.build_transformer("dit")
    md.convert(model)
    init = model.transformer_blocks[0].attn1.processor.mixing((1, 2, 2)).detach().clone()
    opt = torch.optim.SGD(md.mhla_parameters(model), lr=10.0)
    for _ in range(3):
        opt.zero_grad()
        run(model.train(), 8).sum().backward()
        opt.step()
    mix = model.transformer_blocks[0].attn1.processor.mixing((1, 2, 2))
    torch.testing.assert_close(mix.sum(1), torch.ones(4))
    assert (mix > 0).all() and (mix < 1).all()
    assert (mix - init).abs().max() > 1e-3  # it did train


def test_errors():
    model = zoo.build_transformer("dit")
    with pytest.raises(ValueError, match="does not fit"):
        md.convert(model, md.MHLAConfig(blocks=(3, 2, 2)))
    with pytest.raises(ValueError, match="out of range"):
        md.convert(model, md.MHLAConfig(layers=[0, 7]))
    md.convert(model)
    with pytest.raises(ValueError, match="already converted"):
        md.convert(model)
    import diffusers

    with pytest.raises(ValueError, match="unsupported model class UNet2DModel; supported: DiT"):
        md.convert(diffusers.UNet2DModel(block_out_channels=(8,), norm_num_groups=4, down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",)))
    with pytest.raises(ValueError, match="hybrid"):
        md.MHLAConfig(layers="hybrid:x")
