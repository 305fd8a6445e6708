"""A converted transformer is a diffusers model in every respect (issue: the model contract).

Parameters exist when conversion returns and stay one set at every resolution; state round-trips
strictly; EMAModel, deepcopy, pickling, gradient checkpointing, DDP and diffusers' processor API
work; every transformer of a pipeline converts; plain diffusers loads the saved dir as MHLA.
"""

import copy
import io
import json
import logging
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
from mhla_diffusion.mixing import mixing_matrix, resample_logits

from test_convert import run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def diffusers_log():
    """What diffusers logs (its loggers do not propagate to pytest's caplog)."""
    from diffusers.utils import logging as dlog

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    dlog.get_logger("diffusers").addHandler(handler)
    yield stream
    dlog.get_logger("diffusers").removeHandler(handler)


def mixing_names(model):
    return [n for n, _ in model.named_parameters() if ".processor." in n]


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_parameters_exist_at_conversion_and_train_at_any_resolution(family):
    """An optimizer built right after convert trains the MHLA parameters, also at a size not seen before."""
    model = zoo.build_transformer(family)
    md.convert(model)
    names = [n for n, _ in model.named_parameters()]
    assert len([n for n in names if n.endswith(".mixing.logits")]) == len(mhla_modules(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".processor." in n}
    run(model.train(), 12, batch=1, frames=5).square().mean().backward()
    opt.step()
    assert [n for n, _ in model.named_parameters()] == names
    moved = [n for n, p in model.named_parameters() if n.endswith(".mixing.logits") and not torch.equal(p, before[n])]
    assert len(moved) == len(mhla_modules(model))


def test_resampled_logits_are_the_free_matrix_at_their_grid_and_stochastic_elsewhere():
    logits = torch.randn(12, 12)
    assert resample_logits(logits, (1, 3, 4), (1, 3, 4)) is logits  # the paper's free M x M matrix, untouched
    model = zoo.build_transformer("dit")
    md.convert(model, md.MHLAConfig(blocks="auto", mix_blocks=(1, 3, 4)))
    mixing = model.transformer_blocks[0].attn1.processor.mixing
    with torch.no_grad():
        mixing.logits.copy_(logits)
    torch.testing.assert_close(mixing((1, 3, 4)), logits.softmax(-1))
    for blocks in ((1, 2, 2), (1, 6, 8), (2, 3, 3)):
        mix = mixing(blocks)
        m = blocks[0] * blocks[1] * blocks[2]
        assert mix.shape == (m, m) and (mix > 0).all()
        torch.testing.assert_close(mix.sum(-1), torch.ones(m))
    const = torch.zeros(4, 4)
    torch.testing.assert_close(resample_logits(const, (1, 2, 2), (1, 4, 4)), torch.zeros(16, 16))


def test_inference_reuses_the_mixing_matrix_until_the_logits_change(monkeypatch):
    """Without gradients a layer resamples its logits once per block grid, not once per call, and any change of the
    logits (an in-place step, load_state_dict, a dtype move) is seen by the next call; with gradients every call
    recomputes the matrix, and gradients reach the logits."""
    from mhla_diffusion import mixing as mixing_module

    model = zoo.build_transformer("dit")
    md.convert(model)
    resampled = []
    resample = mixing_module.resample_logits
    monkeypatch.setattr(mixing_module, "resample_logits", lambda *a: resampled.append(a[2]) or resample(*a))
    layers = len(mhla_modules(model))
    with torch.no_grad():
        first = run(model, 16, batch=1)
        assert len(resampled) == layers
        torch.testing.assert_close(run(model, 16, batch=1), first, rtol=0, atol=0)
        assert len(resampled) == layers
        run(model, 8, batch=1)  # another block grid (the logits' own)
        assert len(resampled) == 2 * layers
        for p in md.mhla_parameters(model):
            p.add_(torch.randn_like(p))
        stepped = run(model, 16, batch=1)
    fresh = zoo.build_transformer("dit")
    md.convert(fresh)
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(run(fresh, 16, batch=1), stepped, rtol=0, atol=0)
        assert not torch.equal(stepped, first)
        model.load_state_dict(zoo.build_transformer("dit", seed=1).state_dict(), strict=False)
        reloaded = run(model, 16, batch=1)
        for p in md.mhla_parameters(model):
            p.zero_()
        assert not torch.equal(run(model, 16, batch=1), reloaded)
        mixing = model.transformer_blocks[0].attn1.processor.mixing
        assert mixing((1, 3, 3)).dtype == torch.float32
        model.double()
        torch.testing.assert_close(mixing((1, 3, 3)), mixing._matrix((1, 3, 3)), rtol=0, atol=0)
    count = len(resampled)
    run(model.float().train(), 16, batch=1).sum().backward()
    run(model, 16, batch=1)
    assert len(resampled) == count + 2 * layers
    assert all(p.grad is not None for p in md.mhla_parameters(model) if p.requires_grad)


def test_a_layer_hands_the_op_its_logits_where_it_makes_the_matrix_each_call(monkeypatch):
    """Where a layer would make its mixing matrix each call (with gradients; under torch.compile) it hands the op the
    logits at the call's block grid (`mhla_op(..., mix_logits=True)`: the kernels softmax them as they read them);
    without gradients, the reused matrix. The model's output and the logits' gradients are the same either way."""
    from mhla_diffusion import processors

    model = zoo.build_transformer("dit")
    md.convert(model)
    layer = model.transformer_blocks[0].attn1.processor
    given, op = [], processors.mhla_op
    monkeypatch.setattr(processors, "mhla_op", lambda q, k, v, mix, *a, mix_logits=False, **kw: given.append(
        (mix, mix_logits)) or op(q, k, v, mix, *a, mix_logits=mix_logits, **kw))
    with torch.no_grad():
        reused = run(model, 8, batch=1)  # 8 x 8 latents: the logits' own block grid
        mix, logits = given[0]
        assert not logits and mix is layer.mixing(layer.mixing.mix_blocks)
    given.clear()
    out = run(model, 8, batch=1)
    mix, logits = given[0]
    assert logits and mix is layer.mixing.logits
    torch.testing.assert_close(out, reused)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in md.mhla_parameters(model)]
    model.zero_grad()
    monkeypatch.setattr(processors, "mhla_op", lambda *a, mix_logits=False, **kw: op(
        *a[:3], mixing_matrix(a[3], mix_logits), *a[4:], **kw))  # the matrix made before the op, as before
    run(model, 8, batch=1).square().sum().backward()
    for grad, p in zip(grads, md.mhla_parameters(model)):
        torch.testing.assert_close(grad, p.grad)
    given.clear()
    monkeypatch.setattr(processors, "mhla_op", lambda q, k, v, mix, *a, mix_logits=False, **kw: given.append(
        (mix, mix_logits)) or op(q, k, v, mix, *a, mix_logits=mix_logits, **kw))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        run(model, 8, batch=1)
    assert given[0][1] and given[0][0] is layer.mixing.logits


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_strict_state_dict_ema_deepcopy_and_pickle(family):
    model = zoo.build_transformer(family)
    md.convert(model)
    with torch.no_grad():
        for p in md.mhla_parameters(model):
            p.add_(torch.randn_like(p))
    other = zoo.build_transformer(family, seed=1)
    md.convert(other)
    other.load_state_dict(model.state_dict(), strict=True)
    expected = run(model, 12, batch=1, frames=5)  # a resolution the logits are resampled for
    torch.testing.assert_close(run(other, 12, batch=1, frames=5), expected, rtol=0, atol=0)

    from diffusers.training_utils import EMAModel

    ema = EMAModel(other.parameters(), decay=0.5)
    run(other, 8).mean().backward()
    ema.step(other.parameters())

    clone = copy.deepcopy(model)
    torch.testing.assert_close(run(clone, 12, batch=1, frames=5), expected, rtol=0, atol=0)
    run(clone, 8)  # the copy publishes to its own processors: the original's grid is untouched
    assert model._mhla_token_grid.grid != clone._mhla_token_grid.grid
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(run(loaded, 12, batch=1, frames=5), expected, rtol=0, atol=0)


