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
(a diffusers folder, a peft adapter) are written by :func:`export_policy`, on demand, never
over anything but a previous export of the same kind (:mod:`jagg_pipeline.io.exports`).

Two loaders: :func:`load_policy`, the whole model in one process (tools, tests, the loop of
rounds in one process), and :func:`load_sharded_policy`, what the ranks of the stages use:
the transformer built on the meta device, FSDP2-sharded, and each rank reading only the rows
of its own shards, from the checkpoint's ``policy/`` or the base checkpoint's safetensors, so
no rank ever holds the whole transformer. A checkpoint's manifest is checked (stage, backbone
section) and only the files a rank reads are verified, once per node
(:mod:`jagg_pipeline.io.verify`): ``policy/``, never the trainer's optimizer state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from jagg_pipeline.backbones import Backbone, backbone_class, load_backbone
from jagg_pipeline.io.artifacts import BASE, policy_weights_dir
from jagg_pipeline.io.manifest import CHECKED_SECTIONS, check_made
from jagg_pipeline.io.verify import verify_sharded
from jagg_pipeline.support.errors import InputError

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig
    from jagg_pipeline.stages.distributed import DistContext


class PolicyError(InputError):
    """A ``--policy`` is neither ``base`` nor a usable checkpoint directory."""


def load_policy(
    config: RunConfig,
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


def _load(config: RunConfig, policy: str | Path, device: str | torch.device | None) -> Backbone:
    spec = config.backbone
    if device is not None:
        spec = dataclasses.replace(spec, device=str(device))
    if str(policy) == BASE:
        return load_backbone(spec)
    manifest = check_checkpoint(config, policy)
    # This process alone reads every chunk of policy/ (others may be doing something else),
    # verified before the base model loads.
    folder = policy_weights_dir(policy)
    verify_sharded([folder], policy, manifest, collective=False)
    backbone = load_backbone(spec)
    load_weights(trainable_state(backbone), folder)
    return backbone


def load_sharded_policy(
    config: RunConfig,
    policy: str | Path,
    ctx: DistContext,
    *,
    for_training: bool = False,
    frozen: bool = False,
    text_encoders: bool = True,
    verified: bool = False,
) -> Backbone:
    """The backbone of ``config.backbone`` on ``ctx.device``, its transformer FSDP2-sharded.

    A collective: every rank of ``ctx`` calls it. The transformer is built on the meta
    device (LoRA adapters injected as :func:`load_policy` injects them), sharded as training
    shards it (:func:`~jagg_pipeline.stages.distributed.shard_backbone`, with the
    ``backbone.mixed_precision`` policy, so sampling under bf16 computes as training does),
    and only this rank's shards are allocated; each rank then reads only its rows: a
    checkpoint's trainable weights (LoRA adapters, or every trainable weight) from its
    ``policy/`` chunks, every other weight from the base checkpoint's safetensors. The
    weights are bit for bit those of :func:`load_policy` sharded. A checkpoint is checked
    as :func:`check_checkpoint` checks it, and the ``policy/`` files this rank reads are
    verified once per node before anything is built (``verified``: the caller did, as the
    training stage does with all its reads at once). The VAE and the text encoders load
    whole, as in :func:`load_policy` (``for_training`` or ``text_encoders=False`` skip the
    text encoders, as do ``backbone.load_text_encoders: false`` and a family without them: a
    stage that reads precomputed conditioning needs none, and the checkpoint is still
    checked against its own config). ``frozen``: the transformer's parameters take no
    gradient (the KL reference).
    """
    from jagg_pipeline.stages import distributed

    spec = dataclasses.replace(config.backbone, device=str(ctx.device))
    if for_training or not text_encoders:
        spec = dataclasses.replace(spec, load_text_encoders=False)
    checkpoint = None if str(policy) == BASE else Path(policy)
    if checkpoint is not None:
        manifest = check_checkpoint(config, checkpoint)
        if not verified:
            verify_sharded([policy_weights_dir(checkpoint)], checkpoint, manifest, collective=True)
    backbone = backbone_class(spec.family).load(spec, empty=True)
    transformer = backbone.transformer
    trainable = [name for name, p in transformer.named_parameters() if p.requires_grad]
    if frozen:
        transformer.requires_grad_(False)
    distributed.shard_backbone(backbone, ctx, mixed_precision=spec.mixed_precision == "bf16")
    empty = distributed.materialize(transformer, ctx.device)
    params = dict(transformer.named_parameters())
    saved = set() if checkpoint is None else set(trainable)  # never read from the base
    with torch.no_grad():
        backbone.read_base_rows(
            {name: distributed.local_rows(params[name]) for name in sorted(empty - saved)}
        )
    if checkpoint is not None:
        state = {name: params[name].detach() for name in trainable}
        load_weights(state, policy_weights_dir(checkpoint), collective=True)
    return backbone


def check_checkpoint(config: RunConfig, checkpoint: str | Path) -> dict[str, Any]:
    """Refuse ``checkpoint`` unless it is a finished ``train`` output of this backbone section.

    Returns its manifest. Nothing is hashed here: a consumer verifies the files it reads.
    """
    if not Path(checkpoint).is_dir():
        raise PolicyError(
            f"policy {str(checkpoint)!r}: neither {BASE!r} nor a checkpoint directory (no such "
            "directory)"
        )
    return check_made(checkpoint, stage="train", config=config, sections=CHECKED_SECTIONS["train"])


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


class Export(NamedTuple):
    """What :func:`export_policy` wrote: the folder, and whether it replaced an earlier export."""

    path: Path
    replaced: bool


def export_policy(config: RunConfig, checkpoint: str | Path, out: str | Path) -> Export:
    """Write a checkpoint's policy in a hub format into ``out`` (atomically).

    LoRA: an adapter folder that diffusers' ``pipe.load_lora_weights``, peft's
    ``PeftModel.from_pretrained`` and :meth:`Backbone.load_lora` load onto the base model
    (:mod:`jagg_pipeline.backbones.lora`). Full fine-tuning: a diffusers
    pipeline folder, the base checkpoint's with the trained ``transformer/`` in its place,
    loadable as ``backbone.path``. Either carries its manifest (:mod:`jagg_pipeline.io.exports`).
    Reads the whole policy into this one process. ``out`` is checked first
    (:func:`~jagg_pipeline.io.exports.check_destination`: only a previous export of the same
    kind is replaced, anything else that is there is refused, untouched) and again just
    before the new export takes its place.
    """
    import shutil

    from jagg_pipeline.backbones.loading import resolve_checkpoint
    from jagg_pipeline.io.artifacts import atomic_directory
    from jagg_pipeline.io.exports import STAGE, check_destination
    from jagg_pipeline.io.manifest import write_manifest

    kind = config.backbone.training
    local = Path(config.backbone.path)
    base = local if local.is_dir() else None  # a hub id's snapshot is in the hub's cache
    check_destination(out, checkpoint, kind, base)
    target = Path(out).resolve()  # a symlink's folder, not the link, is replaced
    backbone = _load(config, checkpoint, "cpu")  # in backbone.dtype, as trained
    with atomic_directory(target) as staging:
        if kind == "lora":
            backbone.save_lora(staging)
        else:
            # Hidden entries (.git, .cache, .gitattributes) are no part of the pipeline, and
            # leaving them out keeps every file of the export listed in its manifest.
            for entry in resolve_checkpoint(config.backbone).iterdir():
                if entry.name == "transformer" or entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    shutil.copytree(
                        entry, staging / entry.name, ignore=shutil.ignore_patterns(".*")
                    )
                else:
                    shutil.copy2(entry, staging / entry.name)
            backbone.transformer.save_pretrained(staging / "transformer")
        inputs = {"policy": policy_weights_dir(checkpoint)}
        write_manifest(staging, stage=STAGE, config=config, inputs=inputs, extra={"export": kind})
        # The model took a while to load: whatever appeared at ``out`` meanwhile is checked
        # as well, since the swap replaces it.
        replaced = check_destination(out, checkpoint, kind, base)
    return Export(target, replaced)
