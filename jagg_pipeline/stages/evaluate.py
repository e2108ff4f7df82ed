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
from typing import Any

import torch

from jagg_pipeline.backbones import Backbone
from jagg_pipeline.core import sde
from jagg_pipeline.io.artifacts import (
    METRICS_NAME,
    append_metrics,
    atomic_output,
    atomic_write_json,
)
from jagg_pipeline.io.figures import save_image_grid
from jagg_pipeline.io.manifest import begin_output, finish_output, stage_inputs
from jagg_pipeline.io.prompts import resolve_prompts
from jagg_pipeline.io.tables import write_table
from jagg_pipeline.rewards import load_reward
from jagg_pipeline.stages.rollout import RolloutPlan, derive_seed, micro_batches, sample_batches
from jagg_pipeline.stages.scoring import reward_columns
from jagg_pipeline.support.startup import StageClock

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


def plan_evaluation(config: Any) -> RolloutPlan:
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


def evaluate(
    config: Any,
    backbone: Backbone,
    progress: bool = True,
    clock: StageClock | None = None,
    plan: RolloutPlan | None = None,
) -> Evaluation:
    """Sample the evaluation images with ``backbone`` and score them with every metric.

    ``clock``: the evaluate stage's; loading the metrics' reward models counts as its load,
    sampling and scoring as its work (None: not timed). ``plan``: :func:`plan_evaluation`'s,
    when made already (None: made here).
    """
    clock = clock or StageClock()
    plan = plan or plan_evaluation(config)
    batch = sample_batches(backbone, plan, plan.micro_batches, desc="evaluate", progress=progress)
    clock.lap("work")
    # The backbone's device is this rank's (cuda:LOCAL_RANK), not the config's bare "cuda".
    device = config.rewards.resolve_device(str(backbone.device))
    metrics = {
        name: load_reward(name, config.rewards.spec(name), device) for name in config.eval.metrics
    }
    clock.lap("load")
    prompts = [plan.prompts[i] for i in batch.prompt_ids.tolist()]
    scores = reward_columns(metrics, batch.images, prompts, config.sampler.batch_size)
    clock.lap("work")
    return Evaluation(plan.prompts, plan.group_size, batch.seeds, batch.images, scores)


def _save_png(image: Any, path: Path) -> None:
    with atomic_output(path) as tmp:
        image.save(tmp, format="PNG")


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
        _save_png(Image.fromarray(image.permute(1, 2, 0).numpy()), out / name)
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
    config: Any, policy: str | Path, out: str | Path, *, progress: bool = True
) -> dict[str, Any]:
    """The evaluate stage for ``policy`` (``base`` or a checkpoint directory); returns metrics.

    The prompts are read before any model is loaded: a bad prompt file fails at once.
    """
    clock = StageClock.start()
    from jagg_pipeline.stages.distributed import local_device
    from jagg_pipeline.stages.policy import load_policy

    out = Path(out)
    plan = plan_evaluation(config)
    backbone = load_policy(config, policy, local_device(config.backbone.device))
    clock.lap("load")
    evaluation = evaluate(config, backbone, progress, clock, plan)
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
    metrics = _metric_values(report["metrics"]) | {"time": clock.record()}
    append_metrics(out, STAGE, trained_rounds(policy), 0, metrics)
    finish_output(
        out,
        config,
        stage=STAGE,
        seeds={"eval": ev.seed},
        inputs=stage_inputs(ev.prompts, policy),
        extra={"policy": str(policy), "prompts": ev.prompts},
    )
    return report
