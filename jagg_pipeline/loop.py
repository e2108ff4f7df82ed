"""Rounds of rollout -> score -> train in one process: the pipeline's loop without Snakemake.

For tests and notebooks (e.g. "does GRPO raise the toy world's reward?"): the same stage
functions the commands run, chained through the same files, so what passes here passes in the
workflow. Round ``r`` lives in ``workdir/round-<r>/`` (``rollout/``, ``scores.parquet``,
``checkpoint/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LoopRound:
    """One round's files and the mean training reward of its rollout.

    ``checkpoint`` is None for the final rollout of the last policy (scored, not trained).
    """

    round: int
    policy: str
    rollouts: Path
    scores: Path
    checkpoint: Path | None
    reward_mean: float


def _scored_rollout(
    config: Any, policy: str, prompts: str | Path, directory: Path, round_index: int, progress
) -> tuple[Path, Path, float]:
    from jagg_pipeline.rollout import run_rollout
    from jagg_pipeline.scoring import run_score

    rollouts, scores = directory / "rollout", directory / "scores.parquet"
    run_rollout(config, policy, prompts, rollouts, round_index=round_index, progress=progress)
    summary = run_score(config, rollouts, scores, device=config.backbone.device).summary
    return rollouts, scores, float(summary["total_mean"])


def run_rounds(
    config: Any,
    workdir: str | Path,
    *,
    rounds: int | None = None,
    prompts: str | Path = "toy:train",
    final_rollout: bool = True,
    progress: bool = False,
) -> list[LoopRound]:
    """Train ``rounds`` rounds (default ``train.rounds``) from the base policy.

    Each round samples a rollout from the current policy, scores it and trains on it; the
    checkpoint becomes the next round's policy. ``final_rollout`` adds one more scored rollout
    of the last checkpoint, so ``result[0].reward_mean`` (base policy) and
    ``result[-1].reward_mean`` (trained policy) compare the same kind of sample.
    """
    from jagg_pipeline.train import train_round

    workdir = Path(workdir)
    count = config.train.rounds if rounds is None else rounds
    policy = "base"
    results = []
    for round_index in range(count + int(final_rollout)):
        directory = workdir / f"round-{round_index:04d}"
        checkpoint = directory / "checkpoint"
        rollouts, scores, reward = _scored_rollout(
            config, policy, prompts, directory, round_index, progress
        )
        trained = round_index < count
        if trained:
            train_round(config, policy, rollouts, scores, checkpoint, progress=progress)
        results.append(
            LoopRound(
                round_index, policy, rollouts, scores, checkpoint if trained else None, reward
            )
        )
        policy = str(checkpoint)
    return results