ROPE_FAMILIES = [f for f in zoo.FAMILIES if getattr(zoo.build_transformer(f), "rope", None) is not None]


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_every_layer_gets_the_rope_tables_as_made_and_the_kernels_copies_are_made_once_a_forward(family):
    """A converted model's rotary embedding hands its layers `RoPETables`: the very tensors it made, so a layer left
    unconverted runs on them unchanged, one object for every layer of a forward, whose copies in the kernels' dtype
    are made on the first layer's call and read by the rest (a Wan forward rounded its fp32 tables once a layer: 21
    us a layer at 480p, H100). The same after deepcopy and pickling; a plain tuple still works (the op rounds it)."""
    from mhla_diffusion.ops.rope import RoPETables, kernel_tables

    model = zoo.build_transformer(family)
    original = copy.deepcopy(model)
    md.convert(model, md.MHLAConfig(layers=[0]))  # layer 1 on keeps its diffusers processor
    attns = [m for n, m in model.named_modules() if n.endswith("attn1")]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for m in (model, copy.deepcopy(model), torch.load(buf, weights_only=False)):
        seen = []
        hooks = [a.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(
            kwargs.get("rotary_emb", args[3] if len(args) > 3 else None)), with_kwargs=True)
            for a in (x for n, x in m.named_modules() if n.endswith("attn1"))]
        run(m, 8)
        for h in hooks:
            h.remove()
        assert len(seen) == len(attns) > 1 and all(t is seen[0] for t in seen)  # converted and unconverted layers
        assert isinstance(seen[0], RoPETables) and seen[0][0].dtype == torch.float32
        made = []
        hook = original.rope.register_forward_hook(lambda mod, args, out: made.append(out))
        run(original, 8)
        hook.remove()
        torch.testing.assert_close(tuple(seen[0]), tuple(made[0]), rtol=0, atol=0)
        rounded = kernel_tables(seen[0], torch.bfloat16)
        assert rounded[0].dtype == torch.bfloat16 and kernel_tables(seen[0], torch.bfloat16)[0] is rounded[0]
        assert torch.equal(rounded[1], made[0][1].to(torch.bfloat16))
    assert kernel_tables(tuple(made[0]), torch.bfloat16)[0] is not kernel_tables(tuple(made[0]), torch.bfloat16)[0]


