"""Toy attributes: whether an image shows its toy caption's shape, colour, position, background.

The toy world's programmatic reward. The truth comes from the caption
(:func:`~jagg_pipeline.rewards.toy_scene.parse_caption`) and the renderer's own geometry
(:func:`~jagg_pipeline.rewards.toy_scene.shape_mask`). Three parts, each in
[0, 1], combined by their geometric mean, (background x overlap x shape)^(1/3): a zero in any
part zeros the total, so no part can be traded for another (an additive version was gamed by
big filled blocks). The cube root is a monotone map of the plain product (it
ranks every set of samples the same way) that gives graded credit: a policy whose three parts
are each about 0.5 scores about 0.5, not 0.125, so a group's samples differ visibly and the
GRPO signal does not vanish near zero.

- background: soft colour match of the pixels away from the object with the background colour;
- overlap: soft IoU of the object-colour map with the true shape mask at the true position;
- shape: how much better the true shape's mask explains the object-colour map than the best
  other shape at that position, relative to what a perfect drawing achieves (1 perfect, 1/2
  a shapeless blob, 0 a clearly wrong shape).

A pure function of uint8 images and captions; the data's own images score 1. Model-free; the
reward rounds images to uint8 (the renderer's precision) and runs on the CPU. Prompts must be
toy-world captions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jagg_pipeline.config.run import ToyAttributesConfig
from jagg_pipeline.rewards import toy_scene as data
from jagg_pipeline.rewards.base import BatchedReward, RewardConfigError, RewardFn, to_uint8

NAME = "toy_attributes"

# Colour distance (RGB in [0, 1], L2) up to which a pixel matches fully: the data's jitter.
MATCH_RADIUS = data.COLOUR_JITTER * 3**0.5 / 255.0
# Beyond it the match decays like a Gaussian of this width: narrow enough that the closest
# object/background pair (purple on gray, 0.43 apart) does not match (exp(-9.6)).
MATCH_WIDTH = 0.08
# Pixels this far (px) outside the true object count as background.
BACKGROUND_MARGIN = 2


@dataclass
class AttributeScores:
    """Per-image parts and their geometric mean, each a float32 tensor [B] in [0, 1]."""

    background: torch.Tensor
    overlap: torch.Tensor
    shape: torch.Tensor
    total: torch.Tensor


def colour_match(images: torch.Tensor, colours: torch.Tensor) -> torch.Tensor:
    """Soft match [B, H, W] of each pixel of uint8 images [B, 3, H, W] with ``colours`` [B, 3]."""
    pixels = images.to(torch.float32) / 255.0
    target = colours.to(torch.float32)[:, :, None, None] / 255.0
    distance = (pixels - target).norm(dim=1)
    excess = (distance - MATCH_RADIUS).clamp_min(0.0)
    return torch.exp(-(excess**2) / (2 * MATCH_WIDTH**2))


def soft_iou(match: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum min(m, M) / sum max(m, M) over pixels, per image: the fuzzy-set IoU."""
    m = mask.to(match.dtype).expand_as(match)
    return torch.minimum(match, m).flatten(1).sum(1) / torch.maximum(match, m).flatten(1).sum(1)


@functools.lru_cache(maxsize=256)
def _mask(shape: str, position: str, size: int) -> torch.Tensor:
    """The renderer's mask, cached: every batch asks for the same few dozen."""
    return data.shape_mask(shape, position, size)


def _dilate(mask: torch.Tensor, pixels: int) -> torch.Tensor:
    kernel = 2 * pixels + 1
    grown = torch.nn.functional.max_pool2d(
        mask[None, None].to(torch.float32), kernel, stride=1, padding=pixels
    )
    return grown[0, 0] > 0


def _shape_term(match: torch.Tensor, shape: str, position: str, size: int) -> torch.Tensor:
    true_mask = _mask(shape, position, size)
    others = [s for s in data.SHAPES if s != shape]
    margin = soft_iou(match, true_mask) - torch.stack(
        [soft_iou(match, _mask(s, position, size)) for s in others]
    ).amax(0)
    perfect = 1.0 - max(
        float(soft_iou(true_mask[None].float(), _mask(s, position, size))) for s in others
    )
    # 1 for the perfect drawing, 0 for a clearly wrong shape, 1/2 for a shapeless blob that
    # fits every shape equally: partial credit keeps the reward informative for blurry
    # policies (a pretrained toy DiT draws blobs before it draws shapes).
    return (0.5 + 0.5 * margin / perfect).clamp(0.0, 1.0)


def score_attributes(images: torch.Tensor, captions: Sequence[str]) -> AttributeScores:
    """Score uint8 images [B, 3, H, W] (any square size) against toy captions."""
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(
            f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}"
        )
    if len(captions) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
    size = images.shape[-1]
    attrs = [data.parse_caption(c) for c in captions]
    obj_colour = torch.tensor([data.COLOURS[a.colour] for a in attrs])
    bg_colour = torch.tensor([data.BACKGROUNDS[a.background] for a in attrs])
    obj_match = colour_match(images, obj_colour)
    bg_match = colour_match(images, bg_colour)

    background, overlap, shape = [], [], []
    for i, a in enumerate(attrs):
        true_mask = _mask(a.shape, a.position, size)
        away = ~_dilate(true_mask, BACKGROUND_MARGIN)
        background.append(bg_match[i][away].mean())
        overlap.append(soft_iou(obj_match[i : i + 1], true_mask)[0])
        shape.append(_shape_term(obj_match[i : i + 1], a.shape, a.position, size)[0])
    parts = [torch.stack(p).to(torch.float32) for p in (background, overlap, shape)]
    total = (parts[0] * parts[1] * parts[2]).clamp_min(0.0) ** (1.0 / 3.0)
    return AttributeScores(*parts, total=total)


SPEC = ToyAttributesConfig  # the settings type, defined (torch-free) in jagg_pipeline.config.run


def toy_attributes(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """The attribute score of float [0, 1] images against their toy captions."""
    try:
        return score_attributes(to_uint8(images).cpu(), list(prompts)).total
    except ValueError as err:
        raise RewardConfigError(f"rewards.{NAME}: {err}") from None


def load(spec: ToyAttributesConfig, device: torch.device) -> RewardFn:
    """The reward; it runs on the CPU whatever ``device`` is."""
    return BatchedReward(NAME, toy_attributes, torch.device("cpu"), spec.batch_size)
