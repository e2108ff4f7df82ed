"""Retention: which files of a run stay, where each round's stage folders go, what a loss reruns.

A kept round (:func:`~jagg_pipeline.workflow.runs.kept_rounds`, ``workflow.keep_every``) holds
its checkpoint and rollout in ``round-<r>/``; the others hold them under
``round-<r>/transient/``, outputs of the workflow's ``*_transient`` rules, which Snakemake
deletes once no job needs them. Two rules, because which rounds are kept depends on the run
(its ``train.rounds`` and ``eval.every``) and a wildcard constraint cannot depend on another
wildcard. Also kept, whatever their round: a checkpoint an evaluation run names, and one that a
shorter run finished (its last round), so that a longer run continues from it instead of
retraining the rounds up to it. Every round keeps its scores and metric lines.

What a finished run keeps (:meth:`Retention.run_files`) is what its target asks for, so that
Snakemake remakes a deleted one; what it cannot ask for by name (a transient round's lost metric
lines, a block's lost files) is returned as the files to force (:meth:`Retention.lost_records`,
:meth:`Retention.lost_blocks`). Pure functions of the runs and of what is on disk, torch-free.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from jagg_pipeline.io.artifacts import ROUND_RECORDS, ROUND_STAGES
from jagg_pipeline.io.manifest import MANIFEST_NAME
from jagg_pipeline.workflow import layout
from jagg_pipeline.workflow.runs import Run


@functools.cache
def finished_checkpoint(folder: str) -> bool:
    """Whether ``folder`` holds a finished checkpoint (its manifest is written last).

    Asked once per folder and process: the workflow plans its DAG from what was there when it
    started.
    """
    return Path(folder, MANIFEST_NAME).is_file()


@dataclass(frozen=True)
class Retention:
    """The retention of a workflow's runs: its rules' paths of every round's stage folders.

    ``evaluated``: the checkpoint folders that evaluation runs name (normalised paths);
    ``finished``: whether a checkpoint folder is finished (default: its manifest is there).
    """

    evaluated: frozenset[str] = frozenset()
    finished: Callable[[str], bool] = field(default=finished_checkpoint, compare=False)

    @classmethod
    def of(cls, runs: Iterable[Run], **kwargs: Callable[[str], bool]) -> Retention:
        """The retention of ``runs``: the checkpoints their evaluation runs name stay."""
        evaluated = frozenset(
            os.path.normpath(run.policy)
            for run in runs
            if run.policy is not None and run.policy != "base"
        )
        return cls(evaluated, **kwargs)

    def kept(self, run: Run, round_index: int) -> bool:
        """Whether round ``round_index`` of ``run`` keeps its checkpoint and rollout."""
        if round_index in run.kept_rounds:
            return True
        named = os.path.normpath(f"{layout.round_folder(run.directory, round_index)}/checkpoint")
        return named in self.evaluated or self.finished(named)

    def checkpoint_dir(self, run: Run, round_index: int) -> str:
        """The checkpoint of training round ``round_index`` (kept or transient)."""
        kept = self.kept(run, round_index)
        return layout.stage_folder(run.directory, round_index, "checkpoint", kept)

    def rollout_dir(self, run: Run, round_index: int) -> str:
        """The rollout sampled in round ``round_index`` (kept or transient, as its checkpoint)."""
        kept = self.kept(run, round_index)
        return layout.stage_folder(run.directory, round_index, "rollout", kept)

    def policy(self, run: Run, trained: int) -> str:
        """``base`` before any training, else the checkpoint after ``trained`` rounds."""
        return "base" if trained == 0 else self.checkpoint_dir(run, trained - 1)

    def block_record(self, run: Run, block: range) -> str:
        """The record of ``block`` of ``run`` (:func:`.layout.block_record`)."""
        return layout.block_record(run.directory, block[-1], self.kept(run, block[-1]))

    def run_files(self, run: Run) -> list[str]:
        """What a finished run keeps, each by the path that only one of the rules makes.

        Every evaluation, every round's scores and metric lines, and the checkpoint and rollout
        of each kept round; with blocks of rounds, each block's record (it stands for what the
        block wrote, :meth:`lost_blocks`) and its last checkpoint when kept.
        """
        if run.blocks:
            files = [self.block_record(run, block) for block in run.blocks]
            return files + [
                self.checkpoint_dir(run, block[-1])
                for block in run.blocks
                if self.kept(run, block[-1])
            ]
        files = [layout.evaluation_folder(run.directory, n) for n in run.evaluated_rounds]
        if run.policy is not None:
            return files
        for round_index in range(run.config.train.rounds):
            folder = layout.round_folder(run.directory, round_index)
            files += [layout.scores_folder(run.directory, round_index)]
            files += [layout.round_record(folder, "score")]
            if self.kept(run, round_index):
                # The rules rollout and train write these records (their transient twins
                # could write them too: the rules' ruleorder picks the kept ones).
                files += [self.rollout_dir(run, round_index), self.checkpoint_dir(run, round_index)]
                files += [layout.round_record(folder, stage) for stage in ("rollout", "train")]
        return files

    def block_files(self, run: Run, block: range) -> list[str]:
        """What ``block`` of ``run`` writes besides its outputs.

        Every round's scores and metric lines, the kept rounds' rollouts and checkpoints, the
        block's evaluations.
        """
        files = []
        for round_index in block:
            folder = layout.round_folder(run.directory, round_index)
            files += [layout.scores_folder(run.directory, round_index)]
            files += [layout.round_record(folder, stage) for stage in ROUND_STAGES]
            if self.kept(run, round_index):
                files += [self.rollout_dir(run, round_index), self.checkpoint_dir(run, round_index)]
        files += [layout.evaluation_folder(run.directory, n) for n in run.block_evaluations(block)]
        return files

    def lost_records(self, run: Run) -> list[str]:
        """The transient stage folders of a finished run whose metric lines are lost.

        The job that writes a transient stage folder writes its lines too, so that folder is
        forced; its consumers rerun after it and Snakemake deletes it once they are done
        (a target that asked for it would keep it for good). Nothing for a run still going
        (its last round untrained), which writes them itself.
        """
        rounds = 0 if run.policy is not None or run.blocks else run.config.train.rounds
        if not rounds:
            return []

        def records(round_index: int) -> Path:
            return Path(layout.round_folder(run.directory, round_index), ROUND_RECORDS)

        if not (records(rounds - 1) / "train.jsonl").is_file():
            return []
        forced = []
        for round_index in range(rounds):
            if self.kept(run, round_index):
                continue
            if not (records(round_index) / "rollout.jsonl").is_file():
                forced.append(self.rollout_dir(run, round_index))
            if not (records(round_index) / "train.jsonl").is_file():
                forced.append(self.checkpoint_dir(run, round_index))
        return forced

    def lost_blocks(self, run: Run) -> list[str]:
        """The records of the finished blocks of ``run`` whose files are not all there.

        A record is what Snakemake knows of a block, and its content cannot say what was lost,
        so it is forced; the rerun resumes after the last complete checkpoint before the first
        lost file.
        """
        return [
            self.block_record(run, block)
            for block in run.blocks
            if Path(self.block_record(run, block)).is_file()
            and not all(Path(path).exists() for path in self.block_files(run, block))
        ]

    def block_written(self, runs: Iterable[Run]) -> dict[str, str]:
        """Checkpoints written inside a block (kept rounds, not its last) -> its record.

        The record is what an evaluation run that names such a checkpoint waits for.
        """
        return {
            os.path.normpath(self.checkpoint_dir(run, round_index)): self.block_record(run, block)
            for run in runs
            for block in run.blocks
            for round_index in block[:-1]
            if self.kept(run, round_index)
        }
