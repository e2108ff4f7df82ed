"""The rollout stage: sample G images per prompt with the configured SDE and record everything.

Owns how a round's rollout is decided and computed, and the conventions every stage output
shares:

- the plan (:func:`plan_rollout`), fixed before any model is loaded: the round's prompts drawn
  from the pool, one seed per sample derived from ``(train.seed, round, sample index)``, the
  step masks (a window drawn from the round's seed, or the full trajectory with its trained-step
  selection), and fixed micro-batches of whole prompt groups (``sampler.batch_size`` samples);
- :func:`generate`: one micro-batch, each sample with its own generator for the initial noise
  and the SDE noise, so a sample depends on its seed only, not on its batch or rank (the
  round's prompts are encoded once, so padded text is alike in every micro-batch);
- ranks (``torchrun``, the training ranks): the policy is FSDP2-sharded over them, so no rank
  holds it whole; micro-batch ``m`` goes to rank ``m % world_size`` (a rank dealt one fewer
  samples a discarded copy, so that every rank makes as many forward collectives); each rank
  writes ``shard-<rank>`` with the samples' global ``sample_ids``, and
  :func:`~jagg_pipeline.io.trajectories.load_rollout` puts them back in order, so any number of
  ranks gives the one-rank rollout bit for bit;
- stage outputs: :func:`begin_output` drops a stale manifest (an output without one is
  unfinished), :func:`finish_output` writes the resolved config beside the output and then the
  manifest, last.

The ``score`` and ``evaluate`` stages reuse these pieces.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.backbones import Backbone
from jagg_pipeline.backbones.loading import DTYPES
from jagg_pipeline.core import sde
from jagg_pipeline.io.artifacts import METRICS_NAME, append_metrics
from jagg_pipeline.io.manifest import begin_output, finish_output, stage_inputs
from jagg_pipeline.io.prompts import draw_prompts, resolve_prompts
from jagg_pipeline.io.trajectories import TrajectoryBatch, concatenate
from jagg_pipeline.rewards.base import to_uint8
from jagg_pipeline.support.errors import InputError
from jagg_pipeline.support.startup import StageClock

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

STAGE = "rollout"
SHARD_FILES = ("shard-*.safetensors", "shard-*.json")

# --------------------------------------------------------------------------------------------
# Seeds, steps, plan
# --------------------------------------------------------------------------------------------


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` (base seed, purpose, round, index, ...).

    A hash rather than arithmetic, so seeds of different purposes, rounds and samples never
    collide, and they are the same on every platform, rank count and batch size.
    """
    text = "/".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") & (2**63 - 1)


def step_coefficients(sampler: Any) -> sde.StepCoefficients:
    """The SDE step family and noise level of a ``sampler`` section."""
    return sde.StepCoefficients(sampler.step, sampler.noise_level)


def step_masks(sampler: Any, seed: int) -> sde.StepMasks:
    """The noise and trained-step masks of a ``sampler`` section, drawn with ``seed``.

    ``segment``: one segment of ``segment_steps`` SDE steps starting in ``segment_start``;
    ``full``: SDE everywhere, a ``trained_fraction`` of the steps trained.
    """
    generator = torch.Generator().manual_seed(seed)
    if sampler.trajectory == "segment":
        return sde.segment_masks(
            sampler.num_steps, sampler.segment_steps, tuple(sampler.segment_start), generator
        )
    return sde.full_trajectory_masks(sampler.num_steps, sampler.trained_fraction, generator)


