"""The tests' tiny reward models: the package's builders, run once per session (test helper).

:mod:`jagg_pipeline.rewards.tiny` owns the models (real formats, tiny sizes, trained on
solid colours so that a matching caption scores higher than a mismatched one). The tests
share one open_clip HPS checkpoint, the same model's untrained weights (a control that fails
the ordering), and one transformers CLIP folder for both pickscore and clipscore, built under
pytest's base temp dir.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from jagg_pipeline.rewards.tiny import (
    COLOURS,
    IMAGE_SIZE,
    OPEN_CLIP_ARCH,
    OPEN_CLIP_CONFIG,
    build_hf_clip,
    build_hpsv21,
    caption,
    colour_images,
)

__all__ = [
    "COLOURS",
    "IMAGE_SIZE",
    "OPEN_CLIP_ARCH",
    "OPEN_CLIP_CONFIG",
    "TinyModels",
    "caption",
    "colour_images",
    "tiny_models",
]


@dataclass(frozen=True)
class TinyModels:
    hps_checkpoint: Path
    hps_checkpoint_untrained: Path
    hps_arch_json: Path
    hf_clip_dir: Path


@functools.cache
def tiny_models(root: Path) -> TinyModels:
    """Build the tiny models once per session (``root``: pytest's base temp dir)."""
    root = root / "tiny-reward-models"
    checkpoint, arch_json = build_hpsv21(root / "hpsv21")
    untrained, _ = build_hpsv21(root / "hpsv21-untrained", steps=0)
    return TinyModels(
        hps_checkpoint=checkpoint,
        hps_checkpoint_untrained=untrained,
        hps_arch_json=arch_json,
        hf_clip_dir=build_hf_clip(root / "tiny-clip"),
    )
