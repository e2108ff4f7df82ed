"""Rewards: one scorer per module behind a registry, ``(images, prompts) -> tensor[B]``.

Images are float [B, 3, H, W] in [0, 1] (see :mod:`jagg_pipeline.rewards.base`); scores are
float32, computed without grad. Registered rewards: ``hpsv21``, ``pickscore``, ``clipscore``,
``jpeg_compressibility``, and the toy world's ``toy_attributes`` and ``toy_clipscore``;
:mod:`~jagg_pipeline.rewards.registry` says how to add one and what
the ``rewards:`` config section looks like, :mod:`~jagg_pipeline.rewards.multi` how several
rewards combine into one advantage.

The names below load on first use (PEP 562): importing a torch-free module of the package
(:mod:`~jagg_pipeline.rewards.toy_scene`'s captions, which ``config check`` parses) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name -> the module that defines it.
_EXPORTS = {
    "RewardConfigError": "base",
    "RewardFn": "base",
    "check_batch": "base",
    "to_unit_float": "base",
    "MultiReward": "multi",
    "MultiRewardResult": "multi",
    "combine_rewards": "multi",
    "REWARDS": "registry",
    "RewardInfo": "registry",
    "RewardsConfig": "registry",
    "load_reward": "registry",
    "parse_rewards": "registry",
    "parse_spec": "registry",
    "reward_info": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
