"""Policies: the base checkpoint or a trained checkpoint directory, loaded as one Backbone.

Owns the ``--policy`` argument of the stages and the policy part of a training checkpoint
directory, the one format the training stage writes and rollout / evaluate read::

    CKPT/manifest.json                       stage "train" (its backbone section is checked)
    CKPT/policy/adapter_config.json          LoRA: as Backbone.save_lora writes them
    CKPT/policy/adapter_model.safetensors
      or
    CKPT/policy/transformer.safetensors      full fine-tuning: the transformer's trainable
                                             parameters, names as in transformer.state_dict()
    CKPT/...                                 trainer-private files (optimizer, ...), ignored here

``policy == "base"`` is the checkpoint that ``config.backbone.path`` names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.backbones import Backbone, load_backbone
from jagg_pipeline.backbones import lora as lora_files
from jagg_pipeline.errors import InputError
from jagg_pipeline.manifest import check_input

BASE = "base"
POLICY_DIR = "policy"
FULL_WEIGHTS = "transformer.safetensors"


class PolicyError(InputError):
    """A ``--policy`` is neither ``base`` nor a usable checkpoint directory."""


def policy_weights_dir(policy: str | Path) -> Path:
    """Where a checkpoint directory keeps its policy weights (what consumers digest)."""
    return Path(policy) / POLICY_DIR


def load_policy(
    config: Any,
    policy: str | Path,
    device: str | torch.device | None = None,
    *,
    for_training: bool = False,
) -> Backbone:
    """The backbone of ``config.backbone`` on ``device``, with ``policy``'s weights if not base.

    A checkpoint directory must be a finished ``train`` output made under the same backbone
    section (else :class:`~jagg_pipeline.manifest.ManifestError` naming the file). ``device``
    None keeps ``config.backbone.device`` (a rank's ``cuda:<local rank>`` overrides it).
    Under ``backbone.mixed_precision: bf16`` a backbone for sampling computes in bfloat16 as
    training does (:meth:`Backbone.compute_in_bf16`); ``for_training`` leaves its weights in
    ``backbone.dtype`` for FSDP2's mixed-precision policy to cast.
    """
    backbone = _load(config, policy, device)
    if config.backbone.mixed_precision == "bf16" and not for_training:
        backbone.compute_in_bf16()
    return backbone


def _load(config: Any, policy: str | Path, device: str | torch.device | None) -> Backbone:
    spec = config.backbone
    if device is not None:
        spec = dataclasses.replace(spec, device=str(device))
    if str(policy) == BASE:
        return load_backbone(spec)
    checkpoint = Path(policy)
    if not checkpoint.is_dir():
        raise PolicyError(
            f"policy {str(policy)!r}: neither {BASE!r} nor a checkpoint directory (no such "
            "directory)"
        )
    check_input(checkpoint, stage="train", config=config, sections=["backbone"])
    backbone = load_backbone(spec)
    apply_policy(backbone, policy_weights_dir(checkpoint))
    return backbone


def apply_policy(backbone: Backbone, weights: str | Path) -> None:
    """Load a ``policy/`` directory written by :func:`save_policy` into ``backbone``."""
    weights = Path(weights)
    if (weights / lora_files.CONFIG_FILE).is_file():
        backbone.load_lora(weights)
        return
    full = weights / FULL_WEIGHTS
    if not full.is_file():
        raise PolicyError(
            f"{weights}: holds neither {lora_files.CONFIG_FILE} + {lora_files.WEIGHTS_FILE} "
            f"(LoRA) nor {FULL_WEIGHTS} (full fine-tuning)"
        )
    from safetensors.torch import load_file

    state = load_file(str(full))
    expected = set(backbone.transformer.state_dict())
    unexpected = sorted(set(state) - expected)
    missing = sorted(
        {n for n, p in backbone.transformer.named_parameters() if p.requires_grad} - set(state)
    )
    if unexpected or missing:
        raise PolicyError(
            f"{full}: does not fit this {backbone.family} transformer (training mode "
            f"{backbone.training_mode!r}): unexpected {unexpected[:5]}, missing trainable "
            f"{missing[:5]}"
        )
    backbone.transformer.load_state_dict(state, strict=False)


def policy_state_dict(
    backbone: Backbone, state_dict: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The trainable weights a checkpoint stores: LoRA adapters (peft names) or parameters.

    ``state_dict`` (keys as in ``backbone.transformer.state_dict()``) replaces the live
    parameters as the source: a full state dict gathered from FSDP shards, or EMA weights.
    """
    transformer = backbone.transformer
    if backbone.training_mode == "lora":
        from peft import get_peft_model_state_dict

        weights = get_peft_model_state_dict(
            transformer,
            state_dict=None if state_dict is None else dict(state_dict),
            adapter_name=lora_files.ADAPTER_NAME,
        )
    else:
        source = transformer.state_dict() if state_dict is None else state_dict
        names = [n for n, p in transformer.named_parameters() if p.requires_grad]
        absent = [n for n in names if n not in source]
        if absent:
            raise KeyError(f"state_dict lacks trainable parameters, e.g. {absent[:5]}")
        weights = {n: source[n] for n in names}
    return {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}


def save_policy(
    backbone: Backbone,
    directory: str | Path,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``directory/policy/`` (see the module docstring) atomically; returns it.

    The files are written into a temporary sibling first and renamed into place, so a reader
    never sees a half-written policy. ``state_dict``: see :func:`policy_state_dict`. A
    training checkpoint writes its policy with :func:`write_policy_files` inside its own
    atomic folder instead (:mod:`jagg_pipeline.checkpoint`).
    """
    from jagg_pipeline.artifacts import atomic_directory

    target = policy_weights_dir(directory)
    with atomic_directory(target) as staging:
        write_policy_files(backbone, staging, state_dict)
    return target


def write_policy_files(
    backbone: Backbone, folder: Path, state_dict: Mapping[str, torch.Tensor] | None = None
) -> None:
    """The policy's files (LoRA adapters or full weights) into the existing ``folder``."""
    from safetensors.torch import save_file

    weights = policy_state_dict(backbone, state_dict)
    if backbone.training_mode == "lora":
        # The adapter config is the LoRA format's, as Backbone.save_lora writes it.
        lora_files.save_adapter_config(backbone.transformer, folder)
        save_file(weights, str(folder / lora_files.WEIGHTS_FILE))
    else:
        save_file(weights, str(folder / FULL_WEIGHTS))