def _hook_torch_forward(norm, seen):
    return norm.register_forward_hook(lambda module, args, out: seen.append("forward"))


def _hook_torch_backward(norm, seen):
    return norm.register_full_backward_hook(lambda module, gin, gout: seen.append("backward"))


def _hook_global_forward(norm, seen):
    from torch.nn.modules.module import register_module_forward_hook

    return register_module_forward_hook(lambda module, args, out: seen.append("forward") if module is norm else None)


def _hook_diffusers(norm, seen):
    from diffusers.hooks import HookRegistry, ModelHook

    class Recording(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append("forward")
            return args, kwargs

    HookRegistry.check_if_exists_or_initialize(norm).register_hook(Recording(), "record")
    return None


@pytest.mark.parametrize("hook", [_hook_torch_forward, _hook_torch_backward, _hook_global_forward, _hook_diffusers])
def test_hooks_on_wans_qk_norms_still_run_and_change_nothing(hook):
    """MHLA hands Wan's q/k RMSNorms to the op, which applies them on the way; a norm module that carries a hook
    (torch's, global, diffusers' or accelerate's: offloading moves its weight in; a user's hook reads its output or
    gradient) is called as the layer calls it, once per forward, with the same output."""
    model = zoo.build_transformer("wan")
    md.convert(model)
    plain = run(model, 8, frames=5)
    seen = []
    handle = hook(model.blocks[0].attn1.norm_q, seen)
    hooked = run(model, 8, frames=5)
    hooked.square().mean().backward()
    if handle is not None:
        handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(hooked, plain, rtol=0, atol=0)


def test_group_offloaded_wan_runs_its_norms_where_their_weights_are():
    """diffusers' leaf-level group offloading moves a norm's weight onto the device in the norm's own forward: the
    converted model under it computes what it computes without it."""
    model = zoo.build_transformer("wan")
    md.convert(model)
    model.eval()
    with torch.no_grad():
        plain = run(model, 8, frames=5)
        cpu = torch.device("cpu")
        model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
        offloaded = run(model, 8, frames=5)
    torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)


