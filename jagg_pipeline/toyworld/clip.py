"""The toy CLIP: a tiny transformers ``CLIPModel`` trained contrastively on toy pairs.

Saved with ``save_pretrained`` together with a ``CLIPProcessor`` (the toy world's word-level
tokenizer and an image processor that only rescales and normalises 32 x 32 images), so the real
CLIPScore code path (:mod:`jagg_pipeline.rewards.clipscore`) loads and scores it. It is the
held-out second metric next to the attribute reward: a policy that games the reward's pixel
statistics does not fool it the same way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jagg_pipeline.rewards import toy_scene as data
from jagg_pipeline.toyworld.config import ToyClipConfig
from jagg_pipeline.toyworld.text import word_tokenizer

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ClipResult:
    """Loss curve and wall time of the contrastive training."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def build_clip(settings: ToyClipConfig) -> tuple[Any, Any]:
    """A randomly initialised tiny ``CLIPModel`` and its ``CLIPProcessor``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = word_tokenizer("clip")
    width, layers = settings.width, settings.layers
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "max_position_embeddings": tokenizer.model_max_length,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "image_size": data.IMAGE_SIZE,
            "patch_size": 4,
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
        },
        projection_dim=width,
    )
    torch.manual_seed(settings.seed)
    model = CLIPModel(config)
    image_processor = CLIPImageProcessor(
        do_resize=False,
        do_center_crop=False,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _pixels(images: torch.Tensor) -> torch.Tensor:
    """uint8 images normalised exactly as the saved image processor does it."""
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (images.to(torch.float32) / 255.0 - mean) / std


def embed(model: Any, processor: Any, images: torch.Tensor, captions: list[str]):
    """Normalised image and text embeddings of uint8 images and captions."""
    tokens = processor.tokenizer(captions, padding=True, return_tensors="pt")
    image = model.get_image_features(pixel_values=_pixels(images)).pooler_output
    text = model.get_text_features(**tokens).pooler_output
    return nn.functional.normalize(image, dim=-1), nn.functional.normalize(text, dim=-1)


def train_clip(
    model: Any, processor: Any, settings: ToyClipConfig, progress: Any = None
) -> ClipResult:
    """Symmetric InfoNCE on fresh toy pairs; duplicated captions in a batch are not negatives."""
    gen = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / settings.steps))
    )
    model.train()
    result = ClipResult()
    start = time.perf_counter()
    for _ in range(settings.steps):
        batch = data.sample_batch(settings.batch, gen)
        image, text = embed(model, processor, batch.images, batch.captions)
        logits = model.logit_scale.exp() * image @ text.T
        same = torch.tensor(
            [[a == b for b in batch.captions] for a in batch.captions], dtype=torch.bool
        )
        # Pairs that share a caption are positives too: mask them out of the negatives.
        logits = logits.masked_fill(same & ~torch.eye(len(same), dtype=torch.bool), -1e4)
        target = torch.arange(len(same))
        loss = 0.5 * (
            nn.functional.cross_entropy(logits, target)
            + nn.functional.cross_entropy(logits.T, target)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        result.losses.append(loss.item())
        if progress is not None:
            # Shown at the bar's next refresh: redrawing every step floods a log file.
            progress.set_postfix(loss=f"{result.losses[-1]:.3f}", refresh=False)
            progress.update(1)
    model.eval()
    result.seconds = time.perf_counter() - start
    return result


@torch.no_grad()
def retrieval_top1(
    model: Any, processor: Any, candidates: int = 16, samples: int = 256, seed: int = 1
) -> float:
    """Top-1 accuracy of picking an image's caption among ``candidates`` (held-out images).

    The distractors are random other captions of the whole toy world.
    """
    gen = torch.Generator().manual_seed(seed)
    held = data.split()[1]
    batch = data.sample_batch(samples, gen, held)
    everything = [a.caption() for a in data.ALL_ATTRIBUTES]
    correct = 0
    for image, caption in zip(batch.images, batch.captions, strict=True):
        others = [c for c in everything if c != caption]
        picks = torch.randperm(len(others), generator=gen)[: candidates - 1].tolist()
        options = [caption, *(others[i] for i in picks)]
        image_emb, text_emb = embed(model, processor, image[None], options)
        correct += int((image_emb @ text_emb.T).argmax()) == 0
    return correct / samples


def save_clip(model: Any, processor: Any, directory: str | Path) -> Path:
    """Write the model and processor in the transformers format."""
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
