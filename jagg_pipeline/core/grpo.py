"""GRPO maths: group-relative advantages, the PPO-clip loss, KL to a reference, diagnostics.

Pure tensor functions; nothing here knows about diffusion, samplers or distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Reduction = Literal["mean", "sum", "none"]
StdMode = Literal["group", "global"]


@dataclass
class Advantages:
    """Per-sample advantages and the group statistics worth logging."""

    values: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    zero_std_groups: int


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std_mode: StdMode = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> Advantages:
    """A = (r - mean_group) / (std + eps), clipped to +-``clip``.

    ``std_mode="group"`` divides by each group's population std, ``"global"`` by the std of
    the whole batch. ``group_ids`` are arbitrary integers labelling the prompt group of each
    sample; ``group_mean``/``group_std`` come back per sample (broadcast from the group).
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be equal-length 1-D tensors, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if std_mode not in ("group", "global"):
        raise ValueError(f"std_mode must be 'group' or 'global', got {std_mode!r}")
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    counts = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inverse, torch.ones_like(r))
    sums = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inverse, r)
    means = sums / counts
    centred = r - means[inverse]
    sq = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inverse, centred**2)
    group_std = torch.sqrt(sq / counts)
    std = group_std[inverse] if std_mode == "group" else r.std(unbiased=False).expand_as(r)
    adv = centred / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    zero_std = int((group_std == 0).sum())
    return Advantages(
        values=adv.to(rewards.dtype),
        group_mean=means[inverse].to(rewards.dtype),
        group_std=group_std[inverse].to(rewards.dtype),
        zero_std_groups=zero_std,
    )


def _reduce(x: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    if reduction == "none":
        return x
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def ppo_clip_loss(
    log_prob_new: torch.Tensor,
    log_prob_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """max(-A rho, -A clip(rho, 1 - e, 1 + e)) with rho = exp(logp_new - logp_old).

    ``log_prob_old`` is treated as a constant. ``reduction="none"`` returns per-sample values.
    """
    ratio = torch.exp(log_prob_new - log_prob_old.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return _reduce(torch.maximum(unclipped, clipped), reduction)


def kl_to_reference(
    mean: torch.Tensor,
    mean_ref: torch.Tensor,
    std: torch.Tensor,
    beta: float,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Beta * mean over latent elements of (mean - mean_ref)^2 / (2 std^2), per sample.

    The KL between two Gaussians of equal std; ``mean_ref`` comes from the frozen reference.
    """
    diff2 = (mean - mean_ref.detach()) ** 2
    if std.dim() == 1:
        std = std.reshape(-1, *([1] * (diff2.dim() - 1)))
    per_sample = (diff2 / (2.0 * std**2)).reshape(diff2.shape[0], -1).mean(dim=1)
    return _reduce(beta * per_sample, reduction)


@torch.no_grad()
def clip_fraction(
    log_prob_new: torch.Tensor, log_prob_old: torch.Tensor, clip_range: float
) -> torch.Tensor:
    """Fraction of samples whose ratio lies outside [1 - e, 1 + e]."""
    ratio = torch.exp(log_prob_new - log_prob_old)
    return ((ratio - 1.0).abs() > clip_range).to(torch.float32).mean()


@torch.no_grad()
def max_ratio_deviation(log_prob_new: torch.Tensor, log_prob_old: torch.Tensor) -> torch.Tensor:
    """max |ratio - 1|: 0 on an exactly on-policy step; compare it with the clip range."""
    return (torch.exp(log_prob_new - log_prob_old) - 1.0).abs().max().to(torch.float32)


@torch.no_grad()
def approx_kl(log_prob_new: torch.Tensor, log_prob_old: torch.Tensor) -> torch.Tensor:
    """0.5 mean((logp_new - logp_old)^2), the usual low-variance estimate of KL(old || new)."""
    return 0.5 * ((log_prob_new - log_prob_old) ** 2).to(torch.float32).mean()
