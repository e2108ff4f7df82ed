"""Weighted multi-reward: per-reward columns, their weighted total and the GRPO advantage.

Two ways to turn several rewards into one advantage, both used in practice:
- ``normalize_separately=False``: total = sum_k w_k r_k, advantage = group-normalised total;
- ``normalize_separately=True``: advantage = sum_k w_k A_k with A_k each reward's own group
  advantage, so a reward's scale (PickScore ~20, HPS ~0.3) does not decide its influence; only
  the weights do. The weighted sum is not normalised again (its spread follows the weights).
Group advantages come from :func:`jagg_pipeline.core.grpo.group_advantages` (clipping included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from jagg_pipeline.core.grpo import StdMode, group_advantages
from jagg_pipeline.rewards.base import RewardFn
from jagg_pipeline.rewards.registry import RewardsConfig, load_reward


@dataclass
class MultiRewardResult:
    """One row per sample: a column per reward, the weighted total, the advantage (or None)."""

    columns: dict[str, torch.Tensor]
    total: torch.Tensor
    advantages: torch.Tensor | None


def combine_rewards(
    columns: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: torch.Tensor | None = None,
    *,
    normalize_separately: bool = False,
    std_mode: StdMode = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> MultiRewardResult:
    """Weighted total of ``columns`` and, given ``group_ids``, the GRPO advantage.

    ``columns`` and ``weights`` must name the same rewards; ``std_mode``, ``eps`` and ``clip``
    are passed to :func:`~jagg_pipeline.core.grpo.group_advantages`.
    """
    if set(columns) != set(weights) or not columns:
        raise ValueError(
            f"columns {sorted(columns)} and weights {sorted(weights)} must name the same, "
            "non-empty set of rewards"
        )
    names = list(weights)
    total = sum(weights[name] * columns[name].float() for name in names)
    advantages = None
    if group_ids is not None:
        options = {"std_mode": std_mode, "eps": eps, "clip": clip}
        if normalize_separately:
            advantages = sum(
                weights[name] * group_advantages(columns[name].float(), group_ids, **options).values
                for name in names
            )
        else:
            advantages = group_advantages(total, group_ids, **options).values
    return MultiRewardResult(
        columns={name: columns[name].float() for name in names},
        total=total,
        advantages=advantages,
    )


class MultiReward:
    """Several loaded rewards with their weights; calling it scores a batch with all of them."""

    def __init__(
        self,
        rewards: Mapping[str, RewardFn],
        weights: Mapping[str, float],
        *,
        normalize_separately: bool = False,
        std_mode: StdMode = "group",
        eps: float = 1e-4,
        clip: float | None = 5.0,
    ) -> None:
        if set(rewards) != set(weights):
            raise ValueError(f"rewards {sorted(rewards)} and weights {sorted(weights)} differ")
        self.rewards = dict(rewards)
        self.weights = dict(weights)
        self.normalize_separately = normalize_separately
        self._advantage_options = {"std_mode": std_mode, "eps": eps, "clip": clip}

    @classmethod
    def from_spec(
        cls, spec: RewardsConfig, device: str | torch.device = "cpu", **advantage_options
    ) -> MultiReward:
        """Load every weighted reward of a ``rewards:`` section onto ``device``."""
        rewards = {name: load_reward(name, spec.spec(name), device) for name in spec.weights}
        return cls(
            rewards,
            spec.weights,
            normalize_separately=spec.normalize_separately,
            **advantage_options,
        )

    def columns(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Every reward's scores of one batch, by reward name."""
        return {name: reward(images, prompts) for name, reward in self.rewards.items()}

    def combine(
        self, columns: Mapping[str, torch.Tensor], group_ids: torch.Tensor | None = None
    ) -> MultiRewardResult:
        """:func:`combine_rewards` with this reward's weights and advantage options.

        Separate from scoring so that columns scored batch by batch (e.g. images of different
        sizes) are combined once, with whole groups.
        """
        return combine_rewards(
            columns,
            self.weights,
            group_ids,
            normalize_separately=self.normalize_separately,
            **self._advantage_options,
        )

    def __call__(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        group_ids: torch.Tensor | None = None,
    ) -> MultiRewardResult:
        """Score ``images`` against ``prompts`` with every reward and combine the columns."""
        return self.combine(self.columns(images, prompts), group_ids)
