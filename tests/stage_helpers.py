"""Tiny checkpoints and run configs for the stage tests (test helper).

A config here is the smallest experiment that still exercises everything a stage does: a tiny
diffusers checkpoint of the family (32 x 32 images, float32, 16 text tokens, full
fine-tuning), 4 steps, groups of 2, three prompts per round in micro-batches of one group
(so there are several micro-batches to deal to ranks), jpeg_compressibility as the reward and
the metric.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from jagg_pipeline.config.run import RunConfig, load_config
from jagg_pipeline.toyworld.tiny import TINY_IMAGE_SIZE, save_tiny_pipeline

EVAL_PROMPTS = ["a red circle on the left, white background", "a blue square at the top"]
# Prompts of very different token counts: QwenImage pads its text per encoding call, so these
# show whether every micro-batch (and rank) sees the same padded conditioning.
VARIED_PROMPTS = ["green", "a yellow triangle at the bottom, black background", "a red circle"]


def write_prompts(path: Path, prompts: list[str] = VARIED_PROMPTS) -> Path:
    """A .txt prompt file of ``prompts``."""
    path.write_text("\n".join(prompts) + "\n")
    return path


def tiny_checkpoint(family: str, base: Path) -> Path:
    """A tiny ``family`` pipeline saved under ``base`` (built once per directory)."""
    directory = base / f"tiny-{family}"
    if not (directory / "model_index.json").is_file():
        save_tiny_pipeline(family, directory)
    return directory


def experiment(family: str, checkpoint: Path, eval_prompts: Path, **sections: Any) -> dict:
    """The tiny experiment as YAML data; ``sections`` update it key by key (one level deep)."""
    data = {
        "backbone": {
            "family": family,
            "path": str(checkpoint),
            "height": TINY_IMAGE_SIZE,
            "width": TINY_IMAGE_SIZE,
            "dtype": "float32",
            "max_sequence_length": 16,
            "training": "full",
        },
        "sampler": {
            "num_steps": 4,
            "group_size": 2,
            "prompts_per_round": 3,
            "batch_size": 2,
            "trajectory": "segment",
            "segment_steps": 2,
            "segment_start": [0, 1],
        },
        "jagg": {"window": 2},  # the SDE segment's 2 trained steps
        "rewards": {"weights": {"jpeg_compressibility": 1.0}},
        "eval": {
            "prompts": str(eval_prompts),
            "max_prompts": 2,
            "samples_per_prompt": 2,
            "num_steps": 3,
            "metrics": ["jpeg_compressibility"],
        },
        "tracking": {"backend": "none"},
    }
    data = copy.deepcopy(data)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def write_experiment(
    path: Path, family: str, checkpoint: Path, **sections: Any
) -> tuple[Path, RunConfig]:
    """Write the tiny experiment (and its eval prompt file) to ``path``; return it loaded."""
    prompts = write_prompts(path.parent / "eval_prompts.txt", EVAL_PROMPTS)
    path.write_text(yaml.safe_dump(experiment(family, checkpoint, prompts, **sections)))
    return path, load_config(path)