def micro_batches(num_groups: int, group_size: int, batch_size: int) -> list[range]:
    """Sample-index ranges of whole groups, ``batch_size`` samples each (at least one group).

    Training recomputes log-probs bit for bit only with the same batch composition, so these
    ranges (recorded in the rollout manifest) are the ones to recompute in.
    """
    per_batch = max(1, batch_size // group_size)
    return [
        range(first * group_size, min(first + per_batch, num_groups) * group_size)
        for first in range(0, num_groups, per_batch)
    ]


@dataclass
class RolloutPlan:
    """Everything a rollout decides before a model is loaded.

    Sample ``i`` belongs to group (and prompt) ``i // group_size``. The evaluate stage plans
    its ODE sampling with the same structure.
    """

    prompts: list[str]
    group_size: int
    seeds: torch.Tensor  # [B] int64
    masks: sde.StepMasks
    coeffs: sde.StepCoefficients
    micro_batches: list[range]
    velocity_steps: list[int] = field(default_factory=list)
    velocity_dtype: torch.dtype | None = None

    @property
    def prompt_ids(self) -> torch.Tensor:
        return torch.arange(len(self.prompts)).repeat_interleave(self.group_size)

    @property
    def num_steps(self) -> int:
        return self.masks.sde.numel()

    def share(self, rank: int, world_size: int) -> list[range]:
        """The micro-batches of ``rank``: dealt round-robin."""
        return self.micro_batches[rank::world_size]


def plan_rollout(config: RunConfig, pool: Sequence[str], round_index: int = 0) -> RolloutPlan:
    """Round ``round_index`` of ``config``: prompts drawn from ``pool``, seeds, masks, batches."""
    sampler, seed = config.sampler, config.train.seed
    prompts = draw_prompts(
        pool, sampler.prompts_per_round, derive_seed(seed, "prompts", round_index)
    )
    count = len(prompts) * sampler.group_size
    seeds = torch.tensor(
        [derive_seed(seed, "rollout", round_index, i) for i in range(count)], dtype=torch.int64
    )
    masks = step_masks(sampler, derive_seed(seed, "steps", round_index))
    return RolloutPlan(
        prompts=prompts,
        group_size=sampler.group_size,
        seeds=seeds,
        masks=masks,
        coeffs=step_coefficients(sampler),
        micro_batches=micro_batches(len(prompts), sampler.group_size, sampler.batch_size),
        velocity_steps=velocity_steps(config, masks.trained_indices),
        velocity_dtype=compute_dtype(config.backbone),
    )


def velocity_steps(config: RunConfig, trained_steps: Sequence[int]) -> list[int]:
    """The trained steps whose velocities the rollout stores: those training can reuse.

    None unless ``sampler.store_velocities`` and ``jagg.reuse_velocities``; then the steps of
    the windows that will be approximated (all of them under ``jagg_frac: auto``, decided
    later) and have interiors (:func:`jagg_pipeline.core.jagg.reusable_steps`).
    """
    from jagg_pipeline.core import jagg

    jagg_config = config.jagg
    if not (config.sampler.store_velocities and jagg_config.reuse_velocities):
        return []
    windows = len(jagg.split_windows(trained_steps, jagg_config.window, jagg_config.anchors))
    frac = jagg_config.jagg_frac
    routed = None if frac == "auto" else jagg.route_windows(windows, frac)
    return jagg.reusable_steps(
        trained_steps,
        jagg_config.window,
        routed,
        jagg_config.mode,
        jagg_config.no_interp,
        jagg_config.anchors,
    )


def compute_dtype(backbone: Any) -> torch.dtype:
    """The dtype the policy's network computes in: bfloat16 under bf16 mixed precision."""
    if backbone.mixed_precision == "bf16":
        return torch.bfloat16
    return DTYPES[backbone.dtype]


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def generate(
    backbone: Backbone,
    prompts: Sequence[str],
    encoded: Mapping[str, torch.Tensor],
    prompt_ids: torch.Tensor,
    seeds: torch.Tensor,
    sigmas: torch.Tensor,
    masks: sde.StepMasks,
    coeffs: sde.StepCoefficients,
    sample_ids: torch.Tensor | None = None,
    velocity_steps: Sequence[int] = (),
    velocity_dtype: torch.dtype | None = None,
) -> TrajectoryBatch:
    """Sample one micro-batch: sample ``i`` is prompt ``prompts[prompt_ids[i]]``, seed ``seeds[i]``.

    ``encoded`` is ``backbone.encode_prompts(prompts)``; each sample's rows of it are stored
    as its conditioning (training needs no text encoder). Each sample's generator draws its
    initial noise and then its SDE noise. Groups are the prompt ids. Returns tensors on the
    CPU, images as uint8.
    """
    cond = {k: v[prompt_ids.to(v.device)] for k, v in encoded.items()}
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    noise = torch.cat([backbone.initial_noise(1, g) for g in generators])
    trajectory = sde.sample(backbone.velocity, cond, noise, sigmas, masks, coeffs, generators)
    images = to_uint8(backbone.decode(trajectory.latents[:, -1]))
    velocities = None
    if velocity_steps:
        trained = masks.trained_indices
        columns = [trained.index(k) for k in velocity_steps]
        velocities = trajectory.velocities[:, columns].to("cpu", velocity_dtype)
    return TrajectoryBatch(
        latents=trajectory.latents.cpu(),
        log_probs=trajectory.log_probs.cpu(),
        sigmas=sigmas.cpu(),
        sde_mask=masks.sde,
        train_mask=masks.train,
        prompt_ids=prompt_ids.clone(),
        group_ids=prompt_ids.clone(),
        seeds=seeds.clone(),
        prompts=list(prompts),
        cond={k: v.cpu() for k, v in cond.items()},
        images=images.cpu(),
        sample_ids=sample_ids,
        velocities=velocities,
        velocity_steps=list(velocity_steps) if velocities is not None else None,
    )


def sample_batches(
    backbone: Backbone,
    plan: RolloutPlan,
    batches: Sequence[range],
    *,
    desc: str,
    progress: bool = True,
    pad_to: int = 0,
) -> TrajectoryBatch | None:
    """:func:`generate` over ``batches`` (sample-index ranges of ``plan``), in their order.

    All of the plan's prompts are encoded in one call, whatever the batches: text of
    variable length (QwenImage) is then padded alike in every micro-batch and on every rank,
    so shards concatenate and a sample's conditioning does not depend on its batch.

    ``pad_to``: sample copies of a micro-batch, then drop them, until ``pad_to`` batches ran.
    Under FSDP2 every forward is a collective (each unit's all-gather), so every rank must
    make as many as the others; a rank dealt one batch fewer pads. None when ``batches`` is
    empty (a rank that only pads).
    """
    from tqdm.auto import tqdm

    encoded = backbone.encode_prompts(plan.prompts)
    sigmas = backbone.sigmas(plan.num_steps)
    prompt_ids = plan.prompt_ids
    padding = [plan.micro_batches[0]] * max(0, pad_to - len(batches))
    parts = []
    work = [*batches, *padding]
    # disable=None: tqdm shows the bar only when stderr is a terminal.
    for number, samples in enumerate(
        tqdm(work, desc=desc, unit="batch", disable=None if progress else True)
    ):
        index = torch.tensor(samples, dtype=torch.int64)
        part = generate(
            backbone,
            plan.prompts,
            encoded,
            prompt_ids[index],
            plan.seeds[index],
            sigmas,
            plan.masks,
            plan.coeffs,
            index,
            plan.velocity_steps,
            plan.velocity_dtype,
        )
        if number < len(batches):
            parts.append(part)
    return concatenate(parts) if parts else None


def batches_per_rank(plan: RolloutPlan, world_size: int) -> int:
    """The most micro-batches any rank is dealt: what every rank runs (padding the rest)."""
    return math.ceil(len(plan.micro_batches) / world_size)


def sample_rollout(
    backbone: Backbone,
    plan: RolloutPlan,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> TrajectoryBatch:
    """Sample ``rank``'s share of ``plan`` with ``backbone`` (the whole plan on one rank).

    Every rank makes the same number of forward calls (:func:`sample_batches`' padding).
    """
    share = plan.share(rank, world_size)
    if not share:
        raise InputError(
            f"rank {rank} of {world_size} has no work: the rollout has only "
            f"{len(plan.micro_batches)} micro-batches; use fewer processes (train.nproc, "
            "train.nodes) or a smaller sampler.batch_size"
        )
    shard = sample_batches(
        backbone,
        plan,
        share,
        desc="rollout" if world_size == 1 else f"rollout rank {rank}",
        progress=progress,
        pad_to=batches_per_rank(plan, world_size),
    )
    assert shard is not None  # the share is not empty
    return shard


# --------------------------------------------------------------------------------------------
# Stage outputs
# --------------------------------------------------------------------------------------------


def run_rollout(
    config: RunConfig,
    policy: str | Path,
    prompts: str | Path,
    out: str | Path,
    *,
    round_index: int = 0,
    column: str | None = None,
    progress: bool = True,
    conditioning: str | Path | None = None,
) -> Path:
    """The rollout stage: ``out/shard-<rank>.*``, ``out/config.yaml``, ``out/manifest.json``.

    ``policy``: ``base`` or a checkpoint directory
    (:func:`jagg_pipeline.stages.policy.load_policy`);
    ``prompts``: a prompt file or ``toy:train`` / ``toy:heldout``; ``conditioning``: the
    encode stage's folder of that pool (no text encoder is loaded; None: prompts encoded
    inline). Under torchrun every rank runs this; rank 0 clears the directory first and
    writes the manifest after all shards.
    """
    clock = StageClock.start()
    from jagg_pipeline.stages.distributed import distributed
    from jagg_pipeline.stages.encode import conditioning_inputs, open_pool
    from jagg_pipeline.stages.policy import load_sharded_policy

    out = Path(out)
    plan = plan_rollout(config, resolve_prompts(prompts, column), round_index)
    source = open_pool(config, conditioning)
    with distributed(config.backbone.device) as ctx:
        # FSDP2-sharded over every rank (no rank holds the whole policy); each samples its
        # share of the micro-batches.
        backbone = load_sharded_policy(config, policy, ctx, text_encoders=source is None)
        backbone.use_precomputed(source)
        begin_rollout(out, ctx.rank)
        clock.lap("load")
        start = time.perf_counter()
        shard = sample_rollout(backbone, plan, ctx.rank, ctx.world_size, progress and ctx.is_main)
        clock.lap("work")
        seconds = time.perf_counter() - start
        finish_rollout(
            config,
            out,
            shard,
            plan,
            rollout_metrics(plan, shard, seconds, clock.record()),
            rank=ctx.rank,
            world_size=ctx.world_size,
            round_index=round_index,
            inputs=stage_inputs(prompts, policy) | conditioning_inputs(conditioning),
            sources={"policy": str(policy), "prompts": str(prompts)},
        )
    return out


def begin_rollout(out: Path, rank: int) -> None:
    """Rank 0 clears a rollout folder's stale manifest, shards and metrics; all ranks wait."""
    from jagg_pipeline.stages.distributed import barrier

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        begin_output(out, (*SHARD_FILES, METRICS_NAME))
    barrier()


def rollout_metrics(
    plan: RolloutPlan, shard: TrajectoryBatch, seconds: float, clock: Mapping[str, float]
) -> dict[str, Any]:
    """The rollout's metric line: samples, seconds, the job's times, velocity bytes.

    ``velocity_bytes``: what storing the velocities for on-policy reuse costs per sample.
    """
    velocities = shard.velocities
    extra = 0 if velocities is None else velocities[0].numel() * velocities.itemsize
    return {
        "samples": len(plan.seeds),
        "seconds": seconds,
        "time": dict(clock),
        "velocity_bytes": extra,
    }


def finish_rollout(
    config: RunConfig,
    out: Path,
    shard: TrajectoryBatch,
    plan: RolloutPlan,
    metrics: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    round_index: int,
    inputs: Mapping[str, Path],
    sources: Mapping[str, str],
) -> None:
    """Every rank writes its shard of ``out``; rank 0 the metric line and the manifest, last.

    A collective (after :func:`begin_rollout`). ``sources``: the policy and prompts as given,
    recorded in the manifest.
    """
    from jagg_pipeline.io.manifest import recorded_digests
    from jagg_pipeline.stages.distributed import all_gather_object

    shard.save(out, rank)
    # The digests each rank recorded while writing its shard, for rank 0's manifest (a
    # collective: also the barrier before it), so no shard is read back to be hashed.
    recorded = {
        name: digest
        for digests in all_gather_object(recorded_digests(out))
        for name, digest in digests.items()
    }
    if rank != 0:
        return
    append_metrics(out, STAGE, round_index, 0, metrics)
    finish_output(
        out,
        config,
        stage=STAGE,
        seeds={"train": config.train.seed, "round": round_index},
        inputs=inputs,
        recorded=recorded,
        extra={
            **sources,
            "world_size": world_size,
            "samples": len(plan.seeds),
            "micro_batches": [[r.start, r.stop] for r in plan.micro_batches],
            "trained_steps": plan.masks.trained_indices,
        },
    )
