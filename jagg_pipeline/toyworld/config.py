"""What a toy-world build trains and for how long: plain dataclasses, importable without torch.

The command line reads its defaults from here (``toyworld --help`` stays fast); the builders
(:mod:`~jagg_pipeline.toyworld.pretrain`, :mod:`~jagg_pipeline.toyworld.clip`,
:mod:`~jagg_pipeline.toyworld.build`) take them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOY_FAMILIES: tuple[str, ...] = ("sd3", "flux", "qwenimage")


@dataclass
class PretrainConfig:
    """Budget and optimiser of one backbone's pretraining (calibrated on the toy world).

    Objects appear suddenly, after 800-1200 steps, and step count matters more than batch size
    (SD3 toy, one thread, measured 2026-12-01: 1600 x 24 reached held-out attribute reward
    0.41 and 0.66 for seeds 0 and 1; 1200 x 48, the former default, 0.41 in 300-450 s). The
    defaults, 1800 x 16, take ~250 s and give 0.38 for seed 0: the build fits 6 minutes.
    """

    steps: int = 1800
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    ema_decay: float = 0.995
    caption_dropout: float = 0.1
    seed: int = 0


@dataclass
class ToyClipConfig:
    """Size and budget of the toy CLIP: 150k parameters, ~55 s, top-1 0.965 among 16 captions."""

    steps: int = 500
    batch: int = 64
    lr: float = 1e-3
    width: int = 64
    layers: int = 2
    seed: int = 0


@dataclass
class BuildConfig:
    """What to build and how long to train it."""

    family: str = "sd3"
    seed: int = 0
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    clip: ToyClipConfig = field(default_factory=ToyClipConfig)
    eval_steps: int = 20
    eval_per_caption: int = 2


def experiment_sections(world: str | Path, family: str = "sd3") -> dict[str, Any]:
    """Config sections that point the default experiment at a built toy world ``world``.

    The backbone checkpoint of ``family``, the toy CLIP for ``toy_clipscore``, tracking off:
    what tests, benchmarks and notebooks merge into their config data.
    """
    world = Path(world)
    return {
        "backbone": {"path": str(world / family)},
        "rewards": {"toy_clipscore": {"model": str(world / "clip")}},
        "tracking": {"backend": "none"},
    }
