"""CLIPScore: CLIP ViT-L/14, torchmetrics convention max(100 cos, 0), in [0, 100].

Model: transformers ``CLIPModel`` (``openai/clip-vit-large-patch14``, as torchmetrics uses)
and its processor (the model's own unless ``processor`` is set), each a local
``save_pretrained`` directory or a hub id. Range [0, 100]; real image-caption pairs typically
score 25-35. Per sample the score equals torchmetrics' ``CLIPScore`` on that one pair, except
for prompts beyond the text context, which are truncated keeping the end-of-text token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from jagg_pipeline.config.run import ClipScoreConfig
from jagg_pipeline.rewards.base import BatchedReward, RewardFn, resolve_dtype
from jagg_pipeline.rewards.clip import HFClip, load_hf_clip

NAME = "clipscore"


SPEC = ClipScoreConfig  # the settings type, defined (torch-free) in jagg_pipeline.config.run


def clipscore(clip: HFClip, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """max(100 cos(image_i, prompt_i), 0)."""
    return (100.0 * clip.cosine(images, prompts)).clamp(min=0.0)


def load(spec: ClipScoreConfig, device: torch.device, name: str = NAME) -> RewardFn:
    """Load the model and processor named by ``spec`` onto ``device``.

    ``name``: the reward's config name in errors (the toy CLIPScore reuses this loader).
    """
    dtype = resolve_dtype(name, spec.dtype)
    processor = spec.processor if spec.processor is not None else spec.model
    clip = load_hf_clip(name, spec.model, processor, device, dtype)
    return BatchedReward(
        name, partial(clipscore, clip), device, spec.batch_size, modules=[clip.model]
    )
