"""`eval attention`: rank and entropy of softmax / linear / MHLA attention on real activations."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import mhla_diffusion
from mhla_diffusion import MHLAConfig, zoo
from mhla_diffusion.blocks import locality_mix
from mhla_diffusion.cli.main import main
from mhla_diffusion.evaluation.attention_capture import LayerCapture
from mhla_diffusion.evaluation.attention_stats import attention_matrices, layer_stats

HEAD_DIM = 4  # zoo's tiny DiT


def save_dit(path, mix_init):
    """Tiny DiT at sample_size 16: an 8x8 token grid, auto blocks give M = 8 > 1."""
    pipe = zoo.build_pipeline("dit")
    pipe.register_modules(transformer=zoo.build_transformer("dit", sample_size=16))
    mhla_diffusion.convert(pipe, MHLAConfig(mix_init=mix_init))
    pipe.save_pretrained(path)
    return path


def attention(model, out):
    assert main(["eval", "attention", "--model", str(model), "--out", str(out), "--steps", "2"]) == 0
    return json.loads((out / "attention.json").read_text())["layers"]


def test_mhla_exceeds_head_dim_where_linear_collapses(tmp_path):
    layers = attention(save_dit(tmp_path / "mhla", "locality"), tmp_path / "out")
    assert len(layers) == 2
    for r in layers.values():
        assert r["tokens"] == 64 and r["head_dim"] == HEAD_DIM and r["num_blocks"] > 1
        assert r["linear_rank"] <= HEAD_DIM < r["mhla_rank"]
        assert r["softmax_rank"] > HEAD_DIM
        for kind in ("softmax", "linear", "mhla"):
            assert 0 < r[f"{kind}_entropy"] <= r["max_entropy"] + 1e-9
    assert Image.open(tmp_path / "out" / "attention.png").size[0] > 100
    assert "mhla rank" in (tmp_path / "out" / "attention.txt").read_text()


def test_uniform_mixing_is_plain_linear_attention(tmp_path):
    layers = attention(save_dit(tmp_path / "lin", "uniform"), tmp_path / "out")
    for r in layers.values():
        assert r["mhla_rank"] <= HEAD_DIM
        assert r["mhla_rank"] == pytest.approx(r["linear_rank"])
        assert r["mhla_entropy"] == pytest.approx(r["linear_entropy"], rel=1e-3)


def test_dense_matrix_is_what_mhla_computes():
    torch.manual_seed(0)
    grid, blocks, n, heads, d = (1, 6, 6), (1, 3, 3), 36, 2, 3
    q, k, v = (torch.randn(n, heads, d, dtype=torch.float64) for _ in range(3))
    q = q.abs() + 0.1  # every query row carries mass, so eps = 0 is safe below
    mix = locality_mix(blocks)
    cap = LayerCapture(q, k, grid, blocks, mix, None, "relu")
    a = attention_matrices(cap, torch.arange(n))
    for kind in ("softmax", "linear", "mhla"):
        assert torch.allclose(a[kind].sum(-1), torch.ones(()).double())
    out = mhla_diffusion.mhla_attention(q[None], k[None], v[None], mix, grid, blocks, eps=0.0, backend="torch")[0]
    assert torch.allclose(torch.einsum("hnj,jhd->nhd", a["mhla"], v), out, atol=1e-10)
    stats = layer_stats(cap)
    assert stats["linear_rank"] <= d < stats["mhla_rank"]


def test_unconverted_model_is_refused(tmp_path, capsys):
    pipe = zoo.build_pipeline("dit")
    pipe.save_pretrained(tmp_path / "orig")
    assert main(["eval", "attention", "--model", str(tmp_path / "orig"), "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "convert it first" in capsys.readouterr().err
