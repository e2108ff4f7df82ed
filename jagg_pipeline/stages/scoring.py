"""The score stage on a rollout: every configured reward on its images, totals and advantages.

Owns the score folder that the training stage reads: ``scores.parquet``, one row per sample in
:func:`~jagg_pipeline.io.trajectories.load_rollout` order with the columns ``sample`` (0..B-1),
``prompt_id``, ``group``, one per weighted reward, ``total`` (weighted sum), ``advantage``,
``group_mean`` and ``group_std`` (of the total in the sample's group); ``summary.json`` (reward
means, zero-std groups); ``metrics.jsonl`` (the summary's scalars as one flat line);
``config.yaml`` and ``manifest.json`` (stage ``score``, input ``rollouts``), written last.
Rewards score the rollout's stored uint8 images, read ``chunk`` samples at a time and nothing
else of the rollout (no latents, velocities or conditioning): the stage holds one chunk of
images and the scores, whatever the rollout's size. The advantage follows the ``advantage``
section (std mode, eps, clip) and ``rewards.normalize_separately``. The stage reads the
``rewards`` and ``advantage`` sections (:data:`~jagg_pipeline.io.manifest.STAGE_SECTIONS`): the
train stage checks exactly these against its own config.
Scoring a folder of images (``score-images``) lives in :mod:`jagg_pipeline.stages.score_images`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.core.grpo import group_advantages
from jagg_pipeline.io.artifacts import METRICS_NAME, append_metrics, atomic_write_json
from jagg_pipeline.io.manifest import CHECKED_SECTIONS, begin_output, check_input, finish_output
from jagg_pipeline.io.tables import write_table
from jagg_pipeline.io.trajectories import RolloutReader, TrajectoryBatch
from jagg_pipeline.rewards import MultiReward, RewardFn, to_unit_float
from jagg_pipeline.support.startup import StageClock

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

STAGE = "score"


@dataclass
class Scores:
    """The table rows and the summary of one scored rollout."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]


TABLE_NAME = "scores.parquet"
SUMMARY_NAME = "summary.json"


def table_path(folder: str | Path) -> Path:
    """The per-sample table of a score folder."""
    return Path(folder) / TABLE_NAME


def _chunk_columns(
    rewards: Mapping[str, RewardFn], chunks: Iterable[tuple[torch.Tensor, Sequence[str]]]
) -> dict[str, torch.Tensor]:
    """Each reward's scores of ``(uint8 images [b, 3, H, W], prompts)`` chunks, concatenated.

    Only one chunk is held (and as float) at once: real images are large. Scores come back on
    the CPU.
    """
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in rewards}
    for images, prompts in chunks:
        floats = to_unit_float(images)
        for name, reward in rewards.items():
            parts[name].append(reward(floats, prompts).cpu())
    return {name: torch.cat(values) for name, values in parts.items()}


def reward_columns(
    rewards: Mapping[str, RewardFn], images: torch.Tensor, prompts: Sequence[str], chunk: int
) -> dict[str, torch.Tensor]:
    """Each reward's scores of uint8 ``images`` [B, 3, H, W] in memory, ``chunk`` at a time."""
    starts = range(0, images.shape[0], chunk)
    return _chunk_columns(
        rewards, ((images[i : i + chunk], prompts[i : i + chunk]) for i in starts)
    )


