"""Toy CLIPScore: CLIPScore (max(100 cos, 0), in [0, 100]) under the toy world's CLIP.

The same code path as ``clipscore`` (:mod:`jagg_pipeline.rewards.clipscore`) with the toy CLIP
that ``python -m jagg_pipeline toyworld build`` trains and saves; the held-out second metric
next to ``toy_attributes``.
"""

from __future__ import annotations

import torch

from jagg_pipeline.config.run import ClipScoreConfig, ToyClipScoreConfig
from jagg_pipeline.rewards import clipscore
from jagg_pipeline.rewards.base import RewardFn

NAME = "toy_clipscore"


SPEC = ToyClipScoreConfig  # the settings type, defined (torch-free) in jagg_pipeline.config.run


def load(spec: ToyClipScoreConfig, device: torch.device) -> RewardFn:
    """Load the toy CLIP named by ``spec`` onto ``device``."""
    shared = ClipScoreConfig(model=spec.model, dtype=spec.dtype, batch_size=spec.batch_size)
    return clipscore.load(shared, device, name=NAME)
