"""The reward registry and the ``rewards:`` config section.

A reward is one module exposing ``NAME`` (its registry and config name), ``SPEC`` (the plain
dataclass of its settings, every field with a default) and ``load(spec, device) -> RewardFn``;
its docstring's first line is its summary in ``--help``. The spec classes and the section type
:class:`~jagg_pipeline.config.run.RewardsConfig` live in :mod:`jagg_pipeline.config.run`, which must
stay
torch-free; adding a reward (e.g. the toy world's ``toy_attributes``) is one such module, its
entry in ``_MODULES``, and its spec class plus its field in ``RewardsConfig`` there (checked at
import below). Scorer modules import their heavy dependencies (open_clip, transformers) inside
``load``.

The section, as YAML::

    rewards:
      weights: {hpsv21: 1.0, pickscore: 0.5}  # which rewards run, and their weights
      normalize_separately: false             # group-normalise each reward before weighting
      hpsv21: {checkpoint: /models/HPS_v2.1_compressed.pt}
      pickscore: {model: /models/PickScore_v1, processor: /models/CLIP-ViT-H-14}

Model settings may also be given for rewards that are not weighted (e.g. evaluation-only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, get_type_hints

import torch

from jagg_pipeline.config.fields import ConfigError, check_bounds, from_dict
from jagg_pipeline.config.run import REWARD_NAMES, RewardsConfig
from jagg_pipeline.rewards import (
    clipscore,
    hpsv21,
    jpeg,
    pickscore,
    toy_attributes,
    toy_clipscore,
)
from jagg_pipeline.rewards.base import RewardConfigError, RewardFn, spec_from_mapping

_MODULES: tuple[ModuleType, ...] = (
    hpsv21,
    pickscore,
    clipscore,
    jpeg,
    toy_attributes,
    toy_clipscore,
)


@dataclass(frozen=True)
class RewardInfo:
    """A registered reward: its name, spec type, loader and one-line summary."""

    name: str
    spec_type: type
    load: Callable[[Any, torch.device], RewardFn]
    summary: str


def _info(module: ModuleType) -> RewardInfo:
    summary = (module.__doc__ or "").strip().splitlines()[0]
    return RewardInfo(module.NAME, module.SPEC, module.load, summary)


REWARDS: dict[str, RewardInfo] = {module.NAME: _info(module) for module in _MODULES}


def _check_against_config() -> None:
    """The registry and the config's ``rewards`` section must list the same rewards and specs."""
    if tuple(REWARDS) != REWARD_NAMES:
        raise ImportError(f"registered rewards {tuple(REWARDS)} differ from {REWARD_NAMES}")
    hints = get_type_hints(RewardsConfig)
    for name, info in REWARDS.items():
        if info.spec_type is not hints[name]:
            raise ImportError(
                f"reward {name}: SPEC {info.spec_type.__name__} is not the type of "
                f"RewardsConfig.{name} ({hints[name].__name__})"
            )


_check_against_config()


def reward_info(name: str) -> RewardInfo:
    """The registered reward ``name``; the error lists the known ones."""
    if name not in REWARDS:
        raise RewardConfigError(
            f"rewards.{name}: unknown reward; known rewards: {', '.join(sorted(REWARDS))}"
        )
    return REWARDS[name]


def parse_spec(name: str, values: Mapping[str, Any] | None = None) -> Any:
    """The spec dataclass of reward ``name`` from a mapping of its settings (defaults if None)."""
    info = reward_info(name)
    if values is not None and not isinstance(values, Mapping):
        raise RewardConfigError(f"rewards.{name}: expected a mapping of settings, got {values!r}")
    return spec_from_mapping(name, info.spec_type, dict(values or {}))


def load_reward(name: str, spec: Any = None, device: str | torch.device = "cpu") -> RewardFn:
    """Load reward ``name`` from its spec (its defaults when ``spec`` is None) onto ``device``."""
    info = reward_info(name)
    if spec is None:
        spec = info.spec_type()
    elif not isinstance(spec, info.spec_type):
        raise TypeError(f"{name} needs a {info.spec_type.__name__}, got {type(spec).__name__}")
    check_bounds(spec, f"rewards.{name}", RewardConfigError)  # a spec built by code, unchecked
    return info.load(spec, torch.device(device))


def parse_rewards(section: Mapping[str, Any]) -> RewardsConfig:
    """Parse a ``rewards:`` mapping strictly into a :class:`RewardsConfig`; errors name the key.

    At least one reward must be weighted.
    """
    if not isinstance(section, Mapping):
        raise RewardConfigError(f"rewards: expected a mapping, got {section!r}")
    try:
        spec = from_dict(RewardsConfig, section, prefix="rewards")
    except ConfigError as err:
        raise RewardConfigError(str(err)) from None
    if not spec.weights:
        raise RewardConfigError(
            "rewards.weights: required, a non-empty mapping reward -> weight "
            f"(known rewards: {', '.join(sorted(REWARDS))})"
        )
    return spec


__all__ = [
    "REWARDS",
    "RewardInfo",
    "RewardsConfig",
    "load_reward",
    "parse_rewards",
    "parse_spec",
    "reward_info",
]
