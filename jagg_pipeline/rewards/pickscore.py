"""PickScore: CLIP-H tuned on Pick-a-Pic; exp(logit_scale) * cosine (typically 18-24).

Model: transformers ``CLIPModel`` (``yuvalkirstain/PickScore_v1``) with the processor of
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, each a local ``save_pretrained`` directory or a hub
id. Range [-exp(logit_scale), exp(logit_scale)]; the released model has exp(logit_scale) = 100
and typical scores of 18-24.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from jagg_pipeline.config.run import PickScoreConfig
from jagg_pipeline.rewards.base import BatchedReward, RewardFn, resolve_dtype
from jagg_pipeline.rewards.clip import HFClip, load_hf_clip

NAME = "pickscore"


SPEC = PickScoreConfig  # the settings type, defined (torch-free) in jagg_pipeline.config.run


def pickscore(clip: HFClip, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """exp(logit_scale) * cos(image_i, prompt_i), as PickScore's reference inference does."""
    return clip.model.logit_scale.exp().float() * clip.cosine(images, prompts)


def load(spec: PickScoreConfig, device: torch.device) -> RewardFn:
    """Load the model and processor named by ``spec`` onto ``device``."""
    dtype = resolve_dtype(NAME, spec.dtype)
    clip = load_hf_clip(NAME, spec.model, spec.processor, device, dtype)
    return BatchedReward(
        NAME, partial(pickscore, clip), device, spec.batch_size, modules=[clip.model]
    )
