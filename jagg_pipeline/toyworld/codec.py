"""The toy world's VAE: a fixed, exactly lossless space-to-depth codec in diffusers format.

Pixels in [-1, 1] [B, 3, H, W] <-> latents [B, 3 f^2, H/f, W/f] by pixel (un)shuffle. It is a
diffusers ``ModelMixin`` saved with ``save_pretrained`` and named in the toy checkpoint's
``model_index.json`` by its import path, so the diffusers pipelines and the backbone adapters
load it through their ordinary loading code. Its config carries the fields both VAE contracts
read: ``block_out_channels``/``scaling_factor``/``shift_factor`` (the KL VAE of SD3 and Flux)
and ``z_dim``/``latents_mean``/``latents_std``/``temperal_downsample`` (QwenImage's video VAE,
whose latents carry a frame axis: 5-D tensors pass through with their frame axis kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn


@dataclass
class _Latents:
    """What ``encode`` returns in place of a posterior: the (deterministic) latents."""

    latents: torch.Tensor

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.latents

    def mode(self) -> torch.Tensor:
        return self.latents


@dataclass
class _EncoderOutput:
    latent_dist: _Latents


@dataclass
class _DecoderOutput:
    sample: torch.Tensor


class PixelShuffleCodec(ModelMixin, ConfigMixin):
    """Lossless space-to-depth by ``factor`` (a power of two) standing in for a VAE.

    diffusers' pipeline loader finds the load method by looking ``ModelMixin`` up in this
    module, which the import above provides.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        factor: int = 2,
        scaling_factor: float = 1.0,
        shift_factor: float = 0.0,
        block_out_channels: tuple[int, ...] = (12, 12),
        z_dim: int = 12,
        latents_mean: tuple[float, ...] = (0.0,) * 12,
        latents_std: tuple[float, ...] = (1.0,) * 12,
    ) -> None:
        super().__init__()
        levels = int(math.log2(factor))
        if 2**levels != factor:
            raise ValueError(f"factor must be a power of two, got {factor}")
        channels = in_channels * factor * factor
        if len(block_out_channels) != levels + 1 or z_dim != channels:
            raise ValueError(
                f"a factor-{factor} codec of {in_channels} channels needs "
                f"len(block_out_channels) == {levels + 1} and z_dim == {channels}"
            )
        if len(latents_mean) != channels or len(latents_std) != channels:
            raise ValueError(f"latents_mean/latents_std need {channels} entries")
        # diffusers reads a model's dtype and device from its tensors; a codec has no weights.
        self.register_buffer("anchor", torch.zeros(1))
        self.temperal_downsample = [False] * levels

    @property
    def latent_channels(self) -> int:
        return self.config.z_dim

    def _per_frame(self, x: torch.Tensor, op) -> torch.Tensor:
        if x.dim() == 5:  # QwenImage layout (B, C, frames, h, w)
            frames = x.shape[2]
            flat = x.transpose(1, 2).flatten(0, 1)
            out = op(flat, self.config.factor)
            return out.unflatten(0, (-1, frames)).transpose(1, 2)
        return op(x, self.config.factor)

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        """Pixels in [-1, 1] to latents (exact)."""
        latents = self._per_frame(x, nn.functional.pixel_unshuffle)
        return _EncoderOutput(_Latents(latents)) if return_dict else (_Latents(latents),)

    def decode(self, z: torch.Tensor, return_dict: bool = True):
        """Latents to pixels in [-1, 1] (exact inverse of :meth:`encode`)."""
        pixels = self._per_frame(z, nn.functional.pixel_shuffle)
        return _DecoderOutput(pixels) if return_dict else (pixels,)


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float [-1, 1]."""
    return images.to(torch.float32) / 127.5 - 1.0


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """float [-1, 1] -> uint8 (rounded, clamped): exact inverse of :func:`to_unit_range`."""
    return ((pixels.to(torch.float32) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
