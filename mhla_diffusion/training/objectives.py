"""Training objectives as upstream trains each family.

DDPM (DiT, PixArt): epsilon MSE plus, when the model predicts its variance (2x output
channels), the variational bound term of improved DDPM (Nichol & Dhariwal 2021) with the mean
detached, so the variance head learns from the VLB only. Flow matching (SANA, Wan2.1):
velocity target noise - x0, timesteps from a shifted logit-normal.

All randomness comes from the global RNG, which the loop seeds per step (resume-exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class NoisyBatch:
    model_input: torch.Tensor
    timestep: torch.Tensor  # what the transformer receives
    target: torch.Tensor
    x0: torch.Tensor
    t: torch.Tensor  # integer DDPM step or flow sigma


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(1)


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)), elementwise."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def discretized_gaussian_nll(x, mean, log_scale):
    """-log p(x) of data in [-1, 1] quantized to 256 levels under N(mean, e^(2 log_scale)), elementwise."""
    inv_std = torch.exp(-log_scale)
    upper = torch.special.ndtr(inv_std * (x - mean + 1 / 255))
    lower = torch.special.ndtr(inv_std * (x - mean - 1 / 255))
    log_upper = torch.log(upper.clamp_min(1e-12))
    log_one_minus_lower = torch.log((1 - lower).clamp_min(1e-12))
    log_delta = torch.log((upper - lower).clamp_min(1e-12))
    return -torch.where(x < -0.999, log_upper, torch.where(x > 0.999, log_one_minus_lower, log_delta))


class DDPMObjective:
    """Epsilon prediction on the pipeline scheduler's beta schedule, + VLB for learned variance."""

    def __init__(self, scheduler_config: dict, learned_variance: bool):
        from diffusers import DDPMScheduler

        betas = DDPMScheduler.from_config(scheduler_config).betas.double()
        self.num_timesteps = len(betas)
        self.learned_variance = learned_variance
        alphas = 1.0 - betas
        ab = torch.cumprod(alphas, 0)
        ab_prev = torch.cat([torch.ones(1, dtype=ab.dtype), ab[:-1]])
        post_var = betas * (1 - ab_prev) / (1 - ab)
        self.tables = {
            "sqrt_ab": ab.sqrt(), "sqrt_1m_ab": (1 - ab).sqrt(),
            "sqrt_recip_ab": (1 / ab).sqrt(), "sqrt_recipm1_ab": (1 / ab - 1).sqrt(),
            "post_c1": betas * ab_prev.sqrt() / (1 - ab), "post_c2": (1 - ab_prev) * alphas.sqrt() / (1 - ab),
            # log of the posterior variance, clipped at t = 0 where it is 0 (as improved DDPM does)
            "post_logvar": torch.log(torch.cat([post_var[1:2], post_var[1:]])), "log_betas": betas.log(),
        }

    def _at(self, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return _bcast(self.tables[name].to(t.device)[t], like)

    def noisy(self, x0: torch.Tensor) -> NoisyBatch:
        t = torch.randint(0, self.num_timesteps, (x0.shape[0],), device=x0.device)
        noise = torch.randn(x0.shape, dtype=x0.dtype, device=x0.device)  # not randn_like: layout-independent
        xt = self._at("sqrt_ab", t, x0) * x0 + self._at("sqrt_1m_ab", t, x0) * noise
        return NoisyBatch(xt, t, noise, x0, t)

    def loss(self, output: torch.Tensor, nb: NoisyBatch) -> torch.Tensor:
        output = output.float()
        eps, var = output.chunk(2, dim=1) if self.learned_variance else (output, None)
        loss = _per_sample_mean((eps - nb.target) ** 2)
        if var is not None:
            loss = loss + self._vlb(eps.detach(), var, nb)
        return loss.mean()

    def _vlb(self, eps, var, nb: NoisyBatch) -> torch.Tensor:
        """Per-sample variational bound term in bits per dimension."""
        t, xt, x0 = nb.t, nb.model_input.float(), nb.x0.float()
        at = lambda name: self._at(name, t, xt)  # noqa: E731
        true_mean = at("post_c1") * x0 + at("post_c2") * xt
        x0_pred = at("sqrt_recip_ab") * xt - at("sqrt_recipm1_ab") * eps
        model_mean = at("post_c1") * x0_pred + at("post_c2") * xt
        frac = (var + 1) / 2  # the network outputs v in [-1, 1] between the two variance bounds
        model_logvar = frac * at("log_betas") + (1 - frac) * at("post_logvar")
        kl = _per_sample_mean(normal_kl(true_mean, at("post_logvar"), model_mean, model_logvar))
        nll = _per_sample_mean(discretized_gaussian_nll(x0, model_mean, 0.5 * model_logvar))
        return torch.where(t == 0, nll, kl) / math.log(2.0)


class FlowMatchingObjective:
    """Rectified flow: x_t = (1 - s) x0 + s noise, target noise - x0, s = shift(sigmoid(N(m, std)))."""

    def __init__(self, shift: float, logit_mean: float, logit_std: float, num_train_timesteps: int = 1000,
                 sigma_range: tuple[float, float] = (0.0, 1.0)):
        self.shift, self.logit_mean, self.logit_std = shift, logit_mean, logit_std
        self.num_train_timesteps = num_train_timesteps
        self.sigma_range = sigma_range  # an expert's share of the noise levels: s scaled into [lo, hi]

    def noisy(self, x0: torch.Tensor) -> NoisyBatch:
        u = torch.sigmoid(torch.randn(x0.shape[0], device=x0.device) * self.logit_std + self.logit_mean)
        sigma = self.shift * u / (1 + (self.shift - 1) * u)
        lo, hi = self.sigma_range
        sigma = lo + (hi - lo) * sigma
        noise = torch.randn(x0.shape, dtype=x0.dtype, device=x0.device)  # not randn_like: layout-independent
        s = _bcast(sigma, x0)
        return NoisyBatch((1 - s) * x0 + s * noise, sigma * self.num_train_timesteps, noise - x0, x0, sigma)

    def loss(self, output: torch.Tensor, nb: NoisyBatch) -> torch.Tensor:
        return F.mse_loss(output.float(), nb.target.float())


def build_objective(kind: str, transformer, scheduler_config: dict | None, config, sigma_range=None):
    """The objective `kind` ("ddpm" or "flow") for this transformer; `sigma_range`: an expert's noise levels."""
    if kind == "flow":
        return FlowMatchingObjective(config.flow_shift, config.logit_mean, config.logit_std,
                                     sigma_range=sigma_range or (0.0, 1.0))
    if sigma_range is not None:
        raise ValueError("training one expert of a two-expert pipeline needs the flow objective")
    if scheduler_config is None:
        raise ValueError("the ddpm objective needs the pipeline's scheduler config (load a pipeline, not a bare transformer)")
    learned = transformer.config.out_channels == 2 * transformer.config.in_channels
    return DDPMObjective(dict(scheduler_config), learned_variance=learned)


def model_output(out):
    """The prediction tensor of a diffusers model output."""
    return out.sample if hasattr(out, "sample") else out[0]
