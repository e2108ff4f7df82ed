"""Policies: the base checkpoint or a trained checkpoint directory, loaded as one Backbone.

Owns the ``--policy`` argument of the stages and the policy part of a training checkpoint
directory, the one format the training stage writes and rollout / evaluate read::

    CKPT/manifest.json        stage "train" (its backbone section is checked)
    CKPT/policy/              the transformer's trainable parameters (LoRA adapters, or every
                              live parameter for full fine-tuning), names as in
                              transformer.named_parameters(), sharded as the training ranks
                              held them (:mod:`jagg_pipeline.io.shards`)
    CKPT/...                  trainer-private files (optimizer, ...), ignored here

A consumer builds the configured backbone (the base checkpoint, with fresh adapters for LoRA)
and reads the saved parameters into it in place, so loading never needs a second copy of the
model. ``policy == "base"`` is the checkpoint that ``config.backbone.path`` names. Hub formats
(a diffusers folder, a peft adapter) are written by :func:`export_policy`, on demand.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.backbones import Backbone, load_backbone
from jagg_pipeline.io.artifacts import BASE, policy_weights_dir
from jagg_pipeline.io.manifest import CHECKED_SECTIONS, check_input
from jagg_pipeline.support.errors import InputError


class PolicyError(InputError):
    """A ``--policy`` is neither ``base`` nor a usable checkpoint directory."""


def load_policy(
    config: Any,
    policy: str | Path,
    device: str | torch.device | None = None,
    *,
    for_training: bool = False,
) -> Backbone:
    """The backbone of ``config.backbone`` on ``device``, with ``policy``'s weights if not base.

    A checkpoint directory must be a finished ``train`` output made under the same backbone
    section (else :class:`~jagg_pipeline.io.manifest.ManifestError` naming the file). ``device``
    None keeps ``config.backbone.device`` (a rank's ``cuda:<local rank>`` overrides it).
    Under ``backbone.mixed_precision: bf16`` a backbone for sampling computes in bfloat16 as
    training does (:meth:`Backbone.compute_in_bf16`); ``for_training`` leaves its weights in
    ``backbone.dtype`` for FSDP2's mixed-precision policy to cast, and skips the text
    encoders (training reads the rollout's encoded prompts; a T5-XXL is 9 GB per rank).
    """
    if for_training:
        skipped = dataclasses.replace(config.backbone, load_text_encoders=False)
        config = dataclasses.replace(config, backbone=skipped)
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
    check_checkpoint(config, policy)
    backbone = load_backbone(spec)
    apply_policy(backbone, policy_weights_dir(policy))
    return backbone


def check_checkpoint(config: Any, checkpoint: str | Path) -> None:
    """Refuse ``checkpoint`` unless it is a finished ``train`` output of this backbone section."""
    if not Path(checkpoint).is_dir():
        raise PolicyError(
            f"policy {str(checkpoint)!r}: neither {BASE!r} nor a checkpoint directory (no such "
            "directory)"
        )
    check_input(checkpoint, stage="train", config=config, sections=CHECKED_SECTIONS["train"])


def trainable_state(backbone: Backbone) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, detached: loading into them loads the policy."""
    return {
        name: param.detach()
        for name, param in backbone.transformer.named_parameters()
        if param.requires_grad
    }


def load_weights(
    state: dict[str, torch.Tensor],
    folder: str | Path,
    *,
    collective: bool = False,
    what: str = "weights",
) -> None:
    """Fill ``state`` (trainable parameters by name) in place from a sharded ``folder``.

    The saved names must be exactly ``state``'s (else :class:`PolicyError` naming the
    difference). ``collective``: each training rank reads its own shards (a collective).
    """
    from jagg_pipeline.io import shards

    folder = Path(folder)
    if not (folder / shards.METADATA_FILE).is_file():
        raise PolicyError(f"{folder}: holds no saved {what} ({shards.METADATA_FILE} missing)")
    saved = shards.keys(folder)
    unexpected, missing = sorted(set(saved) - set(state)), sorted(set(state) - set(saved))
    wrong = [n for n in set(saved) & set(state) if saved[n] != tuple(state[n].shape)]
    if unexpected or missing or wrong:
        raise PolicyError(
            f"{folder}: its {what} do not fit this transformer's trainable parameters "
            f"(check backbone.training and backbone.lora): unexpected {unexpected[:5]}, "
            f"missing {missing[:5]}, other shapes {sorted(wrong)[:5]}"
        )
    with torch.no_grad():
        shards.load(state, folder, collective=collective)


def apply_policy(backbone: Backbone, weights: str | Path) -> None:
    """Read a checkpoint's ``policy/`` folder into ``backbone``'s trainable parameters."""
    load_weights(trainable_state(backbone), weights)


def save_policy(backbone: Backbone, directory: str | Path) -> Path:
    """Write ``directory/policy/`` from this process's backbone, atomically; returns it.

    For a policy trained outside the training stage (tests, notebooks); a training checkpoint
    writes its shards from every rank (:mod:`jagg_pipeline.stages.checkpoint`).
    """
    from jagg_pipeline.io import shards
    from jagg_pipeline.io.artifacts import atomic_directory

    target = policy_weights_dir(directory)
    with atomic_directory(target) as staging:
        shards.save(trainable_state(backbone), staging)
    return target


def export_policy(config: Any, checkpoint: str | Path, out: str | Path) -> Path:
    """Write a checkpoint's policy in a hub format into ``out`` (atomically); returns it.

    LoRA: a peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that
    :meth:`Backbone.load_lora` and peft load onto the base model. Full fine-tuning: a diffusers
    pipeline folder, the base checkpoint's with the trained ``transformer/`` in its place,
    loadable as ``backbone.path``. Reads the whole policy into this one process.
    """
    import shutil

    from jagg_pipeline.backbones.loading import resolve_checkpoint
    from jagg_pipeline.io.artifacts import atomic_directory

    backbone = _load(config, checkpoint, "cpu")  # in backbone.dtype, as trained
    with atomic_directory(out) as staging:
        if backbone.training_mode == "lora":
            backbone.save_lora(staging)
        else:
            base = resolve_checkpoint(config.backbone)
            for entry in base.iterdir():
                if entry.name == "transformer":
                    continue
                copy = shutil.copytree if entry.is_dir() else shutil.copy2
                copy(entry, staging / entry.name)
            backbone.transformer.save_pretrained(staging / "transformer")
    return Path(out)
