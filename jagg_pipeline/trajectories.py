"""The rollout artifact: sampled trajectories as the rollout stage writes and training reads them.

One :class:`TrajectoryBatch` per shard (one per rank): tensors in ``shard-<rank>.safetensors``,
the prompt list in ``shard-<rank>.json``. :func:`load_rollout` concatenates the
shards of a directory in rank order, then puts the samples back in the order of their
``sample_ids`` when the shards carry them (a rollout stage that deals its work to ranks
round-robin records each sample's global index there, so any number of ranks loads as one
rank's rollout). Knows nothing of backbones or training: conditioning is a
dict of tensors batched along dim 0 (what :meth:`Backbone.encode_prompts` returns), so training
needs no text encoder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jagg_pipeline.artifacts import atomic_output, atomic_write_json
from jagg_pipeline.errors import InputError
from jagg_pipeline.sde import StepMasks

COND_PREFIX = "cond."
_SHARD = re.compile(r"^shard-(\d+)\.safetensors$")
_TENSORS = ("latents", "log_probs", "sigmas", "sde_mask", "train_mask")
_PER_SAMPLE = ("prompt_ids", "group_ids", "seeds")
_OPTIONAL = ("images", "sample_ids", "velocities")


@dataclass
class TrajectoryBatch:
    """B sampled trajectories of T steps and what training needs to recompute them.

    ``latents`` [B, T+1, ...] (index 0 the initial noise), ``log_probs`` [B, T] (float32 at
    least; 0 on non-SDE steps), ``sigmas`` [T+1], the step masks [T] shared by the batch,
    ``prompt_ids`` [B] (indices into ``prompts``), ``group_ids`` [B] (GRPO groups),
    ``seeds`` [B] (each sample's noise seed), ``cond`` the conditioning, ``images`` uint8
    [B, 3, H, W] or None, ``sample_ids`` [B] (each sample's index in the whole rollout) or None,
    ``velocities`` [B, n_trained, ...] the sampling policy's velocity at each trained step (in
    ``trained_steps`` order, the latents' dtype) or None (``sampler.store_velocities: false``).
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    sde_mask: torch.Tensor
    train_mask: torch.Tensor
    prompt_ids: torch.Tensor
    group_ids: torch.Tensor
    seeds: torch.Tensor
    prompts: list[str]
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    images: torch.Tensor | None = None
    sample_ids: torch.Tensor | None = None
    velocities: torch.Tensor | None = None

    def __post_init__(self) -> None:
        batch, steps = self.log_probs.shape
        checks = {
            "latents": (self.latents.shape[:2], (batch, steps + 1)),
            "sigmas": (tuple(self.sigmas.shape), (steps + 1,)),
            "sde_mask": (tuple(self.sde_mask.shape), (steps,)),
            "train_mask": (tuple(self.train_mask.shape), (steps,)),
            **{name: (tuple(getattr(self, name).shape), (batch,)) for name in _PER_SAMPLE},
            **{f"cond.{k}": (v.shape[:1], (batch,)) for k, v in self.cond.items()},
        }
        if self.images is not None:
            checks["images"] = (self.images.shape[:1], (batch,))
        if self.sample_ids is not None:
            checks["sample_ids"] = (tuple(self.sample_ids.shape), (batch,))
        if self.velocities is not None:
            want = (batch, len(self.trained_steps), *self.latents.shape[2:])
            checks["velocities"] = (tuple(self.velocities.shape), want)
        bad = {k: (tuple(got), want) for k, (got, want) in checks.items() if tuple(got) != want}
        if bad:
            raise ValueError(f"inconsistent trajectory batch (got, expected): {bad}")

    def __len__(self) -> int:
        return self.log_probs.shape[0]

    @property
    def masks(self) -> StepMasks:
        return StepMasks(sde=self.sde_mask, train=self.train_mask)

    @property
    def trained_steps(self) -> list[int]:
        return self.masks.trained_indices

    def select(self, index: torch.Tensor | list[int]) -> TrajectoryBatch:
        """The samples at ``index`` (e.g. one minibatch of groups)."""
        index = torch.as_tensor(index, dtype=torch.long)
        return TrajectoryBatch(
            latents=self.latents[index],
            log_probs=self.log_probs[index],
            sigmas=self.sigmas,
            sde_mask=self.sde_mask,
            train_mask=self.train_mask,
            prompt_ids=self.prompt_ids[index],
            group_ids=self.group_ids[index],
            seeds=self.seeds[index],
            prompts=self.prompts,
            cond={k: v[index] for k, v in self.cond.items()},
            images=None if self.images is None else self.images[index],
            sample_ids=None if self.sample_ids is None else self.sample_ids[index],
            velocities=None if self.velocities is None else self.velocities[index],
        )

    def step_velocities(self) -> dict[int, torch.Tensor] | None:
        """Trained step -> the sampled velocity [B, ...] at it (None: none stored)."""
        if self.velocities is None:
            return None
        return {k: self.velocities[:, j] for j, k in enumerate(self.trained_steps)}

    def save(self, directory: str | Path, rank: int = 0) -> Path:
        """Write ``shard-<rank>.safetensors`` and ``shard-<rank>.json`` atomically."""
        from safetensors.torch import save_file

        directory = Path(directory)
        tensors = {name: getattr(self, name) for name in (*_TENSORS, *_PER_SAMPLE)}
        tensors.update({COND_PREFIX + k: v for k, v in self.cond.items()})
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        path = directory / f"shard-{rank}.safetensors"
        with atomic_output(path) as tmp:
            save_file(tensors, str(tmp))
        atomic_write_json(directory / f"shard-{rank}.json", {"prompts": self.prompts})
        return path

    @classmethod
    def load_shard(cls, path: str | Path) -> TrajectoryBatch:
        """Read one shard written by :meth:`save`."""
        from safetensors.torch import load_file

        path = Path(path)
        tensors = load_file(str(path))
        meta = json.loads(path.with_suffix(".json").read_text())
        cond = {k[len(COND_PREFIX) :]: v for k, v in tensors.items() if k.startswith(COND_PREFIX)}
        return cls(
            **{name: tensors[name] for name in (*_TENSORS, *_PER_SAMPLE)},
            prompts=meta["prompts"],
            cond=cond,
            **{name: tensors.get(name) for name in _OPTIONAL},
        )


def concatenate(batches: list[TrajectoryBatch]) -> TrajectoryBatch:
    """One batch of all samples, in order; schedules, masks and prompt lists must agree."""
    if not batches:
        raise ValueError("nothing to concatenate")
    first = batches[0]
    for other in batches[1:]:
        same = (
            torch.equal(other.sigmas, first.sigmas)
            and torch.equal(other.sde_mask, first.sde_mask)
            and torch.equal(other.train_mask, first.train_mask)
            and other.prompts == first.prompts
        )
        if not same:
            raise ValueError("shards disagree on the schedule, the step masks or the prompts")

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(b, name) for b in batches])

    has_images = all(b.images is not None for b in batches)
    with_ids = [b.sample_ids is not None for b in batches]
    if any(with_ids) and not all(with_ids):
        raise ValueError("some shards carry sample_ids and others do not")
    with_velocities = [b.velocities is not None for b in batches]
    if any(with_velocities) and not all(with_velocities):
        raise ValueError("some shards carry velocities and others do not")
    return TrajectoryBatch(
        latents=cat("latents"),
        log_probs=cat("log_probs"),
        sigmas=first.sigmas,
        sde_mask=first.sde_mask,
        train_mask=first.train_mask,
        prompt_ids=cat("prompt_ids"),
        group_ids=cat("group_ids"),
        seeds=cat("seeds"),
        prompts=first.prompts,
        cond={k: torch.cat([b.cond[k] for b in batches]) for k in first.cond},
        images=cat("images") if has_images else None,
        sample_ids=cat("sample_ids") if all(with_ids) else None,
        velocities=cat("velocities") if all(with_velocities) else None,
    )


def load_rollout(directory: str | Path) -> TrajectoryBatch:
    """All shards of a rollout directory, concatenated in rank order, then in sample-id order.

    With ``sample_ids`` the result is sorted by them, and they must be exactly 0..B-1: a
    missing or duplicated shard is an error rather than a silently different batch.
    """
    directory = Path(directory)
    shards = sorted(
        (int(m.group(1)), p)
        for p in directory.glob("shard-*.safetensors")
        if (m := _SHARD.match(p.name))
    )
    if not shards:
        raise InputError(f"{directory}: no shard-<rank>.safetensors files (not a rollout?)")
    ranks = [rank for rank, _ in shards]
    if ranks != list(range(len(ranks))):
        raise InputError(f"{directory}: shards {ranks} are not 0..{len(ranks) - 1}")
    batch = concatenate([TrajectoryBatch.load_shard(path) for _, path in shards])
    if batch.sample_ids is None:
        return batch
    order = torch.argsort(batch.sample_ids)
    if not torch.equal(batch.sample_ids[order], torch.arange(len(batch))):
        raise InputError(
            f"{directory}: the shards' sample_ids are not 0..{len(batch) - 1} "
            "(a shard is missing, stale or duplicated; rerun the rollout)"
        )
    return batch.select(order)
