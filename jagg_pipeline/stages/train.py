"""The training stage: one GRPO round over a scored rollout, JAGG-accelerated, under FSDP2.

Owns the update of one round (:func:`train_round`):

- inputs: the rollout (stage ``rollout``, same ``backbone`` and ``sampler`` sections, sampled
  from ``--policy`` for this round) and its score table (stage ``score``, computed from those
  rollouts); the advantages are the table's, not recomputed;
- the plan: the rollout's micro-batches (whole prompt groups, the batch composition they were
  sampled in, so log-probs recompute as sampled) are shuffled by the trainer's generator and
  dealt into ``train.minibatches`` optimizer steps, and each step's share into equal parts per
  rank;
- per optimizer step, the GRPO objective is the mean over the step's samples (on ALL ranks)
  and their trained steps: every rank's :class:`~jagg_pipeline.core.objective.GRPOStepLoss` has the
  GLOBAL normaliser, and FSDP2 sums the ranks' gradients (:mod:`jagg_pipeline.stages.distributed`),
  so
  the gradient is the one-process gradient whatever the rank count or grouping of steps into
  backward calls;
- windows of ``jagg.window`` trained steps, routed to ``jagg.mode`` by ``jagg.jagg_frac`` or
  by probing (``auto``: the cos-sim between the jagg and the exact gradient per window on a
  probe batch, every ``auto_every`` rounds, kept in the checkpoint);
- AdamW, warm-up + constant/linear/cosine LR, grad-norm clipping, optional KL to the frozen
  base policy, optional EMA; a step whose loss or gradient is non-finite is skipped and
  counted;
- metrics: one JSON line per optimizer step in ``CKPT/metrics.jsonl``.

Checkpoint format and atomic writing: :mod:`jagg_pipeline.stages.checkpoint`. A killed run leaves no
checkpoint; rerunning the command recomputes the round, bit for bit on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.backbones import Backbone
from jagg_pipeline.core import jagg
from jagg_pipeline.core.objective import GRPOStepLoss
from jagg_pipeline.io import shards
from jagg_pipeline.io.manifest import (
    CHECKED_SECTIONS,
    ManifestError,
    check_derived_from,
    check_made,
)
from jagg_pipeline.io.tables import read_table
from jagg_pipeline.io.trajectories import RolloutReader, TrajectoryBatch
from jagg_pipeline.io.verify import Reads, verify_reads, verify_sharded
from jagg_pipeline.stages import checkpoint as ckpt
from jagg_pipeline.stages import distributed
from jagg_pipeline.stages.optim import Ema, build_optimizer
from jagg_pipeline.stages.scoring import table_path
from jagg_pipeline.support.errors import InputError
from jagg_pipeline.support.startup import StageClock
from jagg_pipeline.support.timing import ForwardClock

if TYPE_CHECKING:
    from jagg_pipeline.config.run import JaggConfig, RunConfig

_TABLE_COLUMNS = ("sample", "prompt_id", "group", "total", "advantage")


class TrainInputError(InputError):
    """The rollouts, score table or policy do not fit together or the config; names the file."""


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass
class RoundData:
    """A scored rollout, checked: trajectories, advantages, rewards and the sampling batches."""

    # A rollout folder (each rank reads the trajectories of its own samples only), or the
    # whole rollout in memory (a block of rounds).
    batch: RolloutReader | TrajectoryBatch
    advantages: torch.Tensor  # [B] float32, from the score table
    rewards: dict[str, torch.Tensor]  # each reward column and "total", [B]
    micro_batches: list[list[int]]  # sample indices, as the rollout sampled them
    round: int  # the round the rollout was sampled for


def _check_policy_source(rollouts: Path, made: dict[str, Any], policy: str | Path) -> None:
    """Refuse rollouts that were not sampled from ``policy`` (PPO ratios would be wrong)."""
    from jagg_pipeline.io.artifacts import BASE, policy_weights_dir

    if str(policy) == BASE:
        if "policy" in made.get("inputs", {}):
            raise TrainInputError(
                f"{rollouts}: was sampled from {made.get('policy')}, not from the base policy"
            )
        return
    try:
        check_derived_from(rollouts, made, "policy", policy_weights_dir(policy))
    except ManifestError as err:
        raise TrainInputError(f"{err}; sample the rollouts from --policy {policy}") from None


def _table_rows(path: Path, batch: RolloutReader, reward_names: Sequence[str]) -> list[dict]:
    rows = read_table(path)
    if len(rows) != len(batch):
        raise TrainInputError(f"{path}: {len(rows)} rows for a rollout of {len(batch)} samples")
    missing = [c for c in (*_TABLE_COLUMNS, *reward_names) if c not in rows[0]]
    if missing:
        raise TrainInputError(f"{path}: lacks the column(s) {', '.join(missing)}")
    columns = {
        name: torch.tensor([int(row[name]) for row in rows])
        for name in ("sample", "prompt_id", "group")
    }
    expected = {
        "sample": torch.arange(len(batch)),
        "prompt_id": batch.prompt_ids,
        "group": batch.group_ids,
    }
    for name, values in columns.items():
        if not torch.equal(values, expected[name].to(values.dtype)):
            raise TrainInputError(
                f"{path}: column {name!r} does not match the rollout's samples in order"
            )
    return rows


def _rollout_micro_batches(rollouts: Path, made: dict[str, Any], size: int) -> list[list[int]]:
    ranges = made.get("micro_batches")
    if not ranges:
        raise TrainInputError(f"{rollouts}: its manifest records no micro_batches")
    batches = [list(range(start, stop)) for start, stop in ranges]
    if sorted(i for b in batches for i in b) != list(range(size)):
        raise TrainInputError(
            f"{rollouts}: the manifest's micro_batches do not cover its {size} samples"
        )
    return batches


def load_round_data(
    config: RunConfig, policy: str | Path, rollouts: str | Path, scores: str | Path
) -> RoundData:
    """Read and cross-check a round's inputs; errors name the file that does not fit.

    Everything this rank reads in the round is verified first, before any model is built
    (:func:`verify_training_reads`): the rollout's shard files (every rank reads each
    shard's per-sample columns, and the rows of its own samples), the score table and what
    it reads of a checkpoint ``policy``. The manifests are checked without hashing anything
    else, and what the inputs were derived from is compared by the digests the manifests
    record.
    """
    from jagg_pipeline.stages.rollout import SHARD_FILES
    from jagg_pipeline.stages.scoring import TABLE_NAME

    rollouts, scores = Path(rollouts), Path(scores)
    made = check_made(
        rollouts, stage="rollout", config=config, sections=CHECKED_SECTIONS["rollout"]
    )
    scored = check_made(scores, stage="score", config=config, sections=CHECKED_SECTIONS["score"])
    check_derived_from(scores, scored, "rollouts", rollouts)
    _check_policy_source(rollouts, made, policy)
    shard_files = tuple(sorted(p.name for pattern in SHARD_FILES for p in rollouts.glob(pattern)))
    reads = [Reads(rollouts, made, shard_files), Reads(scores, scored, (TABLE_NAME,))]
    verify_training_reads(config, policy, also=reads)
    batch = RolloutReader(rollouts)
    rows = _table_rows(table_path(scores), batch, list(config.rewards.weights))
    return scored_round(
        config,
        batch,
        rows,
        _rollout_micro_batches(rollouts, made, len(batch)),
        int(made.get("seeds", {}).get("round", 0)),
    )


def verify_training_reads(
    config: RunConfig, policy: str | Path, also: Sequence[Reads] = ()
) -> None:
    """Refuse a corrupt file among what this rank reads to train from ``policy``, up front.

    A collective under a process group: each file once per node
    (:func:`~jagg_pipeline.io.verify.verify_sharded`). Of a checkpoint ``policy``: its
    trainer state and generator, and the files of this rank's rows of ``policy/``, the
    optimizer state and (``train.ema_decay``) the EMA, planned from their ``.metadata``;
    ``also``: the job's other reads (a round's rollout and scores). Runs before the model
    is built, so a damaged checkpoint is refused in seconds, naming the file.
    """
    from jagg_pipeline.io.artifacts import BASE, policy_weights_dir
    from jagg_pipeline.stages.policy import check_checkpoint

    if str(policy) == BASE:
        if also:  # (every rank alike: no collective for nothing)
            verify_reads(also)
        return
    manifest = check_checkpoint(config, policy)
    trainer = (f"{ckpt.TRAINER_DIR}/{ckpt.STATE_FILE}", f"{ckpt.TRAINER_DIR}/{ckpt.RNG_FILE}")
    folders = [policy_weights_dir(policy), ckpt.optimizer_dir(policy)]
    if (ema := _ema_folder(config, policy)) is not None:
        folders.append(ema)
    verify_sharded(folders, policy, manifest, also=[*also, Reads(Path(policy), manifest, trainer)])


def _ema_folder(config: RunConfig, checkpoint: str | Path) -> Path | None:
    """The checkpoint's EMA folder when ``train.ema_decay`` is set (refused if it has none)."""
    if config.train.ema_decay is None:
        return None
    folder = ckpt.ema_dir(checkpoint)
    if folder is None:
        raise TrainInputError(
            f"{checkpoint}: has no EMA weights, but train.ema_decay is set; start "
            "from base or keep train.ema_decay as that run had it"
        )
    return folder


