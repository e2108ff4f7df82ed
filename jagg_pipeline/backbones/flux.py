"""Flux (FluxPipeline checkpoints): CLIP pooled + T5 conditioning, packed latents, guidance.

What is Flux-specific: the CLIP text model gives only its pooled output, T5 the token
sequence (no mask, padded to ``max_sequence_length``, default 512); latents are 2x2-packed
tokens with 2-D position ids [0, row, col] and all-zero text ids; the transformer takes the
timestep as sigma in [0, 1]; a guidance-distilled checkpoint (``guidance_embeds``, Flux-dev)
gets the raw guidance scale through its guidance embedding; the schedule is the scheduler's
dynamic shift with mu from the packed image-token count.
"""

from __future__ import annotations

from typing import Any

import torch

from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.backbones.conditioning import padded_ids, t5_embeds
from jagg_pipeline.backbones.latents import linspace_sigmas
from jagg_pipeline.backbones.training import JOINT_ATTENTION_TARGETS


def image_ids(height: int, width: int) -> torch.Tensor:
    """[height * width, 3] position ids (0, row, col) of a grid of packed latent tokens."""
    rows = torch.arange(height)[:, None].expand(height, width)
    cols = torch.arange(width)[None, :].expand(height, width)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)


class FluxBackbone(Backbone):
    """FluxTransformer2DModel + CLIPTextModel + T5EncoderModel + AutoencoderKL."""

    family = "flux"
    pipeline_class = "FluxPipeline"
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    packed = True
    default_max_sequence_length = 512
    default_lora_targets = (
        *JOINT_ATTENTION_TARGETS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        clip_tokenizer = self.text["tokenizer"]
        clip_ids = padded_ids(clip_tokenizer, prompts, clip_tokenizer.model_max_length)
        pooled = self.text["text_encoder"](clip_ids.to(self.device)).pooler_output
        sequence = t5_embeds(
            self.text["tokenizer_2"],
            self.text["text_encoder_2"],
            prompts,
            self.max_sequence_length,
            self.device,
        )
        return {
            "prompt_embeds": sequence.to(self.dtype),
            "pooled_prompt_embeds": pooled.to(self.dtype),
        }

    def predict(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        text = cond["prompt_embeds"]
        guidance = None
        if self.guidance_scale is not None:
            # FluxPipeline passes the raw scale in float32; the model multiplies by 1000.
            guidance = torch.full(
                (z.shape[0],), self.guidance_scale, device=z.device, dtype=torch.float32
            )
        ids = image_ids(self.latent_height // 2, self.latent_width // 2)
        return self.transformer(
            hidden_states=z,
            timestep=self._unit_timestep(sigma, z.dtype),
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=text,
            txt_ids=text.new_zeros(text.shape[1], 3),
            img_ids=ids.to(z.device, z.dtype),
            return_dict=False,
        )[0]

    def _schedule_kwargs(self, num_steps: int) -> dict[str, Any]:
        kwargs = super()._schedule_kwargs(num_steps)
        if not self.scheduler.config.get("use_flow_sigmas", False):
            kwargs["sigmas"] = linspace_sigmas(num_steps)
        return kwargs
