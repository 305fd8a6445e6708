"""FID with torchmetrics' FrechetInceptionDistance: against an image folder or (mu, sigma) stats.

Precomputed stats (ADM / clean-fid `.npz` with `mu`, `sigma`, optional `n`) are loaded by
setting the metric's float64 real-side sums so that mu and sigma come back exactly. The
distance itself is computed from the metric's states by `frechet_distance` (same value as
compute(), several times faster at 2048-d).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import images, inception

# FID depends only on (mu, sigma): the states give both back exactly for any n >= 2. n only
# labels the stats; when an .npz lacks it we assume the FID-50K convention.
DEFAULT_REFERENCE_N = 50_000

log = logging.getLogger(__name__)


@dataclass
class FeatureStats:
    """Mean and covariance of n feature vectors."""

    mu: np.ndarray
    sigma: np.ndarray
    n: int

    def save(self, path) -> None:
        np.savez(path, mu=self.mu, sigma=self.sigma, n=np.int64(self.n))

    @classmethod
    def load(cls, path) -> "FeatureStats":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"reference stats {path} not found")
        with np.load(path) as data:
            missing = {"mu", "sigma"} - set(data.files)
            if missing:
                raise ValueError(f"{path} lacks {sorted(missing)}: a reference .npz needs 'mu' and 'sigma' (ADM / clean-fid format)")
            mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
            n = int(data["n"]) if "n" in data.files else DEFAULT_REFERENCE_N
        if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
            raise ValueError(f"{path}: mu must be (d,) and sigma (d, d), got {mu.shape} and {sigma.shape}")
        if n < 2:
            raise ValueError(f"{path}: stats from n = {n} images; FID needs at least 2")
        return cls(mu, sigma, n)


def make_metric(feature=None, inception_weights=None, device="cpu"):
    """FrechetInceptionDistance on `feature` (an nn.Module: uint8 images -> features), or on the
    standard 2048-d InceptionV3 when None (weights from `inception_weights` or the hub cache)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    if feature is None:
        path = inception.weights_path(inception_weights)
        metric = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=str(path))
    else:
        metric = FrechetInceptionDistance(feature=feature)
    return metric.to(device)


def num_features(metric) -> int:
    return metric.real_features_sum.numel()


def add_images(metric, paths, real: bool, batch_size: int = 50, desc: str | None = None, unreadable=None) -> None:
    """Feed image files to the real or fake side of `metric`, skipping into `unreadable` (if given)."""
    device = metric.real_features_sum.device
    with tqdm(total=len(paths), desc=desc, unit="img", disable=desc is None) as bar:
        for batch in images.batches(paths, batch_size, unreadable):
            metric.update(batch.to(device), real=real)
            bar.update(len(batch))


def add_reference_folder(metric, folder, batch_size: int, progress: bool, unreadable=None) -> int:
    """Feed every readable image under `folder` to the real side (unreadable ones are skipped under
    `unreadable`'s limit, by default images.MAX_UNREADABLE); returns how many were used."""
    paths = images.list_images(folder)
    check_count(len(paths), f"reference folder {folder}")
    unreadable = images.UnreadableFiles() if unreadable is None else unreadable
    add_images(metric, paths, real=True, batch_size=batch_size, desc="reference" if progress else None, unreadable=unreadable)
    n = len(paths) - len(unreadable.paths)
    check_count(n, f"reference folder {folder} (readable images)")
    return n


def set_real_stats(metric, stats: FeatureStats) -> None:
    """Make the real side of `metric` hold `stats` (sum = n mu, outer sum = (n-1) sigma + n mu mu^T)."""
    d = num_features(metric)
    if stats.mu.size != d:
        raise ValueError(f"reference stats have {stats.mu.size} features but the FID network gives {d}: they were made with another network")
    device = metric.real_features_sum.device
    mu = torch.as_tensor(stats.mu, dtype=torch.float64, device=device)
    sigma = torch.as_tensor(stats.sigma, dtype=torch.float64, device=device)
    metric.real_features_sum = stats.n * mu
    metric.real_features_cov_sum = (stats.n - 1) * sigma + stats.n * torch.outer(mu, mu)
    metric.real_features_num_samples = torch.tensor(stats.n, dtype=torch.long, device=device)


