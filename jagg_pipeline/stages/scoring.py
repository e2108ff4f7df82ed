"""The score stage on a rollout: every configured reward on its images, totals and advantages.

Owns the score folder that the training stage reads: ``scores.parquet``, one row per sample in
:func:`~jagg_pipeline.io.trajectories.load_rollout` order with the columns ``sample`` (0..B-1),
``prompt_id``, ``group``, one per weighted reward, ``total`` (weighted sum), ``advantage``,
``group_mean`` and ``group_std`` (of the total in the sample's group); ``summary.json`` (reward
means, zero-std groups); ``metrics.jsonl`` (the summary's scalars as one flat line);
``config.yaml`` and ``manifest.json`` (stage ``score``, input ``rollouts``), written last.
Rewards score the rollout's stored uint8 images; the advantage follows the ``advantage``
section (std mode, eps, clip) and ``rewards.normalize_separately``. The stage reads the
``rewards`` and ``advantage`` sections (:data:`~jagg_pipeline.io.manifest.STAGE_SECTIONS`): the
train stage checks exactly these against its own config.
Scoring a folder of images (``score-images``) lives in :mod:`jagg_pipeline.stages.score_images`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jagg_pipeline.core.grpo import group_advantages
from jagg_pipeline.io.artifacts import METRICS_NAME, append_metrics, atomic_write_json
from jagg_pipeline.io.manifest import CHECKED_SECTIONS, begin_output, check_input, finish_output
from jagg_pipeline.io.tables import write_table
from jagg_pipeline.io.trajectories import TrajectoryBatch, load_rollout
from jagg_pipeline.rewards import MultiReward, RewardFn, to_unit_float
from jagg_pipeline.support.startup import StageClock

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


def reward_columns(
    rewards: Mapping[str, RewardFn], images: torch.Tensor, prompts: Sequence[str], chunk: int
) -> dict[str, torch.Tensor]:
    """Each reward's scores of uint8 ``images`` [B, 3, H, W], converted ``chunk`` at a time.

    Only a chunk is held as float at once (real images are large); scores come back on the CPU.
    """
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in rewards}
    for start in range(0, images.shape[0], chunk):
        floats = to_unit_float(images[start : start + chunk])
        for name, reward in rewards.items():
            parts[name].append(reward(floats, prompts[start : start + chunk]).cpu())
    return {name: torch.cat(values) for name, values in parts.items()}


def score_rollout(
    batch: TrajectoryBatch, reward: MultiReward, advantage: Any, chunk: int = 32
) -> Scores:
    """Score ``batch.images`` against their prompts, ``chunk`` images at a time.

    ``advantage`` is the config section whose std mode, eps and clip give the group statistics.
    """
    if batch.images is None:
        raise ValueError("the rollout holds no images to score")
    prompts = [batch.prompts[i] for i in batch.prompt_ids.tolist()]
    columns = reward_columns(reward.rewards, batch.images, prompts, chunk)
    result = reward.combine(columns, batch.group_ids)
    stats = group_advantages(
        result.total,
        batch.group_ids,
        std_mode=advantage.std_mode,
        eps=advantage.eps,
        clip=advantage.clip,
    )
    rows = [
        {
            "sample": i,
            "prompt_id": int(batch.prompt_ids[i]),
            "group": int(batch.group_ids[i]),
            **{name: float(values[i]) for name, values in result.columns.items()},
            "total": float(result.total[i]),
            "advantage": float(result.advantages[i]),
            "group_mean": float(stats.group_mean[i]),
            "group_std": float(stats.group_std[i]),
        }
        for i in range(len(batch))
    ]
    summary = {
        "samples": len(batch),
        "groups": len(torch.unique(batch.group_ids)),
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
    config: Any,
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
    batch = load_rollout(rollouts)
    if device is None:
        device = config.rewards.resolve_device(config.backbone.device)
    reward = MultiReward.from_spec(
        config.rewards,
        device,
        std_mode=config.advantage.std_mode,
        eps=config.advantage.eps,
        clip=config.advantage.clip,
    )
    clock.lap("load")
    scores = score_rollout(batch, reward, config.advantage, chunk)
    clock.lap("work")
    out.mkdir(parents=True, exist_ok=True)
    begin_output(out, [METRICS_NAME])
    write_table(table_path(out), scores.rows)
    atomic_write_json(out / SUMMARY_NAME, scores.summary)
    metrics = _flat_summary(scores) | {"time": clock.record()}
    append_metrics(out, STAGE, made.get("seeds", {}).get("round", 0), 0, metrics)
    finish_output(
        out,
        config,
        stage=STAGE,
        seeds=made.get("seeds", {}),
        inputs={"rollouts": rollouts},
        extra={"rows": len(scores.rows)},
    )
    return scores