def test_qk_norms_without_an_eps_run_as_their_modules():
    """An RMSNorm built with eps=None takes its eps from the compute type; the op's norms are given eps as a number,
    so such a layer runs its norm modules (same result as the module, in the model's dtype)."""
    from mhla_diffusion.ops.norms import layer_norms

    norm_q, norm_k = (torch.nn.RMSNorm(32, eps=None).to(torch.bfloat16) for _ in range(2))
    q, k = (torch.randn(1, 6, 2, 16, dtype=torch.bfloat16) * 1e-3 for _ in range(2))
    qn, kn, norms = layer_norms(q, k, (norm_q, norm_k), None)
    assert norms is None
    torch.testing.assert_close(qn, norm_q(q.flatten(2)).view_as(q), rtol=0, atol=0)


def test_accelerate_prepare_with_ddp_sees_every_parameter_from_the_start(monkeypatch):
    """One gloo process: the DDP-wrapped model trains its mixing logits (DDP errors on parameters it
    did not know of when wrapped, and those would never be reduced)."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    AcceleratorState._reset_state(reset_partial_state=True)  # other tests made accelerate's state a single process
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = zoo.build_transformer("dit")
        md.convert(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        acc = Accelerator(cpu=True)
        wrapped, opt = acc.prepare(model, opt)
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        logits = [p for n, p in wrapped.module.named_parameters() if n.endswith(".mixing.logits")]
        before = [p.detach().clone() for p in logits]
        acc.backward(run(wrapped, 12, batch=1).square().mean())
        opt.step()
        assert all(not torch.equal(p, b) for p, b in zip(logits, before))
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)


def test_diffusers_processor_api_keeps_the_config_true(tmp_path):
    model = zoo.build_transformer("pixart")
    md.convert(model)
    model.set_default_attn_processor()  # diffusers' own call: every processor back to the default one
    assert not md.is_converted(model) and "mhla" not in model.config
    assert type(model).__name__ == "PixArtTransformer2DModel"
    model.save_pretrained(tmp_path / "plain")
    assert "mhla" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    with pytest.raises(ValueError, match="not converted"):
        md.from_pretrained(tmp_path / "plain")

    wan = zoo.build_transformer("wan", num_layers=3)
    md.convert(wan)
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    procs = wan.attn_processors
    procs["blocks.1.attn1.processor"] = WanAttnProcessor()  # one layer back to softmax
    wan.set_attn_processor(procs)
    assert wan.config["mhla"]["layers"] == [0, 2]
    expected = run(wan, 8)
    wan.save_pretrained(tmp_path / "partial")
    reloaded = md.from_pretrained(tmp_path / "partial")
    assert sorted(mhla_modules(reloaded)) == ["blocks.0.attn1.processor", "blocks.2.attn1.processor"]
    torch.testing.assert_close(run(reloaded, 8), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="converting more layers later is not supported"):
        wan.set_attn_processor(md.mhla_processors(wan, md.MHLAConfig(layers=[1])))
    wan.set_attn_processor(WanAttnProcessor())
    assert not md.is_converted(wan) and "mhla" not in wan.config


def test_every_transformer_of_a_pipeline_converts_and_plain_diffusers_loads_it(tmp_path, diffusers_log, capsys):
    import diffusers

    pipe = zoo.build_pipeline("wan2.2-a14b")  # a high-noise and a low-noise expert
    pipe.set_progress_bar_config(disable=True)
    md.convert(pipe)
    assert md.is_converted(pipe.transformer) and md.is_converted(pipe.transformer_2)
    with torch.no_grad():
        for p in md.mhla_parameters(pipe.transformer_2):
            p.add_(torch.randn_like(p))
    expected = sample(pipe, "wan", seed=0, steps=2)
    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["transformer"] == index["transformer_2"] == ["mhla_diffusion", "MHLAWanTransformer3DModel"]
    for load in (diffusers.DiffusionPipeline.from_pretrained, diffusers.WanPipeline.from_pretrained, md.from_pretrained):
        diffusers_log.truncate(0)
        loaded = load(tmp_path / "pipe")
        loaded.set_progress_bar_config(disable=True)
        assert md.is_converted(loaded.transformer) and md.is_converted(loaded.transformer_2)
        np.testing.assert_array_equal(sample(loaded, "wan", seed=0, steps=2), expected)
        assert "not used" not in diffusers_log.getvalue() and "newly initialized" not in diffusers_log.getvalue()
    alone = md.MHLAWanTransformer3DModel.from_pretrained(tmp_path / "pipe" / "transformer_2")
    torch.testing.assert_close(alone.state_dict(), pipe.transformer_2.state_dict())

    zoo_pipe = zoo.build_pipeline("wan2.2-a14b")
    zoo_pipe.save_pretrained(tmp_path / "original")
    assert main(["convert", str(tmp_path / "original"), str(tmp_path / "cli")]) == 0
    assert "transformer_2 (MHLAWanTransformer3DModel): 2 self-attention layers converted" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "cli"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert sorted(info["models"]) == ["transformer", "transformer_2"] and all(m["converted"] for m in info["models"].values())


def test_without_mhla_diffusion_imported_plain_diffusers_refuses_loudly(tmp_path):
    pipe = zoo.build_pipeline("dit")
    md.convert(pipe)
    pipe.save_pretrained(tmp_path / "pipe")
    code = f"import diffusers; diffusers.DiffusionPipeline.from_pretrained({str(tmp_path / 'pipe')!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "import mhla_diffusion" in proc.stderr


def legacy_dir(tmp_path, grid_key: str) -> tuple[Path, torch.Tensor]:
    """A transformer dir as mhla-diffusion 0.1 saved it: the diffusers class, no mix_blocks, and mixing
    logits keyed by the block grid they were made for. Returns the dir and layer 0's saved logits."""
    from safetensors.torch import load_file, save_file

    model = zoo.build_transformer("dit")
    md.convert(model, md.MHLAConfig(blocks=(2, 2)))
    with torch.no_grad():
        for p in md.mhla_parameters(model):
            p.add_(torch.randn_like(p))
    model.save_pretrained(tmp_path)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["_class_name"] = "DiTTransformer2DModel"
    del cfg["mhla"]["mix_blocks"]
    cfg_file.write_text(json.dumps(cfg))
    weights = tmp_path / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    for key in [k for k in state if k.endswith(".mixing.logits")]:
        state[f"{key}.{grid_key}"] = state.pop(key)
    save_file(state, str(weights))
    return tmp_path, model


def test_saved_dirs_of_the_per_grid_format_load_migrated_with_a_notice(tmp_path, caplog):
    path, model = legacy_dir(tmp_path, "1x2x2")
    with caplog.at_level(logging.WARNING, logger="mhla_diffusion"):
        loaded = md.from_pretrained(path)
    assert "0.1 format" in caplog.text and "kept" in caplog.text
    torch.testing.assert_close(run(loaded, 8), run(model, 8), rtol=0, atol=0)
    assert main(["info", str(path)]) == 0


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_plain_diffusers_loads_each_family_as_mhla(family, tmp_path, diffusers_log):
    import diffusers

    pipe = zoo.build_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    md.convert(pipe)
    with torch.no_grad():
        for p in md.mhla_parameters(pipe.transformer):
            p.add_(torch.randn_like(p))
    expected = sample(pipe, family, seed=1, steps=2)
    pipe.save_pretrained(tmp_path)
    loaded = diffusers.DiffusionPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.transformer).__name__ == "MHLA" + type(pipe.transformer)._mhla_base.__name__
    np.testing.assert_array_equal(sample(loaded, family, seed=1, steps=2), expected)
    assert "not used" not in diffusers_log.getvalue()