def scored_round(
    config: RunConfig,
    batch: RolloutReader | TrajectoryBatch,
    rows: Sequence[Mapping[str, Any]],
    micro_batches: list[list[int]],
    round_index: int,
) -> RoundData:
    """A round's training inputs from its rollout and its score table's rows (as written).

    The rows' values go through Python floats to float32 whichever way they came (read from
    the table or handed over in memory), so both give the same tensors.
    """
    names = (*config.rewards.weights, "total")
    return RoundData(
        batch=batch,
        advantages=torch.tensor([float(r["advantage"]) for r in rows], dtype=torch.float32),
        rewards={
            name: torch.tensor([float(r[name]) for r in rows], dtype=torch.float32)
            for name in names
        },
        micro_batches=micro_batches,
        round=round_index,
    )


# --------------------------------------------------------------------------------------------
# Plan: micro-batches -> optimizer steps -> ranks
# --------------------------------------------------------------------------------------------


def plan_steps(
    num_micro_batches: int, minibatches: int, world_size: int, generator: torch.Generator
) -> list[list[list[int]]]:
    """``plan[step][rank]``: the indices of the rollout micro-batches each rank trains on.

    Micro-batches are shuffled, dealt into ``minibatches`` optimizer steps, and each step's
    share into equal parts per rank: FSDP2 ranks must make the same number of forward and
    backward calls, so every rank gets the same number of micro-batches.
    """
    if num_micro_batches % minibatches:
        raise TrainInputError(
            f"train.minibatches={minibatches} does not divide the rollout's {num_micro_batches} "
            "micro-batches (sampler.prompts_per_round groups, sampler.batch_size samples each)"
        )
    per_step = num_micro_batches // minibatches
    if per_step % world_size:
        raise TrainInputError(
            f"{per_step} micro-batches per optimizer step cannot be split evenly over "
            f"{world_size} processes (train.nodes x train.nproc / torchrun --nnodes x "
            "--nproc_per_node); change train.minibatches, sampler.prompts_per_round or "
            "sampler.batch_size"
        )
    order = torch.randperm(num_micro_batches, generator=generator).tolist()
    per_rank = per_step // world_size
    return [
        [
            order[step * per_step + rank * per_rank : step * per_step + (rank + 1) * per_rank]
            for rank in range(world_size)
        ]
        for step in range(minibatches)
    ]


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """Which windows use the approximate gradient, and why (stored in the checkpoint).

    ``source``: ``exact`` (mode exact), ``fraction`` (``jagg_frac``), ``auto`` (probed in
    round ``probed_round``, with the per-window similarities in ``probes``).
    """

    routed: list[bool]
    source: str
    probed_round: int | None = None
    probes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Routing | None:
        return None if data is None else cls(**data)


