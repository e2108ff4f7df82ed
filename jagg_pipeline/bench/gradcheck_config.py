"""The gradient diagnostic's settings and choices, torch-free so that ``gradcheck --help`` is fast.

:mod:`jagg_pipeline.bench.gradcheck` runs the diagnostic and checks at import that these choices
name the backbones and dtypes it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BACKBONES: tuple[str, ...] = ("affine", "mlp-dit", "tiny-flux", "tiny-sd3", "tiny-qwenimage")
TRAJECTORIES: tuple[str, ...] = ("chord", "sde")
DTYPE_NAMES: tuple[str, ...] = ("float32", "float64")


@dataclass
class GradcheckConfig:
    """Everything the diagnostic depends on (defaults: Flow-GRPO on an SD3.5-like schedule)."""

    backbone: str = "affine"
    window: int = 4
    trajectory: Literal["chord", "sde"] = "chord"
    dtype: str = "float64"
    jagg_frac: float = 1.0
    num_steps: int = 10
    batch: int = 4
    shift: float = 3.0
    noise_level: float = 0.7
    clip_range: float = 1e-4
    weights: Literal["time", "index"] = "time"
    no_interp: Literal["drop", "nearest"] = "drop"
    # As training's default (jagg.endpoint_backward), so the backward calls counted here are
    # the ones a training step makes.
    endpoint_backward: Literal["joint", "sequential"] = "sequential"
    seed: int = 0
