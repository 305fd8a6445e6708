"""`bench model` on a machine without a GPU: the sizes it would build, and clear errors."""

import pytest

from mhla_diffusion.cli import main
from mhla_diffusion.families import family_by_name, real_model, real_model_names


def latent_shape(name, resolution, frames):
    return real_model(name)[1].latent_shape(resolution, frames)


def test_latent_shapes_match_the_published_token_counts():
    assert latent_shape("wan2.1-1.3b", "480p", 81) == (16, 21, 60, 104)  # 21 x 30 x 52 = 32,760 tokens
    assert latent_shape("wan2.1-14b", "720p", 81) == (16, 21, 90, 160)  # 75,600 tokens
    assert latent_shape("sana-1.6b", "4096", 1) == (32, 128, 128)
    assert latent_shape("dit-xl-2", "512", 1) == (4, 64, 64)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "model", "--family", "wan2.1-1.3b"], "needs a CUDA GPU"),
        (["bench", "model", "--family", "wan2.1-1.3b", "--frames", "80"], "4k+1"),
        (["bench", "model", "--family", "dit-xl-2", "--resolution", "500"], "not a multiple"),
        (["bench", "model", "--family", "dit-xl-2", "--compile", "reduce-overhead", "--back-to-back"],
         "needs a CUDA GPU"),
    ],
)
def test_errors(argv, message, capsys, monkeypatch):
    if message != "needs a CUDA GPU":  # as on a GPU machine: bad sizes are refused before any model is built
        monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_profile_report_names_the_ops_of_a_call():
    import torch

    from mhla_diffusion.cli.profiling import kernel_profile

    a = torch.randn(64, 64)
    report = kernel_profile(lambda: (a @ a).softmax(-1), calls=2)
    assert report.startswith("per call: wall ") and "aten::mm" in report and "aten::softmax" in report


@pytest.mark.parametrize("family", ["wan", "dit"])
def test_self_attention_removed_runs_the_block_without_attention(family, monkeypatch):
    """The bound row's processors: no MHLA op and no self-attention SDPA (cross-attention keeps its own),
    the layer's projections still run, and the model's output keeps its shape."""
    import torch

    from mhla_diffusion import processors
    from mhla_diffusion.cli.bench_model import REMOVED, variant_processors
    from mhla_diffusion.conversion import attn_processors, set_attn_processor
    from mhla_diffusion.zoo import build_transformer

    model = build_transformer(family)
    original = attn_processors(model)
    latent = (16, 3, 8, 8) if family == "wan" else (4, 8, 8)
    kw = family_by_name(family).example_inputs(model, latent, 1, text_tokens=4)  # as `bench model` builds them
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0]
        sdpa_original = len(calls)
        projected = []
        hook = model.get_submodule("blocks.0.attn1.to_v" if family == "wan" else "transformer_blocks.0.attn1.to_v")
        handle = hook.register_forward_hook(lambda *a: projected.append(1))
        set_attn_processor(model, variant_processors(model, REMOVED, original))
        monkeypatch.setattr(processors, "mhla_op", lambda *a, **k: pytest.fail("attention computed"))
        del calls[:]
        out = model(**kw, return_dict=False)[0]
        handle.remove()
    layers = len(model.blocks if family == "wan" else model.transformer_blocks)
    assert sdpa_original == (2 * layers if family == "wan" else layers)  # Wan: self + cross; DiT: self only
    assert len(calls) == sdpa_original - layers and projected == [1]
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.allclose(out, ref)


@pytest.mark.parametrize("name,resolution", [(n, r) for n in real_model_names() for r in real_model(n)[1].checkpoints])
def test_a_resolutions_published_checkpoint_is_built_at_its_own_grid(name, resolution):
    """`bench model` at a resolution with a published checkpoint builds that checkpoint's config (DiT-XL/2 512 px:
    facebook/DiT-XL-2-512), whose default grid, where a conversion defines the mixing logits, is the grid it runs:
    no resampling of positions or logits in any call (the base config at that resolution would resample)."""
    from mhla_diffusion.families import default_grid, latent_grid
    from mhla_diffusion.zoo import build_transformer

    real = real_model(name)[1]
    latent = real.latent_shape(resolution, real.frames)
    model = build_transformer(name, device="meta", resolution=resolution)
    assert default_grid(model)[0] == latent_grid(model, latent)
    assert default_grid(build_transformer(name, device="meta"))[0] != latent_grid(model, latent)


@pytest.mark.parametrize("back_to_back,expected_ms", [(False, 2.0), (True, 4.0)])
def test_calls_are_timed_each_alone_or_back_to_back(back_to_back, expected_ms, monkeypatch):
    """`bench model`'s timing on a stand-in CUDA clock: each call alone between two events and a synchronize (the
    median), or `--back-to-back`, every call between one pair of events with no synchronize between calls (the mean),
    as a sampling loop launches them."""
    import torch

    from mhla_diffusion.cli.bench_model import timed

    clock, log = [0.0], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            log.append("record")
            self.at = clock[0]

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3e9)
    durations = iter([7.0, 1.0, 2.0, 9.0])  # the warm-up call, then three timed ones

    def call():
        log.append("call")
        clock[0] += next(durations)

    assert timed(call, warmup=1, iters=3, back_to_back=back_to_back) == (expected_ms, 3.0)
    timed_part = log[log.index("sync") + 1:]
    if back_to_back:
        assert timed_part == ["record", "call", "call", "call", "record", "sync"]
    else:
        assert timed_part == ["record", "call", "record", "sync"] * 3