def side_stats(metric, real: bool) -> FeatureStats:
    """The (mu, sigma, n) of the images fed to one side of `metric`."""
    side = "real" if real else "fake"
    n = int(getattr(metric, f"{side}_features_num_samples"))
    mu = getattr(metric, f"{side}_features_sum") / n
    sigma = (getattr(metric, f"{side}_features_cov_sum") - n * torch.outer(mu, mu)) / (n - 1)
    return FeatureStats(mu.cpu().numpy(), sigma.cpu().numpy(), n)


def frechet_distance(a: FeatureStats, b: FeatureStats) -> float:
    """|mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^1/2), with tr (S_a S_b)^1/2 taken from the
    symmetric S_a^1/2 S_b S_a^1/2 (same eigenvalues). Two eigh calls instead of torchmetrics'
    general eigvals: at 2048-d on CPU about 5 s instead of 40 s, and no complex round-off."""
    d, n = a.mu.size, min(a.n, b.n)
    if n < d:
        log.warning("FID from %d samples on %d features: the covariance has rank < %d, so FID is biased upward and only "
                    "comparable at the same n; use at least %d samples per side (papers report FID-50K)", n, d, n, d)
    mu_a, mu_b, s_a, s_b = (torch.as_tensor(x, dtype=torch.float64) for x in (a.mu, b.mu, a.sigma, b.sigma))
    w, v = torch.linalg.eigh(s_a)
    root_a = (v * w.clamp_min(0).sqrt()) @ v.T
    inner = root_a @ s_b @ root_a
    trace_sqrt = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp_min(0).sqrt().sum()
    return float((mu_a - mu_b).square().sum() + s_a.trace() + s_b.trace() - 2 * trace_sqrt)


def check_count(n: int, what: str) -> None:
    if n < 2:
        raise ValueError(f"{what} has {n} image(s); FID needs at least 2 (a covariance needs two samples)")


def tensor_stats(images_uint8: torch.Tensor, feature, batch_size: int = 500, device="cpu") -> FeatureStats:
    """Stats of in-memory (N, 3, H, W) uint8 images on `feature` (no files: small experiments)."""
    check_count(len(images_uint8), "the image set")
    metric = make_metric(feature, device=device)
    for batch in images_uint8.split(batch_size):
        metric.update(batch.to(device), real=True)
    return side_stats(metric, real=True)


def folder_stats(folder, feature=None, inception_weights=None, batch_size: int = 50, progress: bool = False, device="cpu",
                 unreadable=None) -> FeatureStats:
    """Stats of every readable image under `folder` (what `eval ref-stats` writes)."""
    metric = make_metric(feature, inception_weights, device)
    add_reference_folder(metric, folder, batch_size, progress, unreadable)
    return side_stats(metric, real=True)


def load_reference(metric, reference, batch_size: int = 50, progress: bool = False, unreadable=None) -> int:
    """Fill the real side from an image folder or an .npz of stats; returns the reference's n."""
    reference = Path(reference)
    if not reference.exists():
        raise FileNotFoundError(f"reference {reference} not found: give an image folder or an .npz with mu and sigma")
    if reference.is_file():
        if reference.suffix != ".npz":
            raise ValueError(f"reference {reference} is a file but not an .npz of stats; give an image folder or an .npz with mu and sigma")
        stats = FeatureStats.load(reference)
        set_real_stats(metric, stats)
        return stats.n
    return add_reference_folder(metric, reference, batch_size, progress, unreadable)


def fid(fake_paths, reference, feature=None, inception_weights=None, batch_size: int = 50, progress: bool = False, device="cpu",
        unreadable=None) -> tuple[float, int]:
    """FID of the images `fake_paths` against `reference` (folder or .npz); returns (fid, reference n).
    Unreadable reference images are skipped under `unreadable`; an unreadable sample is an error."""
    check_count(len(fake_paths), "the generated set")
    metric = make_metric(feature, inception_weights, device)
    n_ref = load_reference(metric, reference, batch_size, progress, unreadable)
    add_images(metric, list(fake_paths), real=False, batch_size=batch_size, desc="samples" if progress else None)
    return frechet_distance(side_stats(metric, real=True), side_stats(metric, real=False)), n_ref
