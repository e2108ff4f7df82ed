"""The rollout artifact: sampled trajectories as the rollout stage writes and training reads them.

One :class:`TrajectoryBatch` per shard (one per rank): tensors in ``shard-<rank>.safetensors``,
the prompt list and the steps that carry velocities in ``shard-<rank>.json``. Samples are
addressed by their index in the whole rollout (``sample_ids``, recorded by a rollout stage
that deals its work to ranks round-robin), so any number of ranks loads as one rank's rollout.
:class:`RolloutReader` reads the small per-sample columns of every shard at once and the
trajectories of just the samples asked for (a training rank reads its own micro-batches, a
slice of each shard file, never the whole rollout); :func:`load_rollout` reads them all.
Knows nothing of backbones or training: conditioning is a dict of tensors batched along dim 0
(what :meth:`Backbone.encode_prompts` returns), so training needs no text encoder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.core.sde import StepMasks
from jagg_pipeline.io.artifacts import atomic_write_json, atomic_write_safetensors
from jagg_pipeline.support.errors import InputError

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
    ``velocities`` [B, len(velocity_steps), ...] the sampling policy's velocity at the trained
    steps ``velocity_steps`` (those the on-policy step can reuse, in the policy's compute
    dtype) or None (none stored); ``velocity_steps`` None means every trained step. The
    rollout shard format: a :class:`~jagg_pipeline.core.sde.Trajectory` plus what GRPO and the
    reports need about each sample (prompt, group, seed, image); training selects micro-batches
    from it and hands the engines :class:`~jagg_pipeline.core.jagg.MicroBatch` records.
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
    velocity_steps: list[int] | None = None

    def __post_init__(self) -> None:
        if self.velocities is None:
            self.velocity_steps = None
        elif self.velocity_steps is None:
            self.velocity_steps = self.trained_steps
        elif not set(self.velocity_steps) <= set(self.trained_steps):
            raise ValueError(
                f"velocity steps {self.velocity_steps} are not all trained steps "
                f"{self.trained_steps}"
            )
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
            want = (batch, len(self.velocity_steps), *self.latents.shape[2:])
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
            velocity_steps=self.velocity_steps,
        )

    def step_velocities(self) -> dict[int, torch.Tensor] | None:
        """Trained step -> the sampled velocity [B, ...] at it, for the steps that have one."""
        if self.velocities is None:
            return None
        return {k: self.velocities[:, j] for j, k in enumerate(self.velocity_steps)}

    def save(self, directory: str | Path, rank: int = 0) -> Path:
        """Write ``shard-<rank>.safetensors`` and ``shard-<rank>.json`` atomically.

        Their digests are recorded as they are written, for the rollout's manifest
        (:func:`~jagg_pipeline.io.artifacts.atomic_write_safetensors`).
        """
        directory = Path(directory)
        tensors = {name: getattr(self, name) for name in (*_TENSORS, *_PER_SAMPLE)}
        tensors.update({COND_PREFIX + k: v for k, v in self.cond.items()})
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        path = directory / f"shard-{rank}.safetensors"
        atomic_write_safetensors(path, tensors)
        meta = {"prompts": self.prompts, "velocity_steps": self.velocity_steps}
        atomic_write_json(directory / f"shard-{rank}.json", meta)
        return path


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
    if len({None if b.velocities is None else tuple(b.velocity_steps) for b in batches}) > 1:
        raise ValueError("shards carry velocities at different steps")
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
        velocities=None if first.velocities is None else cat("velocities"),
        velocity_steps=first.velocity_steps,
    )


class RolloutReader:
    """A rollout folder, read on demand.

    Opening it reads every shard's small per-sample columns (prompt, group, seed, sample id)
    and checks that the shards hold samples 0..B-1 exactly once; :meth:`select` then reads
    the trajectories of the samples asked for, as slices of the shard files, so a rank holds
    in memory only what it trains on, and :meth:`images` only their images (what scoring
    reads). Offers what training reads of a :class:`TrajectoryBatch` of the whole rollout
    (``len``, ``trained_steps``, the ids).
    """

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        paths = sorted(
            (int(m.group(1)), p)
            for p in self.directory.glob("shard-*.safetensors")
            if (m := _SHARD.match(p.name))
        )
        if not paths:
            raise InputError(
                f"{self.directory}: no shard-<rank>.safetensors files (not a rollout?)"
            )
        ranks = [rank for rank, _ in paths]
        if ranks != list(range(len(ranks))):
            raise InputError(f"{self.directory}: shards {ranks} are not 0..{len(ranks) - 1}")
        self._paths = [path for _, path in paths]
        metas = [json.loads(path.with_suffix(".json").read_text()) for path in self._paths]
        columns: dict[str, list[torch.Tensor]] = {}
        self._names: list[set[str]] = []  # the tensors each shard holds
        for path in self._paths:
            with safe_open(str(path), "pt") as handle:
                names = set(handle.keys())
                self._names.append(names)
                for name in (*_PER_SAMPLE, "sample_ids", "sigmas", "sde_mask", "train_mask"):
                    if name in names:
                        columns.setdefault(name, []).append(handle.get_tensor(name))
        rows = [len(ids) for ids in columns["seeds"]]
        sample_ids = (
            torch.cat(columns["sample_ids"])
            if len(columns.get("sample_ids", [])) == len(paths)
            else torch.arange(sum(rows))
        )
        shard_of = torch.repeat_interleave(torch.arange(len(paths)), torch.tensor(rows))
        row_of = torch.cat([torch.arange(n) for n in rows])
        order = torch.argsort(sample_ids)
        if not torch.equal(sample_ids[order], torch.arange(len(sample_ids))):
            raise InputError(
                f"{self.directory}: the shards' sample_ids are not 0..{len(sample_ids) - 1} "
                "(a shard is missing, stale or duplicated; rerun the rollout)"
            )
        first = {name: values[0] for name, values in columns.items()}
        for name in ("sigmas", "sde_mask", "train_mask"):
            if any(not torch.equal(v, first[name]) for v in columns[name]):
                raise InputError(f"{self.directory}: the shards disagree on {name}")
        if any(meta != metas[0] for meta in metas):
            raise InputError(
                f"{self.directory}: the shards disagree on the prompts or the velocity steps"
            )
        self._shard, self._row = shard_of[order], row_of[order]  # by sample id
        self.prompt_ids, self.group_ids, self.seeds = (
            torch.cat(columns[name])[order] for name in _PER_SAMPLE
        )
        self.prompts: list[str] = metas[0]["prompts"]
        self.velocity_steps: list[int] | None = metas[0].get("velocity_steps")
        self.masks = StepMasks(sde=first["sde_mask"], train=first["train_mask"])
        self.sigmas = first["sigmas"]

    def __len__(self) -> int:
        return len(self.seeds)

    @property
    def trained_steps(self) -> list[int]:
        return self.masks.trained_indices

    def select(self, samples: Sequence[int], *, images: bool = False) -> TrajectoryBatch:
        """The trajectories of ``samples`` (indices in the rollout), in that order.

        ``images``: read the decoded images too (:meth:`images` reads only those).
        """
        samples = torch.as_tensor(list(samples), dtype=torch.long)
        part = self._read(
            samples,
            lambda n: (
                n in ("latents", "log_probs", "velocities")
                or n.startswith(COND_PREFIX)
                or (images and n == "images")
            ),
        )
        cond = {k[len(COND_PREFIX) :]: v for k, v in part.items() if k.startswith(COND_PREFIX)}
        return TrajectoryBatch(
            latents=part["latents"],
            log_probs=part["log_probs"],
            sigmas=self.sigmas,
            sde_mask=self.masks.sde,
            train_mask=self.masks.train,
            prompt_ids=self.prompt_ids[samples],
            group_ids=self.group_ids[samples],
            seeds=self.seeds[samples],
            prompts=self.prompts,
            cond=cond,
            images=part.get("images"),
            sample_ids=samples,
            velocities=part.get("velocities"),
            velocity_steps=self.velocity_steps,
        )

    def images(self, samples: Sequence[int]) -> torch.Tensor:
        """The stored uint8 images [len(samples), 3, H, W] of ``samples``, in that order.

        Reads only those rows of each shard's ``images`` tensor: no trajectory, no conditioning,
        so scoring a chunk at a time holds one chunk of images, whatever the rollout's size.
        """
        lacking = [i for i, names in enumerate(self._names) if "images" not in names]
        if lacking:
            raise InputError(
                f"{self.directory}: shard(s) {lacking} hold no images to score; rerun the rollout"
            )
        samples = torch.as_tensor(list(samples), dtype=torch.long)
        return self._read(samples, lambda n: n == "images")["images"]

    def _read(
        self, samples: torch.Tensor, wanted: Callable[[str], bool]
    ) -> dict[str, torch.Tensor]:
        """The tensors named ``wanted`` of ``samples``, rows sliced from each shard file.

        Each shard's rows go straight to their places in one tensor per name: a read holds
        the result and one shard's slice, never a second copy of the result.
        """
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        filled: dict[str, int] = {}
        for shard, path in enumerate(self._paths):
            mine = (self._shard[samples] == shard).nonzero().flatten()
            if not len(mine):
                continue
            rows = self._row[samples[mine]]
            with safe_open(str(path), "pt") as handle:
                for name in sorted(n for n in self._names[shard] if wanted(n)):
                    part = _read_rows(handle, name, rows)
                    if name not in out:
                        out[name] = part.new_empty((len(samples), *part.shape[1:]))
                    out[name][mine] = part  # in the order asked for
                    filled[name] = filled.get(name, 0) + len(mine)
        partial = sorted(name for name, count in filled.items() if count != len(samples))
        if partial:
            raise InputError(f"{self.directory}: only some shards hold {', '.join(partial)}")
        return out


def _read_rows(handle: Any, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of tensor ``name`` of an open safetensors file, read run by run."""
    view = handle.get_slice(name)
    parts, start = [], 0
    rows = rows.tolist()
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            parts.append(view[rows[start] : rows[i - 1] + 1])
            start = i
    return torch.cat(parts)


def load_rollout(directory: str | Path) -> TrajectoryBatch:
    """Every sample of a rollout directory, images included, in sample-id order.

    The shards must hold samples 0..B-1 exactly once: a missing or duplicated shard is an
    error rather than a silently different batch.
    """
    reader = RolloutReader(directory)
    return reader.select(range(len(reader)), images=True)
