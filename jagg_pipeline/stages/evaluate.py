"""The evaluate stage: a policy's images for fixed prompts and seeds, scored by every metric.

Owns the evaluation protocol and its output directory. Protocol: the first
``eval.max_prompts`` prompts of ``eval.prompts`` (a file or a toy split, in order),
``eval.samples_per_prompt`` images each, sample ``i`` seeded from ``(eval.seed, i)`` only (the
same noise for every checkpoint), ODE sampling with ``eval.num_steps`` steps, in the rollout's
micro-batches (``sampler.batch_size``); metrics are the reward names ``eval.metrics`` with their
``rewards`` settings, scored on the uint8 images that are saved (so a ``score`` of the saved
PNGs reproduces them). The same checkpoint and config give the same metrics, bit for bit.

Output directory: ``metrics.json`` (mean and std per metric, per-prompt means),
``samples.jsonl`` (one row per image: file, prompt, seed, scores), ``images/PPPP_SS.png``,
``grid.png`` (one row per prompt, its text and scores beside it), ``metrics.jsonl`` (one flat
line: round = rounds trained behind the policy, each metric's mean and std), ``config.yaml``,
``manifest.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.backbones import Backbone
from jagg_pipeline.core import sde
from jagg_pipeline.io.artifacts import (
    METRICS_NAME,
    append_metrics,
    atomic_write_json,
)
from jagg_pipeline.io.figures import save_image_grid, save_png
from jagg_pipeline.io.manifest import begin_output, finish_output, stage_inputs
from jagg_pipeline.io.prompts import resolve_prompts
from jagg_pipeline.io.tables import write_table
from jagg_pipeline.rewards import load_reward
from jagg_pipeline.stages.rollout import RolloutPlan, derive_seed, micro_batches, sample_batches
from jagg_pipeline.stages.scoring import reward_columns
from jagg_pipeline.support.startup import StageClock

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

STAGE = "evaluate"
IMAGES_DIR = "images"


@dataclass
class Evaluation:
    """Images [N, 3, H, W] uint8 of ``prompts`` (``samples_per_prompt`` each, prompt-major)."""

    prompts: list[str]
    samples_per_prompt: int
    seeds: torch.Tensor
    images: torch.Tensor
    scores: dict[str, torch.Tensor]

    def metrics(self) -> dict[str, Any]:
        """Mean and (population) std per metric, and each prompt's mean per metric."""
        per_prompt = {
            name: values.view(len(self.prompts), self.samples_per_prompt).mean(dim=1)
            for name, values in self.scores.items()
        }
        return {
            "metrics": {
                name: {"mean": float(v.mean()), "std": float(v.std(unbiased=False))}
                for name, v in self.scores.items()
            },
            "per_prompt": [
                {
                    "prompt_id": j,
                    "prompt": prompt,
                    **{name: float(v[j]) for name, v in per_prompt.items()},
                }
                for j, prompt in enumerate(self.prompts)
            ],
        }


def plan_evaluation(config: RunConfig) -> RolloutPlan:
    """The fixed prompts, seeds, ODE masks and micro-batches of ``config.eval``."""
    ev = config.eval
    if ev.max_prompts < 1 or ev.samples_per_prompt < 1 or ev.num_steps < 1:
        raise ValueError(
            "eval.max_prompts, eval.samples_per_prompt and eval.num_steps must be >= 1"
        )
    prompts = resolve_prompts(ev.prompts, ev.column)[: ev.max_prompts]
    count = len(prompts) * ev.samples_per_prompt
    ode = torch.zeros(ev.num_steps, dtype=torch.bool)
    return RolloutPlan(
        prompts=prompts,
        group_size=ev.samples_per_prompt,
        seeds=torch.tensor([derive_seed(ev.seed, "eval", i) for i in range(count)]),
        masks=sde.StepMasks(sde=ode, train=ode.clone()),
        coeffs=sde.StepCoefficients("ode", 0.0),
        micro_batches=micro_batches(len(prompts), ev.samples_per_prompt, config.sampler.batch_size),
    )


