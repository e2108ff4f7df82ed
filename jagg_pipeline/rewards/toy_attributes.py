"""Toy attributes: whether an image shows its toy caption's shape, colour, position, background.

The toy world's programmatic reward (:mod:`jagg_pipeline.toyworld.attributes`): background match
x object overlap x shape margin, each in [0, 1], so the product is in [0, 1]; the data's own
images score ~1. Model-free; images are rounded to uint8 (the renderer's precision). Prompts
must be toy-world captions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jagg_pipeline.config import ToyAttributesSpec
from jagg_pipeline.rewards.base import BatchedReward, RewardConfigError, RewardFn, to_uint8

NAME = "toy_attributes"


SPEC = ToyAttributesSpec  # the settings type, defined (torch-free) in jagg_pipeline.config


def toy_attributes(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """The attribute score of float [0, 1] images against their toy captions."""
    from jagg_pipeline.toyworld.attributes import score_attributes

    try:
        return score_attributes(to_uint8(images).cpu(), list(prompts)).total
    except ValueError as err:
        raise RewardConfigError(f"rewards.{NAME}: {err}") from None


def load(spec: ToyAttributesSpec, device: torch.device) -> RewardFn:
    """The reward; it runs on the CPU whatever ``device`` is."""
    return BatchedReward(NAME, toy_attributes, torch.device("cpu"), spec.batch_size)
