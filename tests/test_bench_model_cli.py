"""`bench model` on a machine without a GPU: the sizes it would build, and clear errors."""

import pytest

from mhla_diffusion.cli import main
from mhla_diffusion.cli.bench_model import latent_shape


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