def decide_routing(
    jagg_config: JaggConfig,
    num_windows: int,
    round_index: int,
    previous: Routing | None,
    probe: Callable[[], list[dict[str, Any]]],
) -> Routing:
    """The routing of this round's windows (counted from high noise).

    ``auto`` probes in round 0, every ``auto_every`` rounds, and whenever the stored routing
    is missing or was made for another number of windows; otherwise it keeps the stored one.
    A window goes to the approximation when its probed cos-sim (of ``jagg.mode``) is at least
    ``auto_threshold``; an undefined similarity (zero gradient) keeps it exact.
    """
    if jagg_config.mode == "exact":
        return Routing([False] * num_windows, "exact")
    if jagg_config.jagg_frac != "auto":
        return Routing(jagg.route_windows(num_windows, jagg_config.jagg_frac), "fraction")
    reuse = (
        previous is not None
        and previous.source == "auto"
        and len(previous.routed) == num_windows
        and round_index % jagg_config.auto_every != 0
    )
    if reuse:
        return previous
    probes = probe()
    similarity = [p[jagg_config.mode]["cos_sim"] for p in probes]
    routed = [math.isfinite(c) and c >= jagg_config.auto_threshold for c in similarity]
    return Routing(routed, "auto", round_index, probes)


# --------------------------------------------------------------------------------------------
# Optimizer pieces
# --------------------------------------------------------------------------------------------


@contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels where torch has them (matters on CUDA), restored afterwards."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# --------------------------------------------------------------------------------------------
# The round
# --------------------------------------------------------------------------------------------


@dataclass
class RoundResult:
    """What :func:`train_round` did: the checkpoint and the per-step metrics."""

    checkpoint: Path
    round: int
    metrics: list[dict[str, Any]]
    routing: Routing


def _reward_stats(data: RoundData, indices: Sequence[int]) -> dict[str, float]:
    index = torch.tensor(list(indices))
    total = data.rewards["total"][index]
    stats = {
        "mean": float(total.mean()),
        "std": float(total.std(unbiased=False)),
        "min": float(total.min()),
        "max": float(total.max()),
    }
    stats.update({name: float(v[index].mean()) for name, v in data.rewards.items()})
    return stats


def _probe_indices(data: RoundData, order: Sequence[int], groups: int) -> list[int]:
    """Samples of the first ``groups`` prompt groups met in the shuffled micro-batch order."""
    samples = [i for m in order for i in data.micro_batches[m]]
    first = list(dict.fromkeys(int(data.batch.group_ids[i]) for i in samples))[:groups]
    return [i for i in samples if int(data.batch.group_ids[i]) in first]


def _log_step(row: dict[str, Any], steps: int) -> None:
    """One plain line per optimizer step on stderr (batch logs have no progress bar)."""
    print(
        f"train round {row['round']} step {row['step'] + 1}/{steps}: loss={row['loss']:.4g} "
        f"grad_norm={row['grad_norm']:.4g} reward={row['reward']['mean']:.4g}"
        + (" SKIPPED (non-finite)" if row["skipped"] else ""),
        file=sys.stderr,
        flush=True,
    )


def _warn_rejected_reuse(row: dict[str, Any]) -> None:
    """Say on stderr when the rollout's velocities failed the on-policy check."""
    rejected = [w for w in row["windows"] if w["reuse_rejected"]]
    if rejected:
        worst = max(w["reuse_error"] for w in rejected)
        print(
            f"warning: train round {row['round']} step {row['step'] + 1}: the rollout's "
            f"velocities differ from the recomputed ones (relative deviation {worst:.3g}) in "
            f"window(s) {[w['window'] for w in rejected]}; their interiors were recomputed. "
            "The rollout was not sampled by these weights in this precision (a changed base "
            "checkpoint?): its log-probs are not on-policy either",
            file=sys.stderr,
            flush=True,
        )


def _interior_path(stats: Sequence[Sequence[jagg.WindowStats]], window: int) -> dict[str, Any]:
    """Where a window's interior velocities came from on this rank, and the on-policy check.

    ``interior``: ``reused`` (the rollout's), ``recomputed`` (a no-grad forward) or ``none``
    (none needed: exact windows, W = 2, no_interp drop). ``reuse_error``: the largest relative
    deviation of a recomputed endpoint velocity from the rollout's (None: none stored or
    checked); ``reuse_rejected``: it was beyond rounding, so the interiors were recomputed.
    """
    rows = [row[window] for row in stats]
    errors = [w.reuse_error for w in rows if w.reuse_error is not None]
    if any(w.reused_rows for w in rows):
        interior = "reused"
    elif any(w.recomputed_rows for w in rows):
        interior = "recomputed"
    else:
        interior = "none"
    return {
        "interior": interior,
        "reuse_error": max(errors) if errors else None,
        "reuse_rejected": any(w.reuse_rejected for w in rows),
    }


