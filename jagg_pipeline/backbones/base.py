"""The backbone adapter interface over diffusers pipelines, composed from one module per job.

A :class:`Backbone` turns one diffusers-format checkpoint (Flux, SD3, QwenImage) into what the
JAGG core needs: ``velocity(z, sigma, cond) -> v`` with sigma in [0, 1], the checkpoint's own
sigma schedule, initial noise, batched prompt conditioning, decoding, FSDP units, LoRA or full
fine-tuning and activation checkpointing. The family modules only say what differs (text
encoders, the transformer call, latent layout); this module owns what a family fills in (the
class attributes, :meth:`Backbone._encode`, :meth:`Backbone.predict`), the constructor and
:meth:`Backbone.load`. What the families share lives by responsibility:

- :mod:`.loading`: finding the checkpoint (local directory first, hub id second), checking it,
  reading its components, or the transformer without its weights and then rows of them
  (loads sized to a rank's shards); :class:`BackboneLoadError`, :data:`DTYPES`;
- :mod:`.conditioning`: prompts -> batched conditioning, with the negative prompt's for CFG;
- :mod:`.velocity`: the velocity call, classifier-free guidance as one batched forward, the
  guidance-embedding value;
- :mod:`.latents`: latent geometry, 2x2 packing, noise, schedule, decoding with a KL VAE;
- :mod:`.training`: full or LoRA training, adapters on disk, bf16 compute, gradient
  checkpointing, FSDP units (the peft mechanics in :mod:`.lora`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from jagg_pipeline.backbones.conditioning import ConditioningMixin
from jagg_pipeline.backbones.latents import LatentsMixin
from jagg_pipeline.backbones.loading import (
    DTYPES,
    TRANSFORMER,
    load_components,
    read_transformer_rows,
)
from jagg_pipeline.backbones.training import TrainingMixin, checkpoint_name
from jagg_pipeline.backbones.velocity import VelocityMixin
from jagg_pipeline.config.run import BackboneConfig


class Backbone(ConditioningMixin, VelocityMixin, LatentsMixin, TrainingMixin, ABC):
    """One DiT family behind the calling convention of the JAGG core.

    Subclasses set the class attributes and implement :meth:`_encode` (prompts -> positive
    conditioning), :meth:`predict` (one transformer forward) and, where they differ from the
    defaults of the mixins, the schedule, the latent geometry and decoding.
    """

    family: ClassVar[str]
    pipeline_class: ClassVar[str]  # the diffusers pipeline of its checkpoints (LoRA exports)
    text_components: ClassVar[tuple[str, ...]]  # skipped when load_text_encoders is False
    cond_keys: ClassVar[tuple[str, ...]]  # positive conditioning; negatives get NEGATIVE + key
    packed: ClassVar[bool]  # whether latents are 2x2-packed tokens
    default_max_sequence_length: ClassVar[int]
    default_cfg_rescale: ClassVar[bool] = False
    default_lora_targets: ClassVar[tuple[str, ...]]

    def __init__(self, spec: BackboneConfig, components: dict[str, Any], path: Path) -> None:
        self.spec = spec
        self.path = path
        self.dtype = DTYPES[spec.dtype]
        self.device = torch.device(spec.device)
        self.transformer: nn.Module = components["transformer"]
        self.vae: nn.Module = components["vae"]
        self.scheduler = components["scheduler"]
        self.text: dict[str, Any] = {
            name: components[name]
            for name in self.text_components
            if components.get(name) is not None
        }
        self.cfg_scale = float(spec.cfg_scale)
        self.cfg_rescale = (
            self.default_cfg_rescale if spec.cfg_rescale is None else bool(spec.cfg_rescale)
        )
        self.max_sequence_length = spec.max_sequence_length or self.default_max_sequence_length
        if self.transformer is None:  # Backbone.load(text_only=True): prompts in, nothing else
            for module in self._text_modules():
                module.to(self.device).eval().requires_grad_(False)
            return
        self.guidance_scale = self._guidance_value(spec)
        self.latent_height, self.latent_width = self._latent_size()

        # Eval mode everywhere (the DiTs have no dropout, T5 has): rollout and training must
        # compute the same function for the ratio to be exactly 1. A transformer built on
        # the meta device (Backbone.load(empty=True)) stays there for its caller to shard.
        empty = any(p.is_meta for p in self.transformer.parameters())
        for module in (self.transformer, self.vae, *self._text_modules()):
            if module is not self.transformer or not empty:
                module.to(self.device)
            module.eval()
        for module in (self.vae, *self._text_modules()):
            module.requires_grad_(False)
        self.set_training_mode(spec.training, spec.lora)
        self.set_gradient_checkpointing(spec.gradient_checkpointing)

    @classmethod
    def load(
        cls, spec: BackboneConfig, *, empty: bool = False, text_only: bool = False
    ) -> Backbone:
        """Load the checkpoint ``spec.path`` (local directory first, hub id second).

        The directory is checked first (model_index.json, pipeline class, component folders)
        so that mistakes fail with a message naming the config key; the components are then
        read by the family's own diffusers pipeline loader and the pipeline object dropped
        (:func:`.loading.load_components`). ``empty``: the transformer's weights are not
        read; its parameters stay on the meta device (LoRA adapters injected, real) for the
        caller to shard, materialise and fill (:meth:`read_base_rows`). ``text_only``: only
        the text encoders and tokenizers are read (the encode stage): the backbone encodes
        prompts (:meth:`encode_pool`, :meth:`encode_prompts`) and does nothing else.
        """
        if spec.family != cls.family:
            raise ValueError(f"{cls.__name__} loads family {cls.family!r}, got {spec.family!r}")
        components, path = load_components(
            spec, cls.text_components, empty=empty, text_only=text_only
        )
        return cls(spec, components, path)

    def read_base_rows(self, targets: Mapping[str, tuple[torch.Tensor, slice | None]]) -> None:
        """Fill transformer tensors in place with rows of the base checkpoint's weights.

        ``targets``: parameter name (as ``transformer.named_parameters()`` has it) -> (the
        tensor to fill, the rows of dim 0 it holds, None: all). Reads only those rows
        (:func:`.loading.read_transformer_rows`); a LoRA-wrapped layer's own weights are the
        checkpoint's weights of the layer.
        """
        read_transformer_rows(
            self.path / TRANSFORMER,
            self.spec,
            {checkpoint_name(name): target for name, target in targets.items()},
            type(self.transformer),
        )

    @abstractmethod
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Positive conditioning of ``prompts``: the tensors of :attr:`cond_keys`, batched."""

    @abstractmethod
    def predict(
        self, z: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One transformer forward: the velocity at latent ``z``, sigma [B] in [0, 1]."""