def _sample_share(
    backbone: Backbone, plan: RolloutPlan, rank: int, world_size: int, progress: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(sample ids, seeds, images) of the whole plan on rank 0 (None on the other ranks).

    Each rank samples its share of the micro-batches (padding to the same number of forward
    collectives, as the rollout does); the images go to rank 0, in sample order.
    """
    from jagg_pipeline.stages.distributed import gather_object
    from jagg_pipeline.stages.rollout import batches_per_rank

    batch = sample_batches(
        backbone,
        plan,
        plan.share(rank, world_size),
        desc="evaluate" if world_size == 1 else f"evaluate rank {rank}",
        progress=progress,
        pad_to=batches_per_rank(plan, world_size),
    )
    mine = None if batch is None else (batch.sample_ids, batch.seeds, batch.images)
    if world_size == 1:
        return mine
    shares = [share for share in gather_object(mine) or [] if share is not None]
    if rank != 0:
        return None
    ids, seeds, images = (torch.cat(column) for column in zip(*shares, strict=True))
    order = torch.argsort(ids)
    return ids[order], seeds[order], images[order]


def evaluate(
    config: RunConfig,
    backbone: Backbone,
    progress: bool = True,
    clock: StageClock | None = None,
    plan: RolloutPlan | None = None,
    rank: int = 0,
    world_size: int = 1,
    metrics: Mapping[str, Any] | None = None,
) -> Evaluation | None:
    """Sample the evaluation images with ``backbone`` and score them with every metric.

    ``clock``: the evaluate stage's; loading the metrics' reward models counts as its load,
    sampling and scoring as its work (None: not timed). ``plan``: :func:`plan_evaluation`'s,
    when made already (None: made here). Under a process group of ``world_size`` ranks, every
    rank samples its share with the (sharded) ``backbone`` and rank 0 scores every image (as
    one process would, bit for bit) and returns the evaluation; the other ranks return None.
    ``metrics``: rank 0's :func:`metric_models`, loaded already (None: loaded here).
    """
    clock = clock or StageClock()
    plan = plan or plan_evaluation(config)
    sampled = _sample_share(backbone, plan, rank, world_size, progress)
    clock.lap("work")
    if sampled is None:
        return None
    _, seeds, images = sampled
    if metrics is None:
        metrics = metric_models(config, backbone.device)
    clock.lap("load")
    prompts = [plan.prompts[i] for i in plan.prompt_ids.tolist()]
    scores = reward_columns(metrics, images, prompts, config.sampler.batch_size)
    clock.lap("work")
    return Evaluation(plan.prompts, plan.group_size, seeds, images, scores)


def metric_models(config: RunConfig, device: str | torch.device) -> dict[str, Any]:
    """The reward model of every ``eval.metrics`` name, for a policy on ``device``.

    On the reward device of that policy: this rank's ``cuda:LOCAL_RANK``, not the config's
    bare ``cuda``.
    """
    device = config.rewards.resolve_device(str(device))
    return {
        name: load_reward(name, config.rewards.spec(name), device) for name in config.eval.metrics
    }


def write_evaluation(
    evaluation: Evaluation, out: Path, info: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Write images, ``samples.jsonl``, ``grid.png`` and ``metrics.json`` into ``out``.

    ``info`` (what was evaluated, how) heads ``metrics.json``; the report is returned.
    """
    from PIL import Image

    report = {**dict(info or {}), **evaluation.metrics()}
    per_sample = evaluation.samples_per_prompt
    rows = []
    for i, image in enumerate(evaluation.images):
        prompt_id, sample = divmod(i, per_sample)
        name = f"{IMAGES_DIR}/{prompt_id:04d}_{sample:02d}.png"
        save_png(Image.fromarray(image.permute(1, 2, 0).numpy()), out / name)
        rows.append(
            {
                "image": name,
                "prompt_id": prompt_id,
                "prompt": evaluation.prompts[prompt_id],
                "sample": sample,
                "seed": int(evaluation.seeds[i]),
                **{metric: float(v[i]) for metric, v in evaluation.scores.items()},
            }
        )
    write_table(out / "samples.jsonl", rows)
    # A prompt's samples side by side, several prompts per row; each metric on its own line.
    captions = [
        f"{row['prompt_id']}: {row['prompt']}\n"
        + "\n".join(f"{m}={row[m]:.3g}" for m in evaluation.scores)
        for row in rows
    ]
    columns = per_sample * max(1, 8 // per_sample)
    lines = 3 + len(evaluation.scores)
    save_image_grid(
        out / "grid.png", evaluation.images, captions, columns=columns, caption_lines=lines
    )
    atomic_write_json(out / "metrics.json", report)
    return report


def trained_rounds(policy: str | Path) -> int | None:
    """Rounds of training behind ``policy`` (0: the base; None: weights without a trainer)."""
    from jagg_pipeline.io.artifacts import BASE
    from jagg_pipeline.stages import checkpoint

    if str(policy) == BASE:
        return 0
    if not (Path(policy) / checkpoint.TRAINER_DIR / checkpoint.STATE_FILE).is_file():
        return None
    return checkpoint.read_trainer_state(policy).round + 1


def _metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    values = {}
    for name, stats in metrics.items():
        values[name] = stats["mean"]
        values[f"{name}_std"] = stats["std"]
    return values


def run_evaluate(
    config: RunConfig,
    policy: str | Path,
    out: str | Path,
    *,
    progress: bool = True,
    conditioning: str | Path | None = None,
) -> dict[str, Any] | None:
    """The evaluate stage for ``policy`` (``base`` or a checkpoint directory); returns metrics.

    The prompts are read before any model is loaded: a bad prompt file fails at once.
    ``conditioning``: the encode stage's folder of ``eval.prompts`` (no text encoder is
    loaded; None: prompts encoded inline). Under torchrun every rank runs this and rank 0
    writes and returns the report (None elsewhere).
    """
    clock = StageClock.start()
    from jagg_pipeline.stages.distributed import barrier, distributed
    from jagg_pipeline.stages.encode import conditioning_inputs, open_pool
    from jagg_pipeline.stages.policy import load_sharded_policy

    out = Path(out)
    plan = plan_evaluation(config)
    source = open_pool(config, conditioning)
    with distributed(config.backbone.device) as ctx:
        # Sharded over every rank, as in the rollout; rank 0 scores and writes.
        backbone = load_sharded_policy(config, policy, ctx, text_encoders=source is None)
        backbone.use_precomputed(source)
        clock.lap("load")
        evaluation = evaluate(
            config, backbone, progress and ctx.is_main, clock, plan, ctx.rank, ctx.world_size
        )
        report = None
        if evaluation is not None:
            report = write_evaluation_output(
                config,
                out,
                evaluation,
                policy=str(policy),
                trained=trained_rounds(policy),
                inputs=stage_inputs(config.eval.prompts, policy)
                | conditioning_inputs(conditioning),
                time=clock.record(),
            )
        barrier()  # the output is complete before any rank exits
    return report


def write_evaluation_output(
    config: RunConfig,
    out: Path,
    evaluation: Evaluation,
    *,
    policy: str,
    trained: int | None,
    inputs: Mapping[str, Path],
    time: Mapping[str, float],
) -> dict[str, Any]:
    """Rank 0's part of the evaluate stage: every file of ``out``, the manifest last.

    ``policy``: what was evaluated, as named; ``trained``: the rounds behind it (None:
    unknown), the metric line's round.
    """
    out.mkdir(parents=True, exist_ok=True)
    begin_output(out, (f"{IMAGES_DIR}/*.png", METRICS_NAME))
    ev = config.eval
    info = {
        "policy": str(policy),
        "prompts": ev.prompts,
        "num_prompts": len(evaluation.prompts),
        "samples_per_prompt": ev.samples_per_prompt,
        "num_steps": ev.num_steps,
        "seed": ev.seed,
    }
    report = write_evaluation(evaluation, out, info)
    metrics = _metric_values(report["metrics"]) | {"time": dict(time)}
    append_metrics(out, STAGE, trained, 0, metrics)
    finish_output(
        out,
        config,
        stage=STAGE,
        seeds={"eval": ev.seed},
        inputs=inputs,
        extra={"policy": policy, "prompts": ev.prompts},
    )
    return report