class Trainer:
    """The training state on one rank: the sharded policy, optimizer, schedule, EMA, generator.

    Built from ``base`` or a checkpoint, it trains one round per :meth:`train` call: the
    train stage trains one and writes it; a block of rounds keeps it between rounds. The
    caller verifies a checkpoint's files first (:func:`verify_training_reads`).
    """

    def __init__(
        self,
        config: RunConfig,
        ctx: distributed.DistContext,
        policy: str | Path,
        previous: ckpt.TrainerState | None,
        backbone: Backbone | None = None,
    ) -> None:
        from jagg_pipeline.io.artifacts import BASE
        from jagg_pipeline.stages.policy import load_sharded_policy

        self.config, self.ctx = config, ctx
        # The round trained next, and the routing the last round used (auto keeps it).
        self.round = 0 if previous is None else previous.round + 1
        self.routing = None if previous is None else Routing.from_dict(previous.routing)
        self.engine = config.jagg.engine_options()
        train = config.train
        self.generator = torch.Generator()
        if previous is None:
            self.generator.manual_seed(train.seed)
        else:
            self.generator.set_state(ckpt.read_rng_state(policy))
        self.skipped = 0 if previous is None else previous.skipped_steps
        # The weights are those that sampled the round's rollout (train_round checked the
        # rollout's policy) until an optimizer step is applied: the on-policy state.
        self.on_policy = True
        self.clock = ForwardClock(ctx.device)

        # The policy built sharded: each rank reads only its own rows of the weights (the
        # checkpoint's, the base's for the rest), then of the optimizer state and EMA.
        # ``backbone``: ``policy`` loaded so already (a block of rounds samples with it too).
        if backbone is None:
            backbone = load_sharded_policy(config, policy, ctx, for_training=True, verified=True)
        self.backbone = backbone
        self.velocity = self.clock.wrap(self.backbone.velocity)
        self.reference = None
        if config.grpo.kl_beta > 0:
            frozen = load_sharded_policy(config, BASE, ctx, for_training=True, frozen=True)
            self.reference = self.clock.wrap(frozen.velocity)
        transformer = self.backbone.transformer
        self.named = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
        self.params = list(self.named.values())

        self.optimizer, self.scheduler = build_optimizer(self.params, train)
        self.ema = None if train.ema_decay is None else Ema(self.named, train.ema_decay)
        if previous is not None:
            self._resume(policy, previous)

    def _resume(self, checkpoint: str | Path, previous: ckpt.TrainerState) -> None:
        """Continue from ``checkpoint``: this rank's shards of its optimizer state and EMA.

        Its weights are in place already (:func:`~jagg_pipeline.stages.policy.load_sharded_policy`).
        What this reads was verified before the model was built (:func:`verify_training_reads`).
        """
        from jagg_pipeline.stages.policy import load_weights

        transformer = self.backbone.transformer
        optimizer = distributed.optimizer_state_dict(transformer, self.optimizer)
        shards.load(optimizer, ckpt.optimizer_dir(checkpoint))
        distributed.load_optimizer_state_dict(transformer, self.optimizer, optimizer)
        self.scheduler.load_state_dict(previous.scheduler)
        if (ema := _ema_folder(self.config, checkpoint)) is not None:
            load_weights(self.ema.shadow, ema, collective=True, what="EMA weights")

    def micro_batch(
        self,
        data: RoundData,
        indices: Sequence[int],
        normalizer: float | None,
        reuse: bool = False,
    ) -> jagg.MicroBatch:
        """The samples ``indices`` on this rank's device with their GRPO objective.

        ``normalizer``: what the summed step losses are divided by (None: this batch's
        samples times trained steps). ``reuse``: attach the rollout's velocities (valid only
        while :attr:`on_policy`).
        """
        from jagg_pipeline.stages.rollout import step_coefficients

        device, config = self.ctx.device, self.config
        part = data.batch.select(list(indices))
        latents = part.latents.to(device)
        sigmas = part.sigmas.to(device)
        cond = {k: v.to(device) for k, v in part.cond.items()}
        objective = GRPOStepLoss(
            latents,
            sigmas,
            part.log_probs.to(device),
            data.advantages[list(indices)].to(device),
            part.trained_steps,
            step_coefficients(config.sampler),
            config.grpo.clip_range,
            normalizer=normalizer,
            kl_beta=config.grpo.kl_beta,
            reference=self.reference,
            cond=cond,
        )
        return jagg.MicroBatch(
            latents, sigmas, cond, objective, part.step_velocities() if reuse else None
        )

    def probe(self, data: RoundData, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Per-window agreement with the exact gradient on the samples ``indices``.

        Every rank probes the same batch: the summed gradients are world_size times one
        rank's, which leaves the cosine similarities unchanged.
        """
        probes = jagg.probe_windows(
            self.params,
            self.velocity,
            self.micro_batch(data, indices, None),
            data.batch.trained_steps,
            window=self.config.jagg.window,
            options=self.engine,
        )
        return [p.to_dict() for p in probes]

    def step(
        self,
        data: RoundData,
        step_plan: Sequence[Sequence[int]],
        windows: Sequence[Sequence[int]],
        routing: Routing,
    ) -> dict[str, Any]:
        """One optimizer step on this rank's micro-batches of ``step_plan``; its metrics."""
        jagg_config = self.config.jagg
        samples = [i for rank in step_plan for m in rank for i in data.micro_batches[m]]
        # The objective is the mean over the step's samples on ALL ranks.
        normalizer = float(len(samples) * len(data.batch.trained_steps))
        reuse = self.on_policy and jagg_config.reuse_velocities
        local = [
            self.micro_batch(data, data.micro_batches[m], normalizer, reuse)
            for m in step_plan[self.ctx.rank]
        ]
        lr = self.scheduler.get_last_lr()[0]
        forward_before = self.clock.seconds
        self.clock.mark("start")
        stats = jagg.accumulate_gradient(
            self.velocity,
            local,
            windows,
            routing.routed,
            jagg_config.mode,
            self.engine,
            lambda on: distributed.set_gradient_sync(self.backbone.transformer, on),
        )
        self.clock.mark("engine")

        diagnostics = [part.objective.diagnostics() for part in local]
        (max_ratio_dev,) = distributed.all_reduce_max(
            [max(d["max_ratio_dev"] for d in diagnostics)]
        )
        loss, clipfrac, approx_kl = distributed.all_reduce_sum(
            [
                sum(w.loss for row in stats for w in row),
                sum(d["clipfrac"] * p.size for d, p in zip(diagnostics, local, strict=True)),
                sum(d["approx_kl"] * p.size for d, p in zip(diagnostics, local, strict=True)),
            ]
        )
        self.clock.mark("reduce")
        grad_norm, applied = self._apply(loss)
        self.clock.mark("optimizer")
        # The step's one device synchronisation: it completes the forward and mark timings.
        seconds = self.clock.sync()
        forward_seconds = self.clock.seconds - forward_before

        per_window = [
            {
                "window": w,
                "steps": list(chunk),
                "mode": stats[0][w].mode,
                "backward_calls": sum(row[w].backward_calls for row in stats),
                **_interior_path(stats, w),
            }
            for w, chunk in enumerate(windows)
        ]
        return {
            "global_step": self.scheduler.last_epoch - 1,
            "lr": lr,
            "loss": loss,
            "clipfrac": clipfrac / len(samples),
            "approx_kl": approx_kl / len(samples),
            "max_ratio_dev": max_ratio_dev,
            "grad_norm": grad_norm,
            "skipped": not applied,
            "skipped_steps": self.skipped,
            "reward": _reward_stats(data, samples),
            "samples": len(samples),
            "micro_batches_per_rank": len(local),
            "backward_calls": sum(w["backward_calls"] for w in per_window),
            "network_calls": sum(w.network_calls for row in stats for w in row),
            "windows": per_window,
            "time": {
                "forward": forward_seconds,
                "backward": seconds["engine"] - forward_seconds,
                "optimizer": seconds["optimizer"],
            },
        }

    def _apply(self, loss: float) -> tuple[float, bool]:
        """Clip, then step unless the loss or the gradient is non-finite: (grad norm, applied)."""
        clip = self.config.train.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else math.inf)
        grad_norm = float(distributed.full_tensor(norm))
        # Loss and norm are global (all-reduced), so every rank takes the same branch.
        applied = math.isfinite(loss) and math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            self.on_policy = False
            if self.ema is not None:
                self.ema.update(self.named)
        else:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # The schedule follows the optimizer-step index, skipped steps included; torch
            # warns when the first step of a run is one of them.
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        return grad_norm, applied

    def train(
        self, data: RoundData, clock: StageClock, progress: bool
    ) -> tuple[list[dict[str, Any]], Routing]:
        """Train round :attr:`round` on ``data``; its per-step metrics and routing.

        ``data`` was sampled by the current weights. ``clock``: the job's (its seconds go on
        the first step's line, which tracking sums over a round); its load lap ends after
        planning.
        """
        config, round_index = self.config, self.round
        # The weights are those that sampled the round's rollout until an optimizer step is
        # applied: the on-policy state.
        self.on_policy = True
        # Plan and route: micro-batches into optimizer steps and ranks; windows to engines.
        windows = jagg.split_windows(
            data.batch.trained_steps, config.jagg.window, config.jagg.anchors
        )
        plan = plan_steps(
            len(data.micro_batches), config.train.minibatches, self.ctx.world_size, self.generator
        )
        order = [m for step in plan for rank in step for m in rank]
        clock.lap("load")
        probe_start = time.perf_counter()

        def probe() -> list[dict[str, Any]]:
            return self.probe(data, _probe_indices(data, order, config.jagg.auto_probe_groups))

        routing = decide_routing(config.jagg, len(windows), round_index, self.routing, probe)
        probes = routing.probes if routing.probed_round == round_index else None
        every = config.jagg.probe_every
        if probes is None and every and round_index % every == 0:
            probes = probe()  # measured for the report only; the routing stays as decided
        probe_seconds = time.perf_counter() - probe_start
        metrics = _run_steps(
            self, data, plan, windows, routing, round_index, (probes, probe_seconds), progress
        )
        clock.lap("work")
        metrics[0]["time"].update(clock.record())
        self.routing, self.round = routing, round_index + 1
        return metrics, routing

    def contents(
        self, round_index: int, routing: Routing, metrics: list[dict[str, Any]]
    ) -> ckpt.CheckpointContents:
        """Everything the checkpoint holds, gathered to rank 0 (collectives: every rank)."""
        transformer = self.backbone.transformer
        return ckpt.CheckpointContents(
            model_state=distributed.model_state_dict(transformer),
            optimizer_state=distributed.optimizer_state_dict(transformer, self.optimizer),
            rng_state=self.generator.get_state(),
            trainer=ckpt.TrainerState(
                round=round_index,
                global_step=self.scheduler.last_epoch,
                skipped_steps=self.skipped,
                scheduler=self.scheduler.state_dict(),
                routing=dataclasses.asdict(routing),
                world_size=self.ctx.world_size,
            ),
            metrics=metrics,
            ema_state=None if self.ema is None else self.ema.shadow,
        )


