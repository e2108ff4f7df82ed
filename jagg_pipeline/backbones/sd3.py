"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline checkpoints): three text encoders.

What is SD3-specific: two CLIP text models with projection give the pooled vector (their
projections concatenated) and their PENULTIMATE hidden states (concatenated on the feature
axis, zero-padded to T5's width); T5 (no mask, padded to ``max_sequence_length``, default 256)
is appended along the token axis. Latents stay [B, C, h, w] (the transformer patchifies
itself) and the timestep is 1000 sigma. The schedule is the scheduler's static shift, which
its ``set_timesteps`` applies in its own way.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.backbones.conditioning import padded_ids, t5_embeds
from jagg_pipeline.backbones.training import JOINT_ATTENTION_TARGETS


class SD3Backbone(Backbone):
    """SD3Transformer2DModel + 2 x CLIPTextModelWithProjection + T5EncoderModel + AutoencoderKL."""

    family = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    text_components = (
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "text_encoder_3",
        "tokenizer_3",
    )
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    packed = False
    default_max_sequence_length = 256
    default_lora_targets = JOINT_ATTENTION_TARGETS

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        # Both CLIPs use the first tokenizer's length, as the pipeline does.
        clip_length = self.text["tokenizer"].model_max_length
        hidden, pooled = [], []
        for tokenizer, encoder in (
            ("tokenizer", "text_encoder"),
            ("tokenizer_2", "text_encoder_2"),
        ):
            ids = padded_ids(self.text[tokenizer], prompts, clip_length).to(self.device)
            out = self.text[encoder](ids, output_hidden_states=True)
            pooled.append(out.text_embeds)
            hidden.append(out.hidden_states[-2])
        t5 = t5_embeds(
            self.text["tokenizer_3"],
            self.text["text_encoder_3"],
            prompts,
            self.max_sequence_length,
            self.device,
        )
        clip = torch.cat(hidden, dim=-1)
        clip = functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip.to(t5.dtype), t5], dim=-2).to(self.dtype),
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1).to(self.dtype),
        }

    def predict(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        # SD3 takes the scheduler's timestep (1000 sigma, float32), not sigma.
        timestep = sigma.to(torch.float32) * float(self.scheduler.config.num_train_timesteps)
        return self.transformer(
            hidden_states=z,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
