"""QwenImage (QwenImagePipeline checkpoints): Qwen2.5-VL text, 3-D VAE, masked text tokens.

What is QwenImage-specific: prompts are wrapped in a chat template whose first 34 tokens
(the system prompt) are dropped from the text encoder's last hidden states; the remaining
tokens are variable-length, so conditioning carries a mask (pipeline convention: an all-ones
mask is passed as None). Latents are 2x2-packed; ``img_shapes`` give the packed grid; the
timestep is sigma in [0, 1]. True CFG rescales the guided prediction per token to the
conditional norm (on by default). The schedule is the scheduler's dynamic shift plus its
``shift_terminal`` stretch. The VAE is a 3-D (video) KL VAE with per-channel mean/std.

The last transformer block's text-stream output is discarded, so its ``attn.to_add_out`` and
``txt_mlp`` never receive a gradient: :meth:`QwenImageBackbone.dead_modules` keeps them
frozen and out of the LoRA targets.
"""

from __future__ import annotations

from typing import Any

import torch

from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.backbones.conditioning import pad_tokens
from jagg_pipeline.backbones.latents import linspace_sigmas
from jagg_pipeline.backbones.training import JOINT_ATTENTION_TARGETS

# QwenImagePipeline's prompt template and the number of its leading tokens it drops.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_TOKENS = 34
MAX_PROMPT_TOKENS = 1024


class QwenImageBackbone(Backbone):
    """QwenImageTransformer2DModel + Qwen2.5-VL text encoder + AutoencoderKLQwenImage."""

    family = "qwenimage"
    pipeline_class = "QwenImagePipeline"
    text_components = ("text_encoder", "tokenizer")
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")
    packed = True
    default_max_sequence_length = MAX_PROMPT_TOKENS
    default_cfg_rescale = True
    default_lora_targets = (
        *JOINT_ATTENTION_TARGETS,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "tokenizer" in self.text:
            prefix = PROMPT_TEMPLATE.split("{}")[0]
            count = len(self.text["tokenizer"](prefix).input_ids)
            if count != TEMPLATE_TOKENS:
                raise ValueError(
                    f"the tokenizer in {self.path / 'tokenizer'} encodes the QwenImage prompt "
                    f"template to {count} tokens, not {TEMPLATE_TOKENS}: the pipeline's fixed cut "
                    "would leak system-prompt text into (or drop prompt text from) the conditioning"
                )

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae.temperal_downsample)

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.text["tokenizer"](
            [PROMPT_TEMPLATE.format(p) for p in prompts],
            max_length=MAX_PROMPT_TOKENS + TEMPLATE_TOKENS,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        hidden = self.text["text_encoder"](
            input_ids=tokens.input_ids,
            attention_mask=tokens.attention_mask,
            output_hidden_states=True,
        ).hidden_states[-1]
        kept = [
            h[m.bool()][TEMPLATE_TOKENS:]
            for h, m in zip(hidden, tokens.attention_mask, strict=True)
        ]
        length = max(k.shape[0] for k in kept)
        embeds = torch.stack([pad_tokens(k[None], length)[0] for k in kept])
        mask = torch.stack(
            [pad_tokens(k.new_ones(1, k.shape[0], dtype=torch.long), length)[0] for k in kept]
        )
        limit = self.max_sequence_length
        return {
            "prompt_embeds": embeds[:, :limit].to(self.dtype),
            "prompt_embeds_mask": mask[:, :limit],
        }

    def _pair(
        self, cond: dict[str, torch.Tensor], negative: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Pad both to the longer token count (masked), so [uncond; cond] stack in one batch."""
        length = max(cond["prompt_embeds"].shape[1], negative["prompt_embeds"].shape[1])
        return (
            {k: pad_tokens(v, length) for k, v in cond.items()},
            {k: pad_tokens(v, length) for k, v in negative.items()},
        )

    def _trim_rows(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Cut a pool's padding: one call pads to the longest of its prompts (``_encode``)."""
        length = int(rows["prompt_embeds_mask"].sum(dim=1).max())
        return {k: v[:, :length] for k, v in rows.items()}

    def predict(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        mask = cond["prompt_embeds_mask"]
        guidance = None
        if self.guidance_scale is not None:
            guidance = torch.full(
                (z.shape[0],), self.guidance_scale, device=z.device, dtype=torch.float32
            )
        grid = (1, self.latent_height // 2, self.latent_width // 2)
        return self.transformer(
            hidden_states=z,
            timestep=self._unit_timestep(sigma, z.dtype),
            guidance=guidance,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[grid]] * z.shape[0],
            return_dict=False,
        )[0]

    def _schedule_kwargs(self, num_steps: int) -> dict[str, Any]:
        return {**super()._schedule_kwargs(num_steps), "sigmas": linspace_sigmas(num_steps)}

    def _decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        channels = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(channels).to(latents)
        std = torch.tensor(config.latents_std).view(channels).to(latents)
        # A one-frame video: (B, C, 1, h, w) in, first frame out.
        video = self.vae.decode(latents[:, :, None] * std + mean, return_dict=False)[0]
        return video[:, :, 0]

    def dead_modules(self) -> list[str]:
        last = len(self.transformer.transformer_blocks) - 1
        return [f"transformer_blocks.{last}.attn.to_add_out", f"transformer_blocks.{last}.txt_mlp"]
