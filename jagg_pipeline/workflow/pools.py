"""Prompt pools encoded once (``workflow.encode_prompts``): which runs share which pool.

The encode rule writes each pool's conditioning to ``<results>/conditioning/<pool>/``, and the
rollout, block and evaluate jobs read it (``--conditioning``) instead of loading the text
encoders. A pool is a prompt source and column under the backbone keys the text encoders read
(the encode stage's :func:`~jagg_pipeline.io.manifest.stage_values`): every run and round that
agree on those share one encode job. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from jagg_pipeline.config.fields import digest
from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.io.manifest import stage_values
from jagg_pipeline.workflow.layout import toyworld_inputs
from jagg_pipeline.workflow.runs import Run


@dataclass(frozen=True)
class Pool:
    """A prompt pool to encode: its source, its column and a run config that reads it.

    Every run sharing the pool agrees on what the encode stage reads of the config.
    """

    source: str
    column: str | None
    config: RunConfig

    @property
    def key(self) -> str:
        """The pool's short stable name (:func:`pool_key`)."""
        return pool_key(self.config, self.source, self.column)

    def settings(self) -> list[str]:
        """``--set KEY=VALUE`` for every key the encode stage reads, and the backbone device.

        Values as JSON, which YAML reads back as they were: a negative prompt "yes" stays text.
        """
        values = {**stage_values(self.config, "encode")}
        values["backbone.device"] = self.config.backbone.device
        return [
            argument
            for key, value in values.items()
            for argument in ("--set", f"{key}={json.dumps(value)}")
        ]

    def inputs(self, toyworld_root: str) -> dict[str, str]:
        """The pool's prompt file (a toy split is none) and the toy backbone encoding it."""
        inputs = {}
        if not self.source.startswith("toy:"):
            inputs["prompts"] = self.source
        toy = toyworld_inputs(self.config, toyworld_root)
        if "toy_backbone" in toy:
            inputs["toy_backbone"] = toy["toy_backbone"]
        return inputs


def pool_key(config: RunConfig, source: str, column: str | None) -> str:
    """The short stable name of a prompt pool's conditioning (``<results>/conditioning/<key>``).

    A digest of the prompt source, its column and the backbone keys the text encoders read
    (``encode``'s :func:`~jagg_pipeline.io.manifest.stage_values`): runs that agree on all of
    them share one pool.
    """
    text = stage_values(config, "encode")
    return digest({"prompts": source, "column": column, "text": text})[:12]


def run_pools(run: Run) -> dict[str, Pool]:
    """Stage -> pool of a run.

    Its rollout's ``sampler.prompts`` (a training run) and its evaluation's ``eval.prompts``.
    """
    config = run.config
    sources = {"evaluate": (config.eval.prompts, config.eval.column)}
    if run.policy is None:
        sources["rollout"] = (config.sampler.prompts, config.sampler.prompt_column)
    return {stage: Pool(source, column, config) for stage, (source, column) in sources.items()}


def shared_pools(runs: Iterable[Run]) -> tuple[dict[str, dict[str, str]], dict[str, Pool]]:
    """Run id -> stage -> pool key, and pool key -> the pool (its first run's config)."""
    by_run: dict[str, dict[str, str]] = {}
    pools: dict[str, Pool] = {}
    for run in runs:
        by_run[run.run_id] = {}
        for stage, pool in run_pools(run).items():
            by_run[run.run_id][stage] = pool.key
            pools.setdefault(pool.key, pool)
    return by_run, pools
