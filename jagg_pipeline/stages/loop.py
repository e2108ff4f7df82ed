"""Rounds of rollout -> score -> train in one process: the pipeline's loop without Snakemake.

For tests, benchmarks and notebooks (e.g. "does GRPO raise the toy world's held-out reward?"):
the same stage functions the commands run, chained through the same files, so what passes
here passes in the workflow. Round ``r`` lives in ``workdir/round-<r>/`` (``rollout/``,
``scores/``, ``checkpoint/``, and ``metrics/{rollout,score,train}.jsonl``: the copies of the
stage folders' metric lines that the workflow keeps too, which
:func:`jagg_pipeline.reports.summary.read_run` reads). As the workflow does by default
(``workflow.encode_prompts``), the training prompts are encoded once, into
``workdir/conditioning/`` (the encode stage), and every rollout reads their rows from there:
text encoders round a prompt's row with the shape of the batch it is encoded in, so encoding
inline would not give the workflow's bits. With ``evaluate_every`` the loop also runs the
evaluate stage's protocol (``eval`` section: fixed prompts and seeds, ODE sampling) on the base
policy and on the checkpoints it names, in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jagg_pipeline.io.artifacts import evaluated_rounds, keep_round_record, round_name

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig


@dataclass
class LoopRound:
    """One round: its files, the mean training reward of its rollout, and its timings.

    ``policy`` is what the rollout sampled from; ``checkpoint`` is None for the final rollout
    of the last policy (scored, not trained). ``update_seconds`` sums the train stage's
    forward / backward / optimizer seconds over the round's optimizer steps;
    ``round_seconds`` is the wall time of rollout + score + train, ``stage_seconds`` that of
    each stage (in this process: no start-up, the model loads). ``evaluation`` holds the
    mean of each ``eval.metrics`` reward for ``policy`` when this round was evaluated.
    """

    round: int
    policy: str
    rollouts: Path
    scores: Path
    checkpoint: Path | None
    reward_mean: float
    update_seconds: dict[str, float] = field(default_factory=dict)
    round_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, float] | None = None


def _scored_rollout(
    config: RunConfig,
    policy: str,
    directory: Path,
    round_index: int,
    progress: bool,
    seconds: dict[str, float],
    conditioning: Path | None,
) -> tuple[Path, Path, float]:
    from jagg_pipeline.stages.rollout import run_rollout
    from jagg_pipeline.stages.scoring import run_score

    rollouts, scores = directory / "rollout", directory / "scores"
    sampler = config.sampler
    start = time.perf_counter()
    run_rollout(
        config,
        policy,
        sampler.prompts,
        rollouts,
        round_index=round_index,
        column=sampler.prompt_column,
        progress=progress,
        conditioning=conditioning,
    )
    keep_round_record(rollouts, directory, "rollout")
    seconds["rollout"] = time.perf_counter() - start
    start = time.perf_counter()
    summary = run_score(config, rollouts, scores).summary
    keep_round_record(scores, directory, "score")
    seconds["score"] = time.perf_counter() - start
    return rollouts, scores, float(summary["total_mean"])


def evaluate_policy(config: RunConfig, policy: str | Path) -> dict[str, float]:
    """The mean of every ``eval.metrics`` reward for ``policy`` under the evaluate protocol."""
    from jagg_pipeline.stages.evaluate import evaluate
    from jagg_pipeline.stages.policy import load_policy

    backbone = load_policy(config, policy)
    evaluation = evaluate(config, backbone, progress=False)
    assert evaluation is not None  # one process: rank 0
    metrics = evaluation.metrics()["metrics"]
    return {name: values["mean"] for name, values in metrics.items()}


def _update_seconds(metrics: list[dict[str, Any]]) -> dict[str, float]:
    parts = ("forward", "backward", "optimizer")
    return {part: sum(row["time"][part] for row in metrics) for part in parts}


def run_rounds(
    config: RunConfig,
    workdir: str | Path,
    *,
    final_rollout: bool = True,
    evaluate_every: int = 0,
    on_round: Callable[[LoopRound], None] | None = None,
    progress: bool = False,
    encode_prompts: bool = True,
) -> list[LoopRound]:
    """Train ``train.rounds`` rounds from the base policy.

    The round count comes from the config only: the train stage's LR schedule spans
    ``train.rounds * train.minibatches`` optimizer steps, so a loop of another length would
    decay it wrongly.

    Each round samples a rollout from the current policy, scores it and trains on it; the
    checkpoint becomes the next round's policy. ``final_rollout`` adds one more scored rollout
    of the last checkpoint, so ``result[0].reward_mean`` (base policy) and
    ``result[-1].reward_mean`` (trained policy) compare the same kind of sample.
    ``evaluate_every`` K > 0 evaluates the policy of rounds 0, K, 2K, ... and of the last
    round (its ``LoopRound.evaluation``); ``on_round`` sees each round as it completes.
    ``encode_prompts``: the training prompts encoded once, before round 0 (False: each
    rollout encodes its prompts inline, as ``workflow.encode_prompts: false``).
    """
    from jagg_pipeline.stages.encode import run_encode
    from jagg_pipeline.stages.train import train_round

    workdir = Path(workdir)
    conditioning = None
    if encode_prompts:
        conditioning = workdir / "conditioning"
        sampler = config.sampler
        run_encode(
            config, sampler.prompts, conditioning, column=sampler.prompt_column, progress=progress
        )
    count = config.train.rounds
    policy = "base"
    results = []
    total = count + int(final_rollout)
    # The rounds the workflow would evaluate, the last being the final rollout's policy if any.
    evaluated = set(evaluated_rounds(total - 1, evaluate_every)) if evaluate_every > 0 else set()
    for round_index in range(total):
        directory = workdir / round_name(round_index)
        checkpoint = directory / "checkpoint"
        start = time.perf_counter()
        stages: dict[str, float] = {}
        rollouts, scores, reward = _scored_rollout(
            config, policy, directory, round_index, progress, stages, conditioning
        )
        trained = round_index < count
        update: dict[str, float] = {}
        if trained:
            train_start = time.perf_counter()
            result = train_round(config, policy, rollouts, scores, checkpoint, progress=progress)
            keep_round_record(checkpoint, directory, "train")
            stages["train"] = time.perf_counter() - train_start
            update = _update_seconds(result.metrics)
        done = LoopRound(
            round_index,
            policy,
            rollouts,
            scores,
            checkpoint if trained else None,
            reward,
            update,
            time.perf_counter() - start,
            stages,
        )
        if round_index in evaluated:
            done.evaluation = evaluate_policy(config, policy)
        results.append(done)
        if on_round is not None:
            on_round(done)
        policy = str(checkpoint)
    return results