def _run_steps(
    trainer: Trainer,
    data: RoundData,
    plan: list[list[list[int]]],
    windows: list[list[int]],
    routing: Routing,
    round_index: int,
    probed: tuple[list[dict[str, Any]] | None, float],
    progress: bool,
) -> list[dict[str, Any]]:
    """Every optimizer step of the plan; one metrics row each, shown as the round goes.

    ``probed``: this round's per-window probes (None: not probed) and the seconds they took.
    """
    from tqdm.auto import tqdm

    is_main = trainer.ctx.is_main
    metrics: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(plan),
        desc=f"train round {round_index}",
        unit="step",
        disable=None if progress and is_main else True,
    )
    for step_index, step_plan in enumerate(plan):
        row = {"round": round_index, "step": step_index}
        row.update(trainer.step(data, step_plan, windows, routing))
        if step_index == 0:
            row["routing"] = {"source": routing.source, "routed": routing.routed}
            probes, probe_seconds = probed
            if probes is not None:
                row["probe"] = probes
                row["time"]["probe"] = probe_seconds
        metrics.append(row)
        if is_main:
            _warn_rejected_reuse(row)
        if is_main and progress:
            if bar.disable:
                _log_step(row, len(plan))
            else:
                bar.set_postfix(
                    loss=f"{row['loss']:.3g}", grad=f"{row['grad_norm']:.3g}", refresh=False
                )
        bar.update()
    bar.close()
    return metrics


