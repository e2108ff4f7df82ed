"""Pretraining a toy backbone by rectified-flow matching on the toy data.

The transformer and the text encoders learn together (the toy text encoders start from
scratch): x_t = (1 - t) x0 + t eps with t logit-normal, the model regresses v = eps - x0 through
the backbone adapter's own ``encode_prompts``/``predict``, so the conventions trained here are
exactly the ones sampling uses. 10% of captions are dropped to "" (room for CFG). An EMA of the
weights is what gets saved. Deterministic on CPU for a given seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.backbones.latents import pack_latents
from jagg_pipeline.rewards import toy_scene as data
from jagg_pipeline.toyworld.codec import to_unit_range
from jagg_pipeline.toyworld.config import PretrainConfig


@dataclass
class PretrainResult:
    """The loss curve (per step) and the wall time."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def trainable_modules(backbone: Backbone) -> list[nn.Module]:
    """The transformer and every text encoder of the backbone."""
    return [backbone.transformer, *(m for m in backbone.text.values() if isinstance(m, nn.Module))]


def _latents(backbone: Backbone, images: torch.Tensor) -> torch.Tensor:
    """Data latents in the layout the sampler steps (the codec is the VAE; it is exact)."""
    pixels = to_unit_range(images)
    latents = backbone.vae.encode(pixels).latent_dist.sample()
    return pack_latents(latents) if backbone.packed else latents


def pretrain(backbone: Backbone, settings: PretrainConfig, progress: Any = None) -> PretrainResult:
    """Train ``backbone`` in place (its modules end up holding the EMA weights)."""
    import time

    modules = trainable_modules(backbone)
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    ema = [p.detach().clone() for p in params]
    # foreach kernels: the toy model has ~150 small tensors, so per-tensor loops cost as much as
    # the forward pass on a CPU.
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0, foreach=True)

    def lr_at(step: int) -> float:
        warm = min(1.0, (step + 1) / max(1, settings.warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * step / settings.steps))
        return warm * (0.1 + 0.9 * cosine)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    gen = torch.Generator().manual_seed(settings.seed)
    result = PretrainResult()
    start = time.perf_counter()
    for _ in range(settings.steps):
        batch = data.sample_batch(settings.batch, gen)
        drop = torch.rand(settings.batch, generator=gen) < settings.caption_dropout
        captions = ["" if d else c for d, c in zip(drop.tolist(), batch.captions, strict=True)]
        x0 = _latents(backbone, batch.images)
        eps = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(settings.batch, generator=gen))
        t_b = t.view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - t_b) * x0 + t_b * eps
        v = backbone.predict(x_t, t, backbone.encode_prompts(captions, grad=True))
        loss = nn.functional.mse_loss(v, eps - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1 - settings.ema_decay)
        result.losses.append(loss.item())
        if progress is not None:
            # Shown at the bar's next refresh: redrawing every step floods a log file.
            progress.set_postfix(loss=f"{result.losses[-1]:.4f}", refresh=False)
            progress.update(1)
    with torch.no_grad():
        torch._foreach_copy_(params, ema)
    for m in modules:
        m.eval().requires_grad_(False)
    result.seconds = time.perf_counter() - start
    return result
