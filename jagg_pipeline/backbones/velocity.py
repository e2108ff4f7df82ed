"""The velocity call ``(z, sigma, cond) -> v`` around a family's transformer forward.

Owns :class:`VelocityMixin`: classifier-free guidance as ONE batched forward ordered
[uncond; cond] (optionally rescaled per token to the conditional norm, as QwenImage does),
the guidance-embedding value of guidance-distilled checkpoints, and the timestep the
Flux/QwenImage transformers are fed. The forward itself is a family's ``predict``.
"""

from __future__ import annotations

import torch

from jagg_pipeline.backbones.conditioning import NEGATIVE
from jagg_pipeline.backbones.loading import BackboneLoadError
from jagg_pipeline.config.checkpoints import (
    DEFAULT_GUIDANCE,
    TRANSFORMER_CONFIG,
    guidance_embedded,
    option_problems,
)
from jagg_pipeline.config.run import BackboneConfig


class VelocityMixin:
    """The forward side of :class:`Backbone` (uses its ``predict``, ``cond_keys``, CFG settings)."""

    def velocity(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """v = eps - x0 at ``z``; with CFG one batched forward over [uncond; cond]."""
        if self.cfg_scale <= 1.0:
            return self.predict(z, sigma, cond)
        missing = [NEGATIVE + k for k in self.cond_keys if NEGATIVE + k not in cond]
        if missing:
            raise KeyError(
                f"conditioning lacks {missing}: it was encoded without CFG; re-encode it with "
                f"{self.spec.key}.cfg_scale > 1"
            )
        both = {k: torch.cat([cond[NEGATIVE + k], cond[k]]) for k in self.cond_keys}
        uncond, text = self.predict(torch.cat([z, z]), torch.cat([sigma, sigma]), both).chunk(2)
        guided = uncond + self.cfg_scale * (text - uncond)
        if self.cfg_rescale:
            # Per token (last dim of the packed layout): keep the conditional prediction's norm.
            guided = guided * (
                torch.norm(text, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True)
            )
        return guided

    def __call__(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self.velocity(z, sigma, cond)

    def _unit_timestep(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Timestep in [0, 1] as Flux/QwenImage pipelines compute it: (1000 sigma in dtype) / 1000.

        The pipelines round the scheduler's 1000-scaled timestep to the latent dtype before
        dividing; doing the same keeps low-precision runs on the pipeline's numbers.
        """
        scale = float(self.scheduler.config.num_train_timesteps)
        return (sigma * scale).to(dtype) / scale

    def _guidance_value(self, spec: BackboneConfig) -> float | None:
        """The guidance-embedding value, or None if the transformer has no guidance embedding.

        A setting the transformer cannot honour is refused here as the workflow refuses it
        before any job (:func:`~jagg_pipeline.config.checkpoints.option_problems`).
        """
        config = self.transformer.config
        problems = option_problems(spec, config, str(self.path / TRANSFORMER_CONFIG))
        if problems:
            raise BackboneLoadError("; ".join(problems))
        if guidance_embedded(config):
            return DEFAULT_GUIDANCE if spec.guidance_scale is None else float(spec.guidance_scale)
        return None
