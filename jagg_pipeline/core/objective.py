"""The per-step GRPO objective of a sampled trajectory: what the gradient engines differentiate.

Composes :mod:`jagg_pipeline.core.sde` (recompute the step's Gaussian from the current velocity and
score the recorded next latent) with :mod:`jagg_pipeline.core.grpo` (ratio, PPO-clip, optional KL).
The rollout records log-probs with :func:`jagg_pipeline.core.sde.sample`; this module recomputes
them through the same functions, so an unchanged policy gives ratio == 1 exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from jagg_pipeline.core import grpo, sde


def step_gaussian(
    v: torch.Tensor,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    k: int,
    coeffs: sde.StepCoefficients,
) -> sde.StepResult:
    """The Gaussian of step ``k`` (mean, std) given its velocity, no noise drawn."""
    return sde.step(v, latents[:, k], sigmas[k], sigmas[k + 1], None, coeffs, sigmas[1])


def step_log_prob(
    v: torch.Tensor,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    k: int,
    coeffs: sde.StepCoefficients,
) -> torch.Tensor:
    """Per-sample log-prob of the recorded latent ``k + 1`` under step ``k`` with velocity ``v``."""
    gaussian = step_gaussian(v, latents, sigmas, k, coeffs)
    return sde.log_prob(latents[:, k + 1], gaussian.mean, gaussian.std, coeffs.kind)


@torch.no_grad()
def recompute_log_probs(
    velocity: sde.Velocity,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    steps: Sequence[int],
    coeffs: sde.StepCoefficients,
) -> torch.Tensor:
    """[B, len(steps)] log-probs of the trained steps under the current policy, batch as sampled."""
    batch = latents.shape[0]
    columns = []
    for k in steps:
        v = velocity(latents[:, k], sde.sigma_batch(sigmas, k, batch, latents.dtype), cond)
        columns.append(step_log_prob(v, latents, sigmas, k, coeffs))
    return torch.stack(columns, dim=1)


class GRPOStepLoss:
    """``(v_k, k) -> scalar``: the PPO-clip loss of trained step ``k``, normalised.

    The loss summed over all trained steps is the mean over samples and steps of
    max(-A rho, -A clip(rho)) (+ beta KL to the reference when ``reference`` is given):
    ``normalizer`` defaults to B * number of trained steps, so the gradient does not depend on
    how steps are grouped into backward calls. Log-probs seen per step are kept for
    :meth:`diagnostics`.
    """

    def __init__(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        steps: Sequence[int],
        coeffs: sde.StepCoefficients,
        clip_range: float,
        *,
        normalizer: float | None = None,
        kl_beta: float = 0.0,
        reference: sde.Velocity | None = None,
        cond: Any = None,
    ) -> None:
        if kl_beta > 0 and reference is None:
            raise ValueError("kl_beta > 0 needs a reference velocity")
        self.latents = latents
        self.sigmas = sigmas
        self.old_log_probs = old_log_probs
        self.advantages = advantages
        self.steps = list(steps)
        self.coeffs = coeffs
        self.clip_range = clip_range
        self.normalizer = normalizer or float(latents.shape[0] * len(self.steps))
        self.kl_beta = kl_beta
        self.reference = reference
        self.cond = cond
        self.seen: dict[int, torch.Tensor] = {}

    def _reference_mean(self, k: int) -> torch.Tensor:
        batch = self.latents.shape[0]
        with torch.no_grad():
            v_ref = self.reference(
                self.latents[:, k],
                sde.sigma_batch(self.sigmas, k, batch, self.latents.dtype),
                self.cond,
            )
        return step_gaussian(v_ref, self.latents, self.sigmas, k, self.coeffs).mean

    def __call__(self, v: torch.Tensor, k: int) -> torch.Tensor:
        gaussian = step_gaussian(v, self.latents, self.sigmas, k, self.coeffs)
        logp = sde.log_prob(self.latents[:, k + 1], gaussian.mean, gaussian.std, self.coeffs.kind)
        self.seen[k] = logp.detach()
        adv = self.advantages.to(logp.dtype)
        per_sample = grpo.ppo_clip_loss(
            logp, self.old_log_probs[:, k], adv, self.clip_range, reduction="none"
        )
        if self.kl_beta > 0:
            per_sample = per_sample + grpo.kl_to_reference(
                gaussian.mean, self._reference_mean(k), gaussian.std, self.kl_beta, "none"
            )
        return per_sample.sum() / self.normalizer

    def diagnostics(self) -> dict[str, float]:
        """Clipfrac, approx-KL and max |ratio - 1| over the steps evaluated so far."""
        if not self.seen:
            return {"clipfrac": 0.0, "approx_kl": 0.0, "max_ratio_dev": 0.0}
        ks = sorted(self.seen)
        new = torch.stack([self.seen[k] for k in ks], dim=1)
        old = self.old_log_probs[:, ks].to(new.dtype)
        return {
            "clipfrac": float(grpo.clip_fraction(new, old, self.clip_range)),
            "approx_kl": float(grpo.approx_kl(new, old)),
            "max_ratio_dev": float(grpo.max_ratio_deviation(new, old)),
        }
