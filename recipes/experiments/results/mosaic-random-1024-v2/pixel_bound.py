"""Per-pixel bound of the random-mosaic experiment (issue 21), from the repo root:
`PYTHONPATH=. python recipes/experiments/results/mosaic-random-1024-v2/pixel_bound.py` (CPU, seconds).

The eps-loss of the best denoiser that sees only its own pixel (and its position, and the digit class of
its cell when given): the level a model with no spatial context (uniform attention) can reach."""
import torch
torch.set_num_threads(1)
from mhla_diffusion.experiments import pixel_dit
from mhla_diffusion.experiments.digits_data import load_digits
from mhla_diffusion.training.objectives import DDPMObjective
scans = load_digits(8)
x, y = scans.train_images.flatten(1), scans.train_labels  # (N, 64)
vals = torch.linspace(-1, 1, 17)
idx = ((x + 1) / 2 * 16).round().long()
assert torch.allclose(vals[idx], x, atol=1e-5)
obj = DDPMObjective(pixel_dit.SCHEDULER, learned_variance=False)
ab, s1 = obj.tables["sqrt_ab"].float(), obj.tables["sqrt_1m_ab"].float()
def hist(rows):  # (64, 17) empirical marginal per pixel position
    return torch.stack([torch.bincount(idx[rows, p], minlength=17) for p in range(64)]).float() / len(rows)
g = torch.Generator().manual_seed(0)
def mmse(cond):
    H = {c: hist(torch.nonzero(y == c).flatten()) for c in range(10)} if cond else None
    Hall = hist(torch.arange(len(y)))
    tot, n = torch.zeros(1000), torch.zeros(1000)
    for rep in range(20):
        i = torch.randint(len(y), (len(y),), generator=g)
        t = torch.randint(0, 1000, (len(i),), generator=g)
        x0 = x[i]; eps = torch.randn(x0.shape, generator=g)
        a, s = ab[t][:, None], s1[t][:, None]
        xt = a * x0 + s * eps
        prior = torch.stack([H[int(c)] for c in y[i]]) if cond else Hall.expand(len(i), -1, -1)  # (B,64,17)
        logw = -((xt[..., None] - a[..., None] * vals) ** 2) / (2 * s[..., None] ** 2) + (prior + 1e-12).log()
        w = torch.softmax(logw, -1)
        x0hat = (w * vals).sum(-1)
        epshat = (xt - a * x0hat) / s
        per = ((eps - epshat) ** 2).mean(1)
        tot.index_add_(0, t, per); n.index_add_(0, t, torch.ones_like(per))
    return (tot.sum() / n.sum()).item(), (tot[:300].sum() / n[:300].sum()).item(), (tot[300:].sum() / n[300:].sum()).item()
print("per-pixel MMSE eps-loss (all t, t<300, t>=300), position only (random mosaics):", mmse(False))
print("per-pixel MMSE eps-loss, position + cell's digit class (fixed layouts, no dropout):", mmse(True))
