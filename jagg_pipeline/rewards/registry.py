"""The reward registry and the ``rewards:`` config section.

A reward is one module exposing ``NAME`` (its registry and config name), ``SPEC`` (a plain
dataclass of its settings, every field with a default) and ``load(spec, device) -> RewardFn``;
its docstring's first line is its summary in ``--help``. Adding a reward (e.g. the toy world's
``toy_attributes``) is one such file plus its entry in ``_MODULES``. Scorer modules import
their heavy dependencies (open_clip, transformers) inside ``load``, so importing the registry
is cheap.

The section, as YAML::

    rewards:
      weights: {hpsv21: 1.0, pickscore: 0.5}  # which rewards run, and their weights
      normalize_separately: false             # group-normalise each reward before weighting
      hpsv21: {checkpoint: /models/HPS_v2.1_compressed.pt}
      pickscore: {model: /models/PickScore_v1, processor: /models/CLIP-ViT-H-14}

Model settings may also be given for rewards that are not weighted (e.g. evaluation-only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from jagg_pipeline.rewards import clipscore, hpsv21, jpeg, pickscore
from jagg_pipeline.rewards.base import RewardConfigError, RewardFn, spec_from_mapping

_MODULES: tuple[ModuleType, ...] = (hpsv21, pickscore, clipscore, jpeg)

# Keys of the section that are not reward names.
_SECTION_KEYS = ("weights", "normalize_separately")


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
    return info.load(spec, torch.device(device))


@dataclass
class RewardsSpec:
    """The ``rewards:`` section: weights of the rewards that run and each model's settings."""

    weights: dict[str, float]
    normalize_separately: bool = False
    specs: dict[str, Any] = field(default_factory=dict)

    def spec(self, name: str) -> Any:
        """The settings of reward ``name``: given ones, else its defaults."""
        return self.specs[name] if name in self.specs else reward_info(name).spec_type()

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data (for manifests); the inverse of :func:`parse_rewards`."""
        out: dict[str, Any] = {
            "weights": dict(self.weights),
            "normalize_separately": self.normalize_separately,
        }
        for name in sorted(set(self.weights) | set(self.specs)):
            out[name] = dataclasses.asdict(self.spec(name))
        return out


def parse_rewards(section: Mapping[str, Any]) -> RewardsSpec:
    """Parse a ``rewards:`` mapping strictly: unknown rewards or settings name their key."""
    if not isinstance(section, Mapping):
        raise RewardConfigError(f"rewards: expected a mapping, got {section!r}")
    weights_raw = section.get("weights")
    if not isinstance(weights_raw, Mapping) or not weights_raw:
        raise RewardConfigError(
            "rewards.weights: required, a non-empty mapping reward -> weight "
            f"(known rewards: {', '.join(sorted(REWARDS))})"
        )
    weights = {}
    for name, weight in weights_raw.items():
        reward_info(name)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise RewardConfigError(f"rewards.weights.{name}: expected a number, got {weight!r}")
        weights[name] = float(weight)
    normalize = section.get("normalize_separately", False)
    if not isinstance(normalize, bool):
        raise RewardConfigError(
            f"rewards.normalize_separately: expected true/false, got {normalize!r}"
        )
    specs = {
        name: parse_spec(name, values)
        for name, values in section.items()
        if name not in _SECTION_KEYS
    }
    return RewardsSpec(weights=weights, normalize_separately=normalize, specs=specs)
