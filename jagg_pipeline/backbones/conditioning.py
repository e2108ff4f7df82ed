"""Prompt conditioning: text encoders -> batched tensors, with the negative prompt's for CFG.

Owns the tokenizer / T5 helpers the families share (:func:`padded_ids`, :func:`t5_embeds`,
:func:`pad_tokens`), the :data:`NEGATIVE` key prefix of the unconditional tensors, and
:class:`ConditioningMixin`: :meth:`encode_prompts` around a family's ``_encode`` (positive
conditioning), adding the negative prompt's conditioning when classifier-free guidance is on.
The conditioning is a plain dict of tensors so it can be cached and fed to
:meth:`Backbone.velocity` without the text encoders.

Precomputed conditioning (the encode stage, :mod:`jagg_pipeline.io.conditioning`): a pool is
encoded in batches (:meth:`~ConditioningMixin.encode_pool`,
:meth:`~ConditioningMixin.encode_negative`); a backbone given the pool
(:meth:`~ConditioningMixin.use_precomputed`, a :class:`ConditioningSource`) builds
``encode_prompts``' dict from the pool's rows of the prompts asked for
(:meth:`~ConditioningMixin.conditioning_from`), trimmed by the family to what encoding those
prompts together gives (``_trim_rows``), and loads no text encoder.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

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


class ConditioningSource(Protocol):
    """A prompt pool's precomputed conditioning, read by prompt text.

    The encode stage's artifact (:class:`jagg_pipeline.io.conditioning.PoolConditioning`).
    """

    def rows(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Positive conditioning of ``prompts`` [len(prompts), ...], padded as the pool is."""
        ...

    def negative(self) -> dict[str, torch.Tensor]:
        """The negative prompt's own conditioning [1, ...] (keys without :data:`NEGATIVE`).

        Raises an InputError naming the pool when it was encoded without CFG.
        """
        ...


class ConditioningMixin:
    """The prompt side of :class:`Backbone` (uses its ``text``, ``spec`` and ``cfg_scale``)."""

    # Set by use_precomputed: encode_prompts reads the pool's rows instead of encoding.
    precomputed: ConditioningSource | None = None

    def _pair(
        self, cond: dict[str, torch.Tensor], negative: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Make conditional and unconditional tensors stackable (QwenImage pads lengths)."""
        return cond, negative

    def _trim_rows(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of a pool's conditioning as encoding just these prompts together gives them.

        The pool pads its token axes to its longest prompt; a family whose encoding pads to
        the longest of the call cuts them back (QwenImage). Flux and SD3 pad T5 to
        ``max_sequence_length`` in every call: nothing to cut.
        """
        return rows

    def use_precomputed(self, source: ConditioningSource | None) -> None:
        """Read the conditioning of prompts from ``source`` from now on (None: encode them).

        :meth:`encode_prompts` then needs no text encoder (load with
        ``load_text_encoders: false``): the rollout and evaluate stages given a pool's
        conditioning (``--conditioning``).
        """
        self.precomputed = source

    def encode_prompts(
        self, prompts: Sequence[str], *, grad: bool = False
    ) -> dict[str, torch.Tensor]:
        """Batched conditioning of ``prompts`` (plus the negative prompt's when CFG is on).

        A dict of tensors batched along dim 0, on the backbone's device and dtype: it can be
        cached (e.g. safetensors) and fed to :meth:`velocity` without the text encoders.
        With a precomputed pool (:meth:`use_precomputed`) it is built from the pool's rows
        (:meth:`conditioning_from`), else encoded. ``grad=True`` keeps the graph through the
        text encoders (the toy world trains them jointly with the transformer); GRPO never does.
        """
        if self.precomputed is not None:
            if grad:
                raise ValueError("precomputed conditioning has no graph: grad=True needs encoders")
            return self.conditioning_from(self.precomputed, prompts)
        with torch.set_grad_enabled(grad):
            return self._encode_with_negative(list(prompts))

    def conditioning_from(
        self, source: ConditioningSource, prompts: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """:meth:`encode_prompts`' dict for ``prompts`` built from a pool's precomputed rows.

        The rows are trimmed as the family's own call on ``prompts`` pads (``_trim_rows``),
        then paired with the negative prompt's as :meth:`encode_prompts` pairs them.
        """
        positive = self._on_device(self._trim_rows(source.rows(list(prompts))))
        negative = None
        if self.cfg_scale > 1.0:
            negative = self._on_device(self._trim_rows(source.negative()))
        return self._with_negative(positive, negative)

    def encode_pool(
        self, prompts: Sequence[str], batch_size: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The positive conditioning of ``prompts``, ``batch_size`` prompts at a time, on the CPU.

        What the encode stage writes: one batch of activations at a time on the device.
        Each batch is padded as the family pads one call (:meth:`_trim_rows` undoes a pool's
        padding to the same).
        """
        self._require_text()
        for start in range(0, len(prompts), batch_size):
            with torch.no_grad():
                batch = self._encode(list(prompts[start : start + batch_size]))
            yield {key: value.cpu() for key, value in batch.items()}

    def encode_negative(self) -> dict[str, torch.Tensor] | None:
        """The negative prompt's own conditioning [1, ...] on the CPU (None: CFG is off)."""
        self._require_text()
        with torch.no_grad():
            negative = self._negative()
        return None if negative is None else {k: v.cpu() for k, v in negative.items()}

    def _require_text(self) -> None:
        if not self.text:
            raise RuntimeError(
                f"text encoders were not loaded ({self.spec.key}.load_text_encoders is false): "
                "load precomputed conditioning instead of encoding prompts"
            )

    def _negative(self) -> dict[str, torch.Tensor] | None:
        if self.cfg_scale > 1.0:
            return self._encode([self.spec.negative_prompt])
        return None

    def _encode_with_negative(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        self._require_text()
        return self._with_negative(self._encode(prompts), self._negative())

    def _with_negative(
        self, cond: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """Positive rows and the negative prompt's single row (None: CFG off) as one dict.

        The negative's row is expanded to every prompt, both are made stackable
        (:meth:`_pair`) and the negative's keys get the :data:`NEGATIVE` prefix.
        """
        if negative is None:
            return cond
        count = next(iter(cond.values())).shape[0]
        negative = {k: v.expand(count, *v.shape[1:]) for k, v in negative.items()}
        cond, negative = self._pair(cond, negative)
        return {**cond, **{NEGATIVE + k: v.contiguous() for k, v in negative.items()}}

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value.to(self.device) for key, value in tensors.items()}

    def _text_modules(self) -> list[nn.Module]:
        return [m for m in self.text.values() if isinstance(m, nn.Module)]