def score_rollout(
    rollout: RolloutReader | TrajectoryBatch, reward: MultiReward, advantage: Any, chunk: int = 32
) -> Scores:
    """Score the rollout's images against their prompts, ``chunk`` images at a time.

    ``rollout``: a rollout folder (its images read chunk by chunk) or a batch in memory with
    its images (a block of rounds). ``advantage`` is the config section whose std mode, eps
    and clip give the group statistics.
    """
    prompts = [rollout.prompts[i] for i in rollout.prompt_ids.tolist()]
    size = len(rollout)
    if isinstance(rollout, TrajectoryBatch):
        images = rollout.images
        if images is None:
            raise ValueError("the rollout batch holds no images to score")

        def read(samples: range) -> torch.Tensor:
            return images[samples.start : samples.stop]
    else:
        read = rollout.images
    chunks = (
        (read(range(i, min(i + chunk, size))), prompts[i : i + chunk])
        for i in range(0, size, chunk)
    )
    columns = _chunk_columns(reward.rewards, chunks)
    result = reward.combine(columns, rollout.group_ids)
    stats = group_advantages(
        result.total,
        rollout.group_ids,
        std_mode=advantage.std_mode,
        eps=advantage.eps,
        clip=advantage.clip,
    )
    rows = [
        {
            "sample": i,
            "prompt_id": int(rollout.prompt_ids[i]),
            "group": int(rollout.group_ids[i]),
            **{name: float(values[i]) for name, values in result.columns.items()},
            "total": float(result.total[i]),
            "advantage": float(result.advantages[i]),
            "group_mean": float(stats.group_mean[i]),
            "group_std": float(stats.group_std[i]),
        }
        for i in range(size)
    ]
    summary = {
        "samples": size,
        "groups": len(torch.unique(rollout.group_ids)),
        "zero_std_groups": stats.zero_std_groups,
        "weights": dict(reward.weights),
        "reward_means": {name: float(v.mean()) for name, v in result.columns.items()},
        "total_mean": float(result.total.mean()),
        "total_std": float(result.total.std(unbiased=False)),
    }
    return Scores(rows, summary)


def _flat_summary(scores: Scores) -> dict[str, float]:
    summary = scores.summary
    return {
        "total_mean": summary["total_mean"],
        "total_std": summary["total_std"],
        "zero_std_groups": summary["zero_std_groups"],
        **{f"reward_{name}": value for name, value in summary["reward_means"].items()},
    }


def run_score(
    config: RunConfig,
    rollouts: str | Path,
    out: str | Path,
    *,
    device: str | torch.device | None = None,
    chunk: int = 32,
) -> Scores:
    """The score stage: refuse rollouts of another backbone/sampler section, score, write.

    The reward models run on ``device`` (None: the config's ``rewards.device``, else
    ``backbone.device``). Writes the folder ``out`` (table, summary, metrics, resolved config,
    manifest last); returns what it wrote.
    """
    clock = StageClock.start()
    rollouts, out = Path(rollouts), Path(out)
    made = check_input(
        rollouts, stage="rollout", config=config, sections=CHECKED_SECTIONS["rollout"]
    )
    rollout = RolloutReader(rollouts)
    reward = reward_models(config, device)
    clock.lap("load")
    scores = score_rollout(rollout, reward, config.advantage, chunk)
    clock.lap("work")
    write_scores(
        config,
        out,
        scores,
        round_index=made.get("seeds", {}).get("round", 0),
        seeds=made.get("seeds", {}),
        inputs={"rollouts": rollouts},
        time=clock.record(),
    )
    return scores


def reward_models(config: RunConfig, device: str | torch.device | None = None) -> MultiReward:
    """The weighted rewards of ``config.rewards``, with the ``advantage`` group statistics.

    On ``device`` (None: ``rewards.device``, else ``backbone.device``).
    """
    if device is None:
        device = config.rewards.resolve_device(config.backbone.device)
    return MultiReward.from_spec(
        config.rewards,
        device,
        std_mode=config.advantage.std_mode,
        eps=config.advantage.eps,
        clip=config.advantage.clip,
    )


def write_scores(
    config: RunConfig,
    out: str | Path,
    scores: Scores,
    *,
    round_index: int,
    seeds: Mapping[str, Any],
    inputs: Mapping[str, Path],
    time: Mapping[str, float],
) -> Path:
    """Write a score folder: table, summary, metric line, resolved config, manifest last."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    begin_output(out, [METRICS_NAME])
    write_table(table_path(out), scores.rows)
    atomic_write_json(out / SUMMARY_NAME, scores.summary)
    metrics = _flat_summary(scores) | {"time": dict(time)}
    append_metrics(out, STAGE, round_index, 0, metrics)
    finish_output(
        out,
        config,
        stage=STAGE,
        seeds=seeds,
        inputs=inputs,
        extra={"rows": len(scores.rows)},
    )
    return out
