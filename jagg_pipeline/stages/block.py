"""A block of rounds: consecutive GRPO rounds of one run in one process group, resident.

Owns :func:`run_block`, what a block job of the workflow (``workflow.rounds_per_job`` K > 1)
runs on every rank: rounds ``first .. last`` of one run, each sample -> score -> train, with
the policy (FSDP2-sharded, sampling on every rank as the rollout stage does), the reward
models, the VAE and the optimizer loaded once. A round's rollout and scores pass in memory:
every rank's shard of the rollout is all-gathered (images to rank 0 only, which scores them
with the resident reward models) and the score table's rows are broadcast, so each rank
trains on the samples it would have read from the files. The trainer's state (weights,
optimizer, schedule, generator, EMA, routing) simply carries on from round to round.

It writes what the single-round jobs write, where they write it (the paths come from the
caller, :class:`BlockOutputs`): every round's score folder and metric lines
(``round-<r>/metrics/{rollout,score,train}.jsonl``), the rollout folder and checkpoint of the
rounds the caller keeps, always the checkpoint of the block's last round (the next block's
policy), and the evaluations of the policies after the rounds it names, in this process;
then the block's record, last. Rounds equal K single-round jobs bit for bit: the in-memory
handoff gives training the very tensors and rows the files would (tests compare final
checkpoints byte for byte and the metric lines).

A rerun after a kill resumes after the last checkpoint written inside the block whose
earlier rounds and evaluations are complete (each an output with its manifest, made under
this config), else from the block's input policy: loading a checkpoint continues a run
exactly, so the result is that of an uninterrupted block.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.io.artifacts import (
    BASE,
    atomic_write_json,
    keep_round_record,
    policy_weights_dir,
    write_round_record,
)
from jagg_pipeline.io.manifest import READS, ManifestError, check_made, stage_inputs
from jagg_pipeline.io.trajectories import TrajectoryBatch, concatenate
from jagg_pipeline.support.startup import StageClock

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

STAGE = "block"


@dataclass(frozen=True)
class RoundOutputs:
    """Where round ``r`` of a block writes.

    ``folder``: ``round-<r>/`` (its metric lines); ``scores``: its score folder;
    ``rollout``: its rollout folder when kept (None: the rollout stays in memory);
    ``checkpoint``: its checkpoint when written (a kept round, the block's last), else None;
    ``policy_name``: how later outputs name the policy this round trains (its checkpoint's
    path in single-round jobs, written or not).
    """

    folder: Path
    scores: Path
    rollout: Path | None
    checkpoint: Path | None
    policy_name: str


@dataclass(frozen=True)
class BlockOutputs:
    """Every path a block writes: its rounds in order, its evaluations, its record.

    ``evaluations``: rounds trained -> the evaluation folder of the policy after them (each
    between ``first`` and ``last + 1``).
    """

    rounds: dict[int, RoundOutputs]
    evaluations: dict[int, Path]
    record: Path

    @property
    def first(self) -> int:
        return min(self.rounds)

    @property
    def last(self) -> int:
        return max(self.rounds)


def _complete(path: Path | None, stage: str, config: RunConfig) -> bool:
    """Whether ``path`` is a finished ``stage`` output made under this config."""
    if path is None:
        return True
    try:
        # Everything the stage that made it read: a block of an extended run resumes after
        # the rounds it trained before.
        check_made(path, stage=stage, config=config, sections=(READS,))
    except (ManifestError, OSError):
        return False
    return True


def _round_complete(outputs: RoundOutputs, config: RunConfig) -> bool:
    from jagg_pipeline.io.artifacts import ROUND_STAGES, round_record

    records = all(round_record(outputs.folder, stage).is_file() for stage in ROUND_STAGES)
    return (
        records
        and _complete(outputs.scores, "score", config)
        and _complete(outputs.rollout, "rollout", config)
        and _complete(outputs.checkpoint, "train", config)
    )


def resume_point(config: RunConfig, outputs: BlockOutputs, policy: str | Path) -> tuple[int, str]:
    """Where a block starts: (first round to run, its policy).

    After the last checkpoint written inside the block whose rounds before it, and the
    evaluations of the policies before it, are complete; else the block's first round from
    ``policy``. All rounds complete: (``last + 1``, the last checkpoint).
    """
    start, current = outputs.first, str(policy)
    for round_index, round_outputs in outputs.rounds.items():
        evaluation = outputs.evaluations.get(round_index)
        if not _complete(evaluation, "evaluate", config):
            break
        if not _round_complete(round_outputs, config):
            break
        if round_outputs.checkpoint is not None:
            start, current = round_index + 1, str(round_outputs.checkpoint)
    return start, current


def gather_rollout(shard: TrajectoryBatch, world_size: int) -> TrajectoryBatch:
    """The whole rollout on every rank, in sample order, from every rank's shard.

    The images go to rank 0 only (the one that scores them); the other ranks' batch has
    none. One rank: ``shard`` in sample order.
    """
    from jagg_pipeline.stages.distributed import all_gather_object, gather_object, is_main

    if world_size == 1:
        return shard.select(torch.argsort(shard.sample_ids))
    parts = all_gather_object(dataclasses.replace(shard, images=None))
    images = gather_object(shard.images)
    batch = concatenate(parts)
    if is_main():
        batch = dataclasses.replace(batch, images=torch.cat(images))
    return batch.select(torch.argsort(batch.sample_ids))


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Block:
    """A block's resident state on one rank, and how it writes what single rounds write."""

    def __init__(
        self,
        config: RunConfig,
        ctx: Any,
        outputs: BlockOutputs,
        policy: str,
        sources: Mapping[str, Any],
        progress: bool,
    ) -> None:
        from jagg_pipeline.stages.checkpoint import read_trainer_state
        from jagg_pipeline.stages.evaluate import metric_models
        from jagg_pipeline.stages.policy import load_sharded_policy
        from jagg_pipeline.stages.scoring import reward_models
        from jagg_pipeline.stages.train import Trainer, verify_training_reads

        self.config, self.ctx, self.outputs = config, ctx, outputs
        self.sources, self.progress = sources, progress and ctx.is_main
        inline = any(source is None for source in sources.values())
        # A damaged checkpoint to resume from is refused before any model loads.
        verify_training_reads(config, policy)
        backbone = load_sharded_policy(config, policy, ctx, text_encoders=inline, verified=True)
        previous = None if policy == BASE else read_trainer_state(policy)
        self.trainer = Trainer(config, ctx, policy, previous, backbone=backbone)
        self.backbone = backbone
        # The policy as the next output names it, and as a folder when it is one on disk.
        self.policy_name, self.policy_folder = policy, None if policy == BASE else policy
        self.rewards = self.metrics = None
        if ctx.is_main:
            device = config.rewards.resolve_device(str(ctx.device))
            self.rewards = reward_models(config, device)
            if outputs.evaluations:
                self.metrics = metric_models(config, ctx.device)

    def _inputs(self) -> dict[str, Path]:
        """The policy as a manifest input: its weights when on disk (none in memory)."""
        folder = self.policy_folder
        return {} if folder is None else {"policy": policy_weights_dir(folder)}

    def evaluate(self, trained: int, out: Path, plan: Any) -> float:
        """Evaluate the current policy (after ``trained`` rounds) into ``out``; seconds."""
        from jagg_pipeline.stages.distributed import barrier
        from jagg_pipeline.stages.encode import conditioning_inputs
        from jagg_pipeline.stages.evaluate import evaluate, write_evaluation_output

        config, ctx = self.config, self.ctx
        start = time.perf_counter()
        clock = StageClock()
        self.backbone.use_precomputed(self.sources["evaluate"])
        evaluation = evaluate(
            config,
            self.backbone,
            self.progress,
            clock,
            plan,
            ctx.rank,
            ctx.world_size,
            metrics=self.metrics,
        )
        if evaluation is not None:
            prompts = stage_inputs(config.eval.prompts, BASE)
            write_evaluation_output(
                config,
                out,
                evaluation,
                policy=self.policy_name,
                trained=trained,
                inputs=prompts
                | self._inputs()
                | conditioning_inputs(self.conditioning("evaluate")),
                time=clock.record(),
            )
        barrier()
        return time.perf_counter() - start

    def conditioning(self, stage: str) -> Path | None:
        """The encode stage's folder ``stage`` reads its prompts' rows from (None: inline)."""
        source = self.sources[stage]
        return None if source is None else source.directory

    def round(self, round_index: int, pool: Sequence[str], prompts: str) -> float:
        """Sample, score and train round ``round_index``; write its files; its seconds."""
        from jagg_pipeline.io.artifacts import metrics_record
        from jagg_pipeline.stages import checkpoint as ckpt
        from jagg_pipeline.stages.distributed import broadcast_object
        from jagg_pipeline.stages.encode import conditioning_inputs
        from jagg_pipeline.stages.rollout import (
            begin_rollout,
            finish_rollout,
            plan_rollout,
            rollout_metrics,
            sample_rollout,
        )
        from jagg_pipeline.stages.scoring import score_rollout, write_scores
        from jagg_pipeline.stages.train import (
            deterministic,
            refuse_all_skipped,
            save_round,
            scored_round,
        )

        config, ctx = self.config, self.ctx
        outputs = self.outputs.rounds[round_index]
        start = time.perf_counter()
        clock = StageClock()
        # Sample: the rollout stage's plan and sharded sampling, kept when asked.
        self.backbone.use_precomputed(self.sources["rollout"])
        plan = plan_rollout(config, pool, round_index)
        if outputs.rollout is not None:
            begin_rollout(outputs.rollout, ctx.rank)
        shard = sample_rollout(self.backbone, plan, ctx.rank, ctx.world_size, self.progress)
        clock.lap("work")
        sampled = rollout_metrics(plan, shard, time.perf_counter() - start, clock.record())
        rollout_inputs = (
            stage_inputs(prompts, BASE)
            | self._inputs()
            | conditioning_inputs(self.conditioning("rollout"))
        )
        if outputs.rollout is not None:
            finish_rollout(
                config,
                outputs.rollout,
                shard,
                plan,
                sampled,
                rank=ctx.rank,
                world_size=ctx.world_size,
                round_index=round_index,
                inputs=rollout_inputs,
                sources={"policy": self.policy_name, "prompts": prompts},
            )
        batch = gather_rollout(shard, ctx.world_size)
        del shard
        # Score: rank 0, with the resident reward models; the rows go to every rank.
        rows = None
        if ctx.is_main:
            if outputs.rollout is not None:
                keep_round_record(outputs.rollout, outputs.folder, "rollout")
            else:
                record = metrics_record("rollout", round_index, 0, sampled)
                write_round_record(outputs.folder, "rollout", [record])
            score_start = time.perf_counter()
            scores = score_rollout(batch, self.rewards, config.advantage)
            rollout_folder = {} if outputs.rollout is None else {"rollouts": outputs.rollout}
            write_scores(
                config,
                outputs.scores,
                scores,
                round_index=round_index,
                seeds={"train": config.train.seed, "round": round_index},
                inputs=rollout_folder,
                time={"work": time.perf_counter() - score_start},
            )
            keep_round_record(outputs.scores, outputs.folder, "score")
            rows = scores.rows
        rows = broadcast_object(rows)
        batch = dataclasses.replace(batch, images=None)
        # Train: the resident trainer carries on; a checkpoint when the round keeps one.
        micro_batches = [list(samples) for samples in plan.micro_batches]
        data = scored_round(config, batch, rows, micro_batches, round_index)
        # Deterministic kernels for training only, as the train stage (not the rollout) has.
        with deterministic():
            metrics, routing = self.trainer.train(data, StageClock(), self.progress)
        refuse_all_skipped(config, round_index, metrics, outputs.scores)
        if outputs.checkpoint is not None:
            inputs = {"scores": outputs.scores} | self._inputs()
            if outputs.rollout is not None:
                inputs["rollouts"] = outputs.rollout
            contents = self.trainer.contents(round_index, routing, metrics)
            save_round(self.trainer, contents, outputs.checkpoint, self.policy_name, inputs)
            if ctx.is_main:
                keep_round_record(outputs.checkpoint, outputs.folder, "train")
        elif ctx.is_main:
            write_round_record(outputs.folder, "train", ckpt.metrics_records(metrics))
        self.policy_name = outputs.policy_name
        self.policy_folder = outputs.checkpoint
        return time.perf_counter() - start


def run_block(
    config: RunConfig,
    policy: str | Path,
    outputs: BlockOutputs,
    *,
    prompts: str,
    column: str | None = None,
    conditioning: str | Path | None = None,
    eval_conditioning: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the block's rounds (from its resume point) and write its files; returns the record.

    ``policy``: ``base`` or the checkpoint after ``outputs.first`` rounds; ``prompts`` /
    ``column``: the training prompt pool (``sampler.prompts``); ``conditioning`` /
    ``eval_conditioning``: the encode stage's folders of the training and the evaluation
    prompts (None: encoded inline). Every rank of a ``torchrun`` job calls this; rank 0
    writes the record, last.
    """
    clock = StageClock.start()
    from jagg_pipeline import __version__
    from jagg_pipeline.config.fields import digest, to_dict
    from jagg_pipeline.io.prompts import resolve_prompts
    from jagg_pipeline.stages.distributed import barrier, broadcast_object, distributed
    from jagg_pipeline.stages.encode import open_pool
    from jagg_pipeline.stages.evaluate import plan_evaluation
    from jagg_pipeline.stages.train import warn_world_size

    pool = resolve_prompts(prompts, column)
    eval_plan = plan_evaluation(config) if outputs.evaluations else None
    sources = {
        "rollout": open_pool(config, conditioning),
        "evaluate": open_pool(config, eval_conditioning),
    }
    with distributed(config.backbone.device) as ctx:
        # Rank 0 decides where to resume, so every rank starts from the same round.
        start, current = broadcast_object(
            resume_point(config, outputs, policy) if ctx.is_main else None
        )
        warn_world_size(config, ctx)
        if ctx.is_main and start > outputs.first:
            _say(f"block {outputs.first}-{outputs.last}: resuming at round {start} from {current}")
        block = _Block(config, ctx, outputs, current, sources, progress)
        clock.lap("load")
        seconds: dict[str, dict[int, float]] = {"rounds": {}, "evaluations": {}}
        for trained in range(start, outputs.last + 2):
            evaluation = outputs.evaluations.get(trained)
            # (A resumed block's first evaluation may be done already.)
            if evaluation is not None and not _complete(evaluation, "evaluate", config):
                seconds["evaluations"][trained] = block.evaluate(trained, evaluation, eval_plan)
            if trained > outputs.last:
                break
            seconds["rounds"][trained] = block.round(trained, pool, str(prompts))
            if ctx.is_main:
                _say(
                    f"block {outputs.first}-{outputs.last}: round {trained} done in "
                    f"{seconds['rounds'][trained]:.1f} s"
                )
        clock.lap("work")
        record = {
            "stage": STAGE,
            "version": __version__,
            "config_digest": digest(to_dict(config)),
            "seeds": {"train": config.train.seed},
            "rounds": [outputs.first, outputs.last],
            "resumed_at": start,
            "world_size": ctx.world_size,
            "time": clock.record(),
            "seconds": seconds,
        }
        if ctx.is_main:
            atomic_write_json(outputs.record, record)
        barrier()
    return record
