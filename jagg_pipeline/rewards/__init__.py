"""Rewards: one scorer per module behind a registry, ``(images, prompts) -> tensor[B]``.

Images are float [B, 3, H, W] in [0, 1] (see :mod:`jagg_pipeline.rewards.base`); scores are
float32, computed without grad. Registered rewards: ``hpsv21``, ``pickscore``, ``clipscore``,
``jpeg_compressibility``, and the toy world's ``toy_attributes`` and ``toy_clipscore``;
:mod:`~jagg_pipeline.rewards.registry` says how to add one and what
the ``rewards:`` config section looks like, :mod:`~jagg_pipeline.rewards.multi` how several
rewards combine into one advantage.
"""

from jagg_pipeline.rewards.base import (
    RewardConfigError,
    RewardFn,
    check_batch,
    to_unit_float,
)
from jagg_pipeline.rewards.multi import MultiReward, MultiRewardResult, combine_rewards
from jagg_pipeline.rewards.registry import (
    REWARDS,
    RewardInfo,
    RewardsConfig,
    load_reward,
    parse_rewards,
    parse_spec,
    reward_info,
)

__all__ = [
    "REWARDS",
    "MultiReward",
    "MultiRewardResult",
    "RewardConfigError",
    "RewardFn",
    "RewardInfo",
    "RewardsConfig",
    "check_batch",
    "combine_rewards",
    "load_reward",
    "parse_rewards",
    "parse_spec",
    "reward_info",
    "to_unit_float",
]