def save_round(
    trainer: Trainer,
    contents: ckpt.CheckpointContents,
    out: Path,
    policy: str | Path,
    inputs: dict[str, Path],
) -> None:
    """Every rank writes its shards of the checkpoint, rank 0 the rest (a collective)."""
    config, ctx = trainer.config, trainer.ctx
    round_index = contents.trainer.round
    ckpt.write_checkpoint(
        out,
        contents,
        config=config,
        seeds={"train": config.train.seed, "round": round_index},
        inputs=inputs,
        extra={
            "round": round_index,
            "policy": str(policy),
            "world_size": ctx.world_size,
            "global_step": contents.trainer.global_step,
            "skipped_steps": contents.trainer.skipped_steps,
        },
    )


def train_round(
    config: RunConfig,
    policy: str | Path,
    rollouts: str | Path,
    scores: str | Path,
    out: str | Path,
    *,
    progress: bool = True,
) -> RoundResult:
    """Train one round on a scored rollout and write the checkpoint ``out`` (atomically).

    ``policy``: ``base`` (round 0) or the previous round's checkpoint, whose optimizer,
    scheduler, generator, EMA and routing state continue here. Every rank of a ``torchrun``
    job calls this; without torchrun it runs as a world of one. ``progress``: a progress bar
    (on a terminal) or one line per optimizer step on stderr, from rank 0.
    """
    clock = StageClock.start()
    from jagg_pipeline.io.artifacts import BASE, policy_weights_dir

    out = Path(out)
    with distributed.distributed(config.backbone.device) as ctx, deterministic():
        # Load: the round's inputs, checked against each other and the policy (under the
        # process group: the ranks of a node share out verifying what they read).
        data = load_round_data(config, policy, rollouts, scores)
        previous = None if str(policy) == BASE else ckpt.read_trainer_state(policy)
        round_index = 0 if previous is None else previous.round + 1
        if data.round != round_index:
            raise TrainInputError(
                f"{rollouts}: was sampled for round {data.round}, but --policy {policy} trains "
                f"round {round_index}"
            )
        inputs = {"rollouts": Path(rollouts), "scores": Path(scores)}
        if previous is not None:
            inputs["policy"] = policy_weights_dir(policy)
        warn_world_size(config, ctx)
        # Build: the sharded policy, optimizer, schedule, EMA.
        trainer = Trainer(config, ctx, policy, previous)
        metrics, routing = trainer.train(data, clock, progress)
        refuse_all_skipped(config, round_index, metrics, scores)
        save_round(trainer, trainer.contents(round_index, routing, metrics), out, policy, inputs)
    return RoundResult(out, round_index, metrics, routing)


def warn_world_size(config: RunConfig, ctx: distributed.DistContext) -> None:
    """Say (rank 0) when the job runs on another number of processes than the config says."""
    if ctx.is_main and ctx.world_size != config.train.world_size:
        print(
            f"warning: running on {ctx.world_size} processes, train.nodes x train.nproc "
            f"is {config.train.world_size}",
            file=sys.stderr,
        )


def refuse_all_skipped(
    config: RunConfig, round_index: int, metrics: Sequence[Mapping[str, Any]], scores: str | Path
) -> None:
    """Refuse a round whose every optimizer step was skipped, unless allowed.

    Nothing was learnt, most likely from broken rewards (``scores``: where they are).
    """
    if all(row["skipped"] for row in metrics) and not config.train.allow_skipped_round:
        raise ckpt.NonFiniteError(
            f"round {round_index}: all {len(metrics)} optimizer step(s) were skipped (the "
            "loss or the gradient was not finite: check the rewards and advantages of "
            f"{scores}); no checkpoint written. train.allow_skipped_round: true writes the "
            "unchanged policy instead"
        )
