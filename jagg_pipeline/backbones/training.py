"""The training side of a backbone: what trains, LoRA, bf16 compute, checkpointing, FSDP units.

Owns :class:`TrainingMixin` (full fine-tuning or LoRA adapters, the trainable parameters,
saving and loading adapters, computing in bfloat16 as FSDP2 does, activation checkpointing
and the blocks FSDP2 shards one by one) and the LoRA targets the families share
(:data:`JOINT_ATTENTION_TARGETS`). The peft mechanics live in :mod:`.lora`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import get_args

import torch
from torch import nn

from jagg_pipeline.backbones import lora
from jagg_pipeline.config.run import TrainingMode

# The projections of a joint (image + text stream) attention block, shared by all families.
JOINT_ATTENTION_TARGETS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
TRAINING_MODES: tuple[str, ...] = get_args(TrainingMode)
# peft keeps a wrapped layer's own weights under this module name.
_BASE_LAYER = "base_layer"


def checkpoint_name(name: str) -> str:
    """The base checkpoint's name of a transformer parameter (LoRA wrapping undone)."""
    return ".".join(part for part in name.split(".") if part != _BASE_LAYER)


@contextmanager
def _real_stand_ins(module: nn.Module, targets: Sequence[str]) -> Iterator[None]:
    """Meta parameters of the ``targets`` layers stood in for by real one-element tensors.

    peft creates each adapter on the device of its layer's weight: on a meta-device layer
    the adapters would be meta too, their seeded initial values lost. A stand-in is one
    element expanded to the parameter's shape and dtype (no memory), so the adapters are
    drawn and cast exactly as on a loaded model; the meta parameters are put back after,
    frozen as the stand-ins were.
    """
    swapped = []
    for name in targets:
        layer = module.get_submodule(name)
        for key, param in list(layer.named_parameters(recurse=False)):
            if param.is_meta:
                stand_in = torch.zeros((), dtype=param.dtype).expand(param.shape)
                setattr(layer, key, nn.Parameter(stand_in, requires_grad=param.requires_grad))
                swapped.append((layer, key, param))
    try:
        yield
    finally:
        for layer, key, param in swapped:
            param.requires_grad_(getattr(layer, key).requires_grad)
            setattr(layer, key, param)


class TrainingMixin:
    """The training side of :class:`Backbone` (uses its ``transformer`` and LoRA targets)."""

    def dead_modules(self) -> list[str]:
        """Transformer submodules whose parameters cannot reach the output (frozen, no LoRA)."""
        return []

    def set_training_mode(
        self, mode: TrainingMode, settings: lora.LoraConfig | None = None
    ) -> None:
        """``full``: every live transformer parameter trains; ``lora``: adapters only.

        Parameters under :meth:`dead_modules` never train: they get no gradient, which
        distributed wrappers would report as unused parameters.
        """
        if mode == "full":
            if lora.has_lora(self.transformer):
                raise ValueError("this backbone carries LoRA adapters; load a fresh one for full")
            self.transformer.requires_grad_(True)
            for name in self.dead_modules():
                self.transformer.get_submodule(name).requires_grad_(False)
        elif mode == "lora":
            if not lora.has_lora(self.transformer):
                settings = settings or lora.LoraConfig()
                targets = lora.target_modules(
                    self.transformer,
                    settings.targets or self.default_lora_targets,
                    exclude=self.dead_modules(),
                )
                with _real_stand_ins(self.transformer, targets):
                    lora.add_lora(self.transformer, settings, targets)
        else:
            raise ValueError(f"training mode must be one of {TRAINING_MODES}, got {mode!r}")
        self.training_mode = mode
        self._eval_adapters()

    def _eval_adapters(self) -> None:
        """Eval mode again: peft creates its adapter modules (dropout too) in training mode."""
        self.transformer.eval()

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters an optimiser should update."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def save_lora(self, directory: str | Path) -> Path:
        """Save the LoRA adapters alone into ``directory``, for every loader.

        The folder that peft's ``PeftModel.from_pretrained`` and diffusers'
        ``load_lora_weights`` read (:func:`~jagg_pipeline.backbones.lora.save_lora`).
        """
        return lora.save_lora(self.transformer, directory, self.pipeline_class)

    def load_lora(self, directory: str | Path) -> None:
        """Load adapters saved by :meth:`save_lora` (into this backbone's adapters, if any)."""
        lora.load_lora(self.transformer, directory)
        self.training_mode = "lora"
        self._eval_adapters()

    def compute_in_bf16(self) -> None:
        """Compute as FSDP2's bf16 ``MixedPrecisionPolicy`` does, without sharding.

        For the stages that only run the model (rollout, evaluation) under
        ``mixed_precision: bf16``: FSDP2 casts every parameter of each unit to bfloat16 for
        compute (buffers stay as they are) and the floating inputs of each unit's forward, and
        leaves the output in bfloat16. Doing the same here gives the velocities that training
        recomputes, so the on-policy ratio is 1. Irreversible: the float32 weights are gone.
        """
        from torch.utils._pytree import tree_map_only

        def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tree_map_only(
                torch.Tensor,
                lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t,
                (args, kwargs),
            )

        for param in self.transformer.parameters():
            param.data = param.data.to(torch.bfloat16)
        for unit in {*self.fsdp_units(), self.transformer}:
            unit.register_forward_pre_hook(cast_inputs, with_kwargs=True)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each transformer block's activations in backward (memory for compute)."""
        if enabled:
            self.transformer.enable_gradient_checkpointing()
        else:
            self.transformer.disable_gradient_checkpointing()

    def fsdp_units(self) -> list[nn.Module]:
        """The transformer blocks to shard one by one (the model's ``_no_split_modules``)."""
        names = set(self.transformer._no_split_modules or ())
        return [m for m in self.transformer.modules() if type(m).__name__ in names]
