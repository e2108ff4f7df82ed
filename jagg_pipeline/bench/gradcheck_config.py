"""The gradient diagnostic's settings and choices, torch-free so that ``gradcheck --help`` is fast.

:mod:`jagg_pipeline.bench.gradcheck` runs the diagnostic and checks at import that these choices
name the backbones and dtypes it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jagg_pipeline.core.options import EndpointBackward, NoInterpVariant, Weights, option_field

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
    # The engines' own defaults (core.options), the ones a training step uses.
    weights: Weights = option_field("weights")
    no_interp: NoInterpVariant = option_field("no_interp")
    endpoint_backward: EndpointBackward = option_field("endpoint_backward")
    seed: int = 0
