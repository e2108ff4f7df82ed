"""Prompt conditioning: text encoders -> batched tensors, with the negative prompt's for CFG.

Owns the tokenizer / T5 helpers the families share (:func:`padded_ids`, :func:`t5_embeds`,
:func:`pad_tokens`), the :data:`NEGATIVE` key prefix of the unconditional tensors, and
:class:`ConditioningMixin`: :meth:`encode_prompts` around a family's ``_encode`` (positive
conditioning), adding the negative prompt's conditioning when classifier-free guidance is on.
The conditioning is a plain dict of tensors so it can be cached and fed to
:meth:`Backbone.velocity` without the text encoders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

NEGATIVE = "negative_"


def pad_tokens(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 (the token axis) of ``tensor`` up to ``length``."""
    missing = length - tensor.shape[1]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(tensor.shape[0], missing, *tensor.shape[2:])
    return torch.cat([tensor, pad], dim=1)


def padded_ids(tokenizer: Any, prompts: list[str], length: int) -> torch.Tensor:
    """Token ids padded and truncated to exactly ``length`` (how CLIP and T5 are fed)."""
    return tokenizer(
        prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    ).input_ids


def t5_embeds(
    tokenizer: Any, encoder: nn.Module, prompts: list[str], length: int, device: torch.device
) -> torch.Tensor:
    """T5 hidden states of ``prompts`` padded to ``length``, run WITHOUT an attention mask.

    Flux and SD3 were trained this way: the padding tokens take part, so ``length``
    (``max_sequence_length``) changes the conditioning.
    """
    return encoder(padded_ids(tokenizer, prompts, length).to(device))[0]


class ConditioningMixin:
    """The prompt side of :class:`Backbone` (uses its ``text``, ``spec`` and ``cfg_scale``)."""

    def _pair(
        self, cond: dict[str, torch.Tensor], negative: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Make conditional and unconditional tensors stackable (QwenImage pads lengths)."""
        return cond, negative

    def encode_prompts(
        self, prompts: Sequence[str], *, grad: bool = False
    ) -> dict[str, torch.Tensor]:
        """Batched conditioning of ``prompts`` (plus the negative prompt's when CFG is on).

        A dict of tensors batched along dim 0, on the backbone's device and dtype: it can be
        cached (e.g. safetensors) and fed to :meth:`velocity` without the text encoders.
        ``grad=True`` keeps the graph through the text encoders (the toy world trains them
        jointly with the transformer); GRPO never does.
        """
        with torch.set_grad_enabled(grad):
            return self._encode_with_negative(list(prompts))

    def _encode_with_negative(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        if not self.text:
            raise RuntimeError(
                f"text encoders were not loaded ({self.spec.key}.load_text_encoders is false): "
                "load precomputed conditioning instead of encoding prompts"
            )
        cond = self._encode(prompts)
        if self.cfg_scale > 1.0:
            single = self._encode([self.spec.negative_prompt])
            negative = {k: v.expand(len(prompts), *v.shape[1:]) for k, v in single.items()}
            cond, negative = self._pair(cond, negative)
            cond = {**cond, **{NEGATIVE + k: v.contiguous() for k, v in negative.items()}}
        return cond

    def _text_modules(self) -> list[nn.Module]:
        return [m for m in self.text.values() if isinstance(m, nn.Module)]
