"""FID: the metric against independent math, the .npz reference path, the 2048-d Inception path,
resumable sampling through `eval fid`, and the errors users hit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image
from torch import nn

import mhla_diffusion
from mhla_diffusion import zoo
from mhla_diffusion.cli.main import main
from mhla_diffusion.evaluation import fid, images, inception
from mhla_diffusion.evaluation.fid_run import run_fid
from mhla_diffusion.evaluation.sampling import SamplingSettings, call_kwargs


class PooledPixels(nn.Module):
    """A small known feature network: uint8 images -> 2x2 average-pooled RGB (12 features)."""

    def forward(self, x):
        return nn.functional.adaptive_avg_pool2d(x.float() / 255.0, 2).flatten(1)


def write_images(folder, n, seed, shift=0.0, size=8):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        pixels = np.clip(rng.normal(0.5 + shift, 0.2, (size, size, 3)), 0, 1)
        Image.fromarray((pixels * 255).astype(np.uint8)).save(folder / f"{i:03d}.png")
    return folder


def scipy_fid(a, b):
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def features(folder):
    batch = torch.stack([images.load_uint8(p) for p in images.list_images(folder)])
    return PooledPixels()(batch).double().numpy()


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    return write_images(root / "a", 40, seed=1), write_images(root / "b", 30, seed=2, shift=0.1)


def test_fid_of_a_set_against_itself_is_zero(sets):
    a, _ = sets
    value, n = fid.fid(images.list_images(a), a, feature=PooledPixels())
    assert n == 40
    assert abs(value) < 1e-6


def test_fid_equals_independent_scipy_computation_and_torchmetrics(sets):
    a, b = sets
    value, _ = fid.fid(images.list_images(b), a, feature=PooledPixels())
    expected = scipy_fid(features(a), features(b))
    assert expected > 0.01
    assert value == pytest.approx(expected, rel=1e-6)
    metric = fid.make_metric(PooledPixels())
    fid.add_images(metric, images.list_images(a), real=True)
    fid.add_images(metric, images.list_images(b), real=False)
    assert value == pytest.approx(float(metric.compute()), rel=1e-4)  # compute() returns float32


def test_npz_reference_equals_folder_reference(sets, tmp_path):
    a, b = sets
    stats = fid.folder_stats(a, feature=PooledPixels())
    stats.save(tmp_path / "ref.npz")
    fake = images.list_images(b)
    from_folder, _ = fid.fid(fake, a, feature=PooledPixels())
    from_npz, n = fid.fid(fake, tmp_path / "ref.npz", feature=PooledPixels())
    assert n == 40
    assert from_npz == pytest.approx(from_folder, rel=1e-9)
    np.savez(tmp_path / "adm.npz", mu=stats.mu, sigma=stats.sigma)  # ADM files carry no n
    from_adm, n = fid.fid(fake, tmp_path / "adm.npz", feature=PooledPixels())
    assert n == fid.DEFAULT_REFERENCE_N
    assert from_adm == pytest.approx(from_folder, rel=1e-9)


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    """torch-fidelity's InceptionV3 with its default random init, saved under its state-dict keys."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    with pytest.MonkeyPatch.context() as mp:  # build without the download and the weight load
        mp.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        mp.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *a, **k: None)
        torch.manual_seed(0)
        net = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    path = tmp_path_factory.mktemp("inception") / "inception.pth"
    torch.save(net.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dit") / "dit_mhla"
    pipe = zoo.build_pipeline("dit")
    mhla_diffusion.convert(pipe)
    pipe.save_pretrained(path)
    return path


def fid_cli(model, reference, out, n, *extra):
    return main(["eval", "fid", "--model", str(model), "--reference", str(reference), "--out", str(out),
                 "--num-samples", str(n), "--steps", "2", "--guidance-scale", "1", "--batch-size", "2", *extra])


SETTINGS = SamplingSettings(seed=0, steps=2, guidance_scale=1.0)


def test_inception_2048_end_to_end(dit_dir, inception_weights, tmp_path):
    ref_images = write_images(tmp_path / "ref", 4, seed=3)
    assert main(["eval", "ref-stats", str(ref_images), str(tmp_path / "ref.npz"), "--inception-weights", str(inception_weights)]) == 0
    with np.load(tmp_path / "ref.npz") as ref:
        assert ref["mu"].shape == (2048,) and ref["sigma"].shape == (2048, 2048) and int(ref["n"]) == 4
        assert np.isfinite(ref["sigma"]).all() and ref["sigma"].any()
    out = tmp_path / "run"
    assert fid_cli(dit_dir, tmp_path / "ref.npz", out, 3, "--inception-weights", str(inception_weights)) == 0
    report = json.loads((out / "fid.json").read_text())
    assert report["num_samples"] == 3 and report["reference_n"] == 4 and report["family"] == "dit"
    assert np.isfinite(report["fid"]) and report["fid"] > 0
    assert set(report["timings_s"]) == {"load", "sampling", "fid", "total"}
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == ["000000.png", "000001.png", "000002.png"]


def test_sampling_resumes_and_is_repeatable(dit_dir, sets, tmp_path):
    a, _ = sets
    out = tmp_path / "run"
    run_fid(dit_dir, a, out, 3, SETTINGS, batch_size=2, feature=PooledPixels())
    first = {p.name: p.read_bytes() for p in (out / "samples").glob("*.png")}
    assert len(first) == 3
    report = run_fid(dit_dir, a, out, 5, SETTINGS, batch_size=2, feature=PooledPixels())
    assert report["samples_made"] == 2 and report["samples_resumed"] == 3
    assert {p.name: p.read_bytes() for p in (out / "samples").glob("00000[012].png")} == first

    fresh = run_fid(dit_dir, a, tmp_path / "fresh", 5, SETTINGS, batch_size=5, feature=PooledPixels())
    for i in range(5):  # same seeds in another batching: the same samples up to rounding
        x, y = (np.asarray(Image.open(d / "samples" / f"{i:06d}.png"), dtype=int) for d in (out, tmp_path / "fresh"))
        assert np.abs(x - y).max() <= 1
    assert fresh["fid"] == pytest.approx(report["fid"], rel=1e-3, abs=1e-6)
    labels = [i % 1000 for i in range(5)]  # balanced DiT classes: sample i is class i mod 1000
    assert call_kwargs(zoo.build_pipeline("dit"), range(5), SETTINGS)["class_labels"] == labels


def test_resume_with_other_settings_is_refused(dit_dir, sets, inception_weights, tmp_path, capsys):
    a, _ = sets
    out = tmp_path / "run"
    run_fid(dit_dir, a, out, 2, SETTINGS, feature=PooledPixels())
    assert fid_cli(dit_dir, a, out, 2, "--inception-weights", str(inception_weights), "--seed", "7") == 2
    assert "other settings (seed differ)" in capsys.readouterr().err


def test_missing_inception_weights_say_which_file_and_where(dit_dir, sets, tmp_path, monkeypatch, capsys):
    a, _ = sets
    assert fid_cli(dit_dir, a, tmp_path / "o", 4, "--inception-weights", str(tmp_path / "nope.pth")) == 2
    assert "nope.pth" in capsys.readouterr().err
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    assert main(["eval", "ref-stats", str(a), str(tmp_path / "r.npz")]) == 2
    err = capsys.readouterr().err
    assert inception.WEIGHTS_FILE in err and str(tmp_path / "torch_home" / "hub" / "checkpoints") in err


def test_bad_references_and_sample_counts(dit_dir, sets, inception_weights, tmp_path, capsys):
    a, b = sets
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="at least 2"):
        fid.fid(images.list_images(b), tmp_path / "empty", feature=PooledPixels())
    np.savez(tmp_path / "wide.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    with pytest.raises(ValueError, match="2048 features but the FID network gives 12"):
        fid.fid(images.list_images(b), tmp_path / "wide.npz", feature=PooledPixels())
    np.savez(tmp_path / "nosigma.npz", mu=np.zeros(12))
    with pytest.raises(ValueError, match="sigma"):
        fid.fid(images.list_images(b), tmp_path / "nosigma.npz", feature=PooledPixels())
    with pytest.raises(ValueError, match="at least 2"):
        fid.fid(images.list_images(b)[:1], a, feature=PooledPixels())
    weights = ["--inception-weights", str(inception_weights)]
    assert fid_cli(dit_dir, a, tmp_path / "o", 1, *weights) == 2
    assert "at least 2" in capsys.readouterr().err
    assert fid_cli(dit_dir, tmp_path / "missing_ref", tmp_path / "o", 4, *weights) == 2
    assert "missing_ref" in capsys.readouterr().err


def test_unreadable_reference_images_are_skipped_and_counted_once(sets, inception_weights, tmp_path, capsys):
    """One corrupt file among 11: ref-stats and fid skip it, count it once and name it."""
    a, _ = sets
    ref = write_images(tmp_path / "ref", 10, seed=4)
    (ref / "broken.png").write_bytes(b"not a png")
    assert main(["eval", "ref-stats", str(ref), str(tmp_path / "ref.npz"), "--inception-weights", str(inception_weights)]) == 0
    out = capsys.readouterr().out
    assert "from n = 10 images" in out and f"skipped 1 unreadable file(s): {ref / 'broken.png'}" in out
    value, n = fid.fid(images.list_images(a), ref, feature=PooledPixels())
    assert n == 10 and np.isfinite(value)


def test_mostly_unreadable_reference_aborts_with_the_limit(sets, inception_weights, tmp_path, capsys):
    ref = write_images(tmp_path / "ref", 3, seed=5)
    for i in range(5):
        (ref / f"broken{i}.png").write_bytes(b"")
    assert main(["eval", "ref-stats", str(ref), str(tmp_path / "r.npz"), "--inception-weights", str(inception_weights)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # besides the progress bar
    assert len(errors) == 1 and "past the limit of 10%" in errors[0] and "raise --max-unreadable" in errors[0]
    assert not (tmp_path / "r.npz").exists()
    a, _ = sets
    with pytest.raises(ValueError, match="past the limit of 50%: 5 of 8 so far"):
        fid.fid(images.list_images(a), ref, feature=PooledPixels(), unreadable=images.UnreadableFiles(0.5))
