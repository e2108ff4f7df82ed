"""A run of the workflow and its rounds: which are evaluated, which keep their files, its blocks.

A :class:`Run` is one (target, variant, seed) with its fully resolved
:class:`~jagg_pipeline.config.run.RunConfig` (made by :mod:`jagg_pipeline.workflow.experiments`).
Its rounds are evaluated every ``eval.every``
(:func:`~jagg_pipeline.io.artifacts.evaluated_rounds`), keep their checkpoint and rollout every
``workflow.keep_every`` (:func:`kept_rounds`) and run in blocks of ``workflow.rounds_per_job``
(:func:`blocks`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.io.artifacts import evaluated_rounds
from jagg_pipeline.workflow import layout


@dataclass(frozen=True)
class Run:
    """One (target, variant, seed) with its resolved config and where it lives.

    ``policy``: for an evaluation run, what it evaluates (``base`` or a checkpoint folder);
    None for a training run, which evaluates its own rounds. ``keep_every``:
    ``workflow.keep_every`` (which rounds keep their checkpoint and rollout);
    ``rounds_per_job``: ``workflow.rounds_per_job`` (its blocks of rounds).
    """

    experiment: str
    variant: str
    seed: int
    config: RunConfig
    overrides: dict[str, Any]
    directory: str
    policy: str | None = None
    keep_every: int | None = None
    rounds_per_job: int = 1

    @property
    def run_id(self) -> str:
        """``experiment/variant/seed-s``: stable, unique, the run's folder below results."""
        return layout.run_id(self.experiment, self.variant, self.seed)

    @property
    def evaluated_rounds(self) -> list[int]:
        """Rounds trained before each evaluation (an evaluation run: only its policy, as 0)."""
        if self.policy is not None:
            return [0]
        return evaluated_rounds(self.config.train.rounds, self.config.eval.every)

    @property
    def kept_rounds(self) -> list[int]:
        """Training rounds whose checkpoint and rollout stay on disk (:func:`kept_rounds`)."""
        return [] if self.policy is not None else kept_rounds(self.config, self.keep_every)

    @property
    def blocks(self) -> list[range]:
        """The rounds of each block job, in order, ``workflow.rounds_per_job`` each.

        None when each round runs as its own jobs (``rounds_per_job`` 1) and for an
        evaluation run. See :func:`blocks`.
        """
        if self.policy is not None or self.rounds_per_job == 1:
            return []
        return blocks(self.config.train.rounds, self.rounds_per_job)

    def block_evaluations(self, block: range) -> list[int]:
        """The evaluations a block runs, as rounds trained before each.

        ``n`` past the block's first round up to its end (the policy it starts from is its
        predecessor's last), and the base policy (0) in the first block.
        """
        first = block.start
        return [n for n in self.evaluated_rounds if first < n <= block.stop or n == first == 0]


def kept_rounds(config: RunConfig, keep_every: int | None) -> list[int]:
    """Training rounds whose checkpoint and rollout a run keeps (``workflow.keep_every``).

    None keeps every round. Else round ``r`` is kept when ``(r + 1) % keep_every == 0``, when
    it is the last round, and when its checkpoint is evaluated (``eval/trained-<r + 1>``);
    the workflow deletes the other rounds' checkpoints and rollouts once the next round no
    longer needs them.
    """
    rounds = config.train.rounds
    if keep_every is None:
        return list(range(rounds))
    kept = {r for r in range(rounds) if (r + 1) % keep_every == 0}
    kept |= {n - 1 for n in evaluated_rounds(rounds, config.eval.every) if n > 0}
    return sorted(kept | {rounds - 1})


def blocks(rounds: int, rounds_per_job: int) -> list[range]:
    """Rounds ``0 .. rounds - 1`` in consecutive blocks of ``rounds_per_job``.

    The last block is shorter when ``rounds_per_job`` does not divide ``rounds``.
    """
    return [
        range(first, min(first + rounds_per_job, rounds))
        for first in range(0, rounds, rounds_per_job)
    ]


def dag_recursion_limit(runs: Iterable[Run]) -> int:
    """A Python recursion limit under which Snakemake can build the DAG of ``runs``.

    Snakemake's ``DAG.update`` recurses a couple of frames per job along the longest chain
    of dependent jobs; a run's chain is one train (or block) job per round (per block). 1000
    rounds of single-round jobs needed 2100 (measured); this leaves room: 1000 + 4 per link.
    """
    longest = max(
        (len(run.blocks) or run.config.train.rounds for run in runs),
        default=0,
    )
    return 1000 + 4 * longest
