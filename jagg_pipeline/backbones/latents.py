"""The latent space a backbone samples in: geometry, 2x2 packing, noise, schedule, decoding.

Owns :func:`pack_latents` / :func:`unpack_latents`, the base sigmas Flux and QwenImage pipelines
use (:func:`linspace_sigmas`), and :class:`LatentsMixin`: latent size and shape, initial noise,
the checkpoint's own sigma schedule (with dynamic-shift mu) and decoding with a KL VAE.

Latent layout: the sampler steps the layout the transformer consumes: packed
[B, (h/2)(w/2), 4C] tokens for Flux and QwenImage, [B, C, h, w] for SD3. ``sde.step`` is
elementwise, so the layout is invisible to the core; ``decode`` unpacks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2x2 patches as tokens, channels-major in a patch."""
    batch, channels, height, width = latents.shape
    patches = latents.view(batch, channels, height // 2, 2, width // 2, 2)
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(
        batch, (height // 2) * (width // 2), channels * 4
    )


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for a latent of ``height`` x ``width``."""
    batch, _, packed_channels = tokens.shape
    patches = tokens.view(batch, height // 2, width // 2, packed_channels // 4, 2, 2)
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(batch, packed_channels // 4, height, width)


def linspace_sigmas(num_steps: int) -> np.ndarray:
    """The base sigmas Flux and QwenImage pipelines hand to the scheduler: linspace(1, 1/N, N)."""
    return np.linspace(1.0, 1.0 / num_steps, num_steps)


class LatentsMixin:
    """The latent side of :class:`Backbone` (uses its ``vae``, ``scheduler``, ``packed``...)."""

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell (a KL VAE halves the size at every block but the last)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        channels = self.transformer.config.in_channels
        return channels // 4 if self.packed else channels

    def _latent_size(self) -> tuple[int, int]:
        """(h, w) of the unpacked latent; checks the image size fits the VAE and patching."""
        multiple = self.vae_scale_factor * 2
        if self.spec.height % multiple or self.spec.width % multiple:
            raise ValueError(
                f"{self.spec.key}.height/width ({self.spec.height}x{self.spec.width}) must be "
                f"multiples of {multiple} for this {self.family} checkpoint"
            )
        return self.spec.height // self.vae_scale_factor, self.spec.width // self.vae_scale_factor

    @property
    def image_seq_len(self) -> int:
        """Image tokens the transformer sees (2x2 patches): what dynamic shifting scales with."""
        return (self.latent_height // 2) * (self.latent_width // 2)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample shape of the latent the sampler steps (packed tokens or C x h x w)."""
        if self.packed:
            return (self.image_seq_len, self.latent_channels * 4)
        return (self.latent_channels, self.latent_height, self.latent_width)

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """x at sigma = 1, drawn exactly as the family's pipeline draws it (then packed)."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (batch, self.latent_channels, self.latent_height, self.latent_width)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return pack_latents(noise) if self.packed else noise

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] from final latents in the sampler's layout."""
        if self.packed:
            latents = unpack_latents(latents, self.latent_height, self.latent_width)
        pixels = self._decode_latents(latents.to(self.device, self.vae.dtype))
        return (pixels / 2 + 0.5).clamp(0, 1)

    def _decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """KL VAE (Flux, SD3): undo the scaling and shift, decode to [-1, 1]."""
        config = self.vae.config
        shift = config.shift_factor or 0.0
        return self.vae.decode(latents / config.scaling_factor + shift, return_dict=False)[0]

    # ---------------------------------------------------------------------------- schedule

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``num_steps + 1`` sigmas (float32, ending at 0) from the checkpoint's scheduler.

        Calls the scheduler's own ``set_timesteps`` with the arguments the family's pipeline
        passes (re-deriving the schedule gets SD3's and QwenImage's wrong).
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.scheduler.set_timesteps(num_steps, **self._schedule_kwargs(num_steps))
        return self.scheduler.sigmas.detach().to("cpu", torch.float32).clone()

    def _schedule_kwargs(self, num_steps: int) -> dict[str, Any]:
        """Extra ``set_timesteps`` arguments: ``mu`` when the scheduler shifts dynamically."""
        if not self.scheduler.config.get("use_dynamic_shifting", False):
            return {}
        return {"mu": self._mu()}

    def _mu(self) -> float:
        """Dynamic-shift mu from the image token count, as the pipelines compute it."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        return calculate_shift(
            self.image_seq_len,
            config.base_image_seq_len,
            config.max_image_seq_len,
            config.base_shift,
            config.max_shift,
        )
