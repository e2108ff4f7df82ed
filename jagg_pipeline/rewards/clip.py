"""CLIP-style scoring shared by the scorers: paired cosine and the transformers CLIP embedder.

Every CLIP-based reward is a function of one number per pair, cos(image_i, prompt_i); the
scorers differ only in the model, its preprocessing and the map from cosine to score
(HPSv2.1: cos; PickScore: exp(logit_scale) cos; CLIPScore: max(100 cos, 0)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from jagg_pipeline.config.sources import load_pretrained_dir
from jagg_pipeline.rewards.base import RewardConfigError, config_key, to_uint8


def paired_cosine(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    """cos(image_i, text_i) for each row, computed in float32 whatever the model dtype."""
    image = image_features.float()
    text = text_features.float()
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    return (image * text).sum(dim=-1)


def _pooled(output: Any) -> torch.Tensor:
    # transformers 5 returns a ModelOutput whose pooler_output holds the projected features;
    # transformers 4 returned the tensor itself.
    return output if isinstance(output, torch.Tensor) else output.pooler_output


@dataclass
class HFClip:
    """A transformers ``CLIPModel`` with its ``CLIPProcessor``, in eval mode on one device."""

    model: Any
    processor: Any

    @property
    def device(self) -> torch.device:
        return self.model.logit_scale.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.logit_scale.dtype

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Projected image features of float [0, 1] images via the processor's own transforms.

        The images are rounded to uint8 first, so the processor sees exactly what it sees for
        an image file (its torchvision backend resizes uint8 images in uint8): scores of a
        saved PNG and of the tensor it was saved from agree, and agree with reference code
        that feeds PIL images. Resizing, cropping and normalising run on the images' device.
        """
        inputs = self.processor.image_processor(images=to_uint8(images), return_tensors="pt")
        pixels = inputs["pixel_values"]
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        return _pooled(self.model.get_image_features(pixel_values=pixels))

    def text_features(self, prompts: Sequence[str]) -> torch.Tensor:
        """Projected text features; prompts longer than the model's context are truncated."""
        tokens = self.processor.tokenizer(
            list(prompts),
            padding=True,
            truncation=True,
            max_length=self.model.config.text_config.max_position_embeddings,
            return_tensors="pt",
        ).to(self.device)
        return _pooled(
            self.model.get_text_features(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
            )
        )

    def cosine(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """cos(image_i, prompt_i) under this model."""
        return paired_cosine(self.image_features(images), self.text_features(prompts))


def load_hf_clip(
    reward: str,
    model: str,
    processor: str,
    device: torch.device,
    dtype: torch.dtype,
) -> HFClip:
    """Load a ``CLIPModel`` and ``CLIPProcessor`` (local dirs first, hub ids second).

    transformers builds the model on the meta device (no random initialisation) and reads the
    weights straight onto ``device`` in ``dtype``. Errors name ``rewards.<reward>.model`` or
    ``rewards.<reward>.processor``.
    """
    from transformers import CLIPModel, CLIPProcessor

    clip_model = load_pretrained_dir(
        config_key(reward, "model"),
        model,
        "a local directory holding a transformers CLIPModel (save_pretrained) or a hub id",
        lambda source: CLIPModel.from_pretrained(source, dtype=dtype, device_map=device),
        RewardConfigError,
    )
    clip_processor = load_pretrained_dir(
        config_key(reward, "processor"),
        processor,
        "a local directory holding a CLIPProcessor (save_pretrained) or a hub id",
        CLIPProcessor.from_pretrained,
        RewardConfigError,
    )
    clip_model.eval().requires_grad_(False)
    return HFClip(model=clip_model, processor=clip_processor)
