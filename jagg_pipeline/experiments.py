"""Experiments as data: the ``workflow`` section of config.yaml, resolved into runs.

The Snakemake workflow's config is the package's sections (the *base* experiment) plus a
``workflow`` section naming experiments. An experiment is a set of variants (overrides of the
base, e.g. ``jagg: {mode: exact}``), optionally crossed with a sweep over one dotted key, each
run for every seed; a run is one (experiment, variant, seed) with its fully resolved
:class:`~jagg_pipeline.config.ExperimentConfig`. This module owns that resolution, the run
layout (``<results>/<experiment>/<variant>/seed-<s>/``), which rounds are evaluated, and the
digests of the config sections each stage reads (the rules' params: an edit reruns exactly the
jobs it affects). Torch-free: every Snakemake job parses the Snakefile, which calls this.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jagg_pipeline.config import ExperimentConfig
from jagg_pipeline.configtools import (
    SCHEMA_DIALECT,
    ConfigError,
    digest,
    field,
    from_dict,
    json_schema,
    to_dict,
)

WORKFLOW_KEY = "workflow"
# The config sections (or dotted keys) each stage reads: the rules pass their digests as
# params. Rollouts also depend on the policy they sample from, a file input of the rule.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "rollout": ("backbone", "sampler", "train.seed"),
    "score": ("rewards", "advantage"),
    "train": ("backbone", "sampler", "advantage", "grpo", "jagg", "rewards", "train"),
    "evaluate": ("backbone", "sampler.batch_size", "eval", "rewards"),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Sweep:
    """One key crossed over a list of values; each value becomes a variant ``<leaf>-<value>``."""

    key: str = field(help="dotted config key, e.g. jagg.jagg_frac")
    values: list[Any] = field(help="the values to run (at least one)")


@dataclass
class Experiment:
    """A named target: variants (overrides of the base sections) x sweep values x seeds."""

    description: str = field("", help="one line shown in the workflow's summary")
    seeds: list[int] = field(default_factory=lambda: [0], help="train.seed of each repetition")
    overrides: dict[str, Any] = field(
        default_factory=dict, help="applied to the base sections for every variant first"
    )
    variants: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"base": {}},
        help="name -> overrides of the base sections (after this experiment's overrides)",
    )
    sweep: Sweep | None = field(None, help="crossed with every variant, when given")


@dataclass
class ToyWorld:
    """Where the workflow builds the embedded toy world, and how long it pretrains."""

    root: str = field(
        "results/toyworld",
        help="a backbone.path <root>/<family> (and rewards.toy_clipscore.model <root>/clip) "
        "is built by the workflow's toyworld rules",
    )
    seed: int = field(0, help="seed of the toy world's weights and data")
    steps: int = field(1800, help="backbone pretraining steps", minimum=1)
    batch: int = field(16, help="pretraining batch size", minimum=1)
    clip_steps: int = field(500, help="toy CLIP training steps", minimum=1)


@dataclass
class Containers:
    """The image of each environment family: containers/<family>.def, envs/<family>.yaml."""

    pipeline: str = field(
        "containers/pipeline.sif",
        help="the stages' image (toyworld, rollout, score, train, evaluate): "
        "apptainer build containers/pipeline.sif containers/pipeline.def",
    )
    summary: str = field(
        "containers/summary.sif",
        help="the comparison's image (summary, track, compare), torch-free: "
        "apptainer build containers/summary.sif containers/summary.def",
    )


@dataclass
class WorkflowConfig:
    """The ``workflow`` section: where results go and the experiments the targets run."""

    results: str = field("results", help="root of every run's outputs, logs and benchmarks")
    toyworld: ToyWorld = field(default_factory=ToyWorld, help="the embedded toy world")
    experiments: dict[str, Experiment] = field(
        default_factory=dict, help="target name -> experiment"
    )
    containers: Containers = field(
        default_factory=Containers,
        help="the images the rules run in under --sdm apptainer, per environment family",
    )
    report: list[str] = field(
        default_factory=lambda: ["all"], help="experiments the `report` target collects"
    )


@dataclass(frozen=True)
class Run:
    """One (experiment, variant, seed) with its resolved config and where it lives."""

    experiment: str
    variant: str
    seed: int
    config: ExperimentConfig
    overrides: dict[str, Any]
    directory: str

    @property
    def run_id(self) -> str:
        """``experiment/variant/seed-s``: stable, unique, the run's folder below results."""
        return f"{self.experiment}/{self.variant}/seed-{self.seed}"


def split(data: Mapping[str, Any]) -> tuple[dict[str, Any], WorkflowConfig]:
    """The base sections' data and the parsed ``workflow`` section of a Snakemake config."""
    base = {key: value for key, value in data.items() if key != WORKFLOW_KEY}
    section = data.get(WORKFLOW_KEY) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{WORKFLOW_KEY}: expected a mapping, got {section!r}")
    workflow = from_dict(WorkflowConfig, section, prefix=WORKFLOW_KEY)
    return base, workflow


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (mappings merge, other values replace)."""
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _dotted(key: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``key`` ``"a.b"``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _variants(name: str, experiment: Experiment) -> dict[str, dict[str, Any]]:
    """Variant name -> its overrides (experiment overrides, variant, sweep value merged)."""
    where = f"{WORKFLOW_KEY}.experiments.{name}"
    if not experiment.variants:
        raise ConfigError(f"{where}.variants: name at least one variant (e.g. base: {{}})")
    if not experiment.seeds:
        raise ConfigError(f"{where}.seeds: name at least one seed")
    sweep = experiment.sweep
    if sweep is not None and not sweep.values:
        raise ConfigError(f"{where}.sweep.values: an empty sweep runs nothing; give values")
    result = {}
    for variant, overrides in experiment.variants.items():
        if not _NAME.match(variant):
            raise ConfigError(f"{where}.variants.{variant}: use letters, digits, '_', '-', '.'")
        layered = _merge(experiment.overrides, overrides)
        if sweep is None:
            result[variant] = layered
            continue
        leaf = sweep.key.rsplit(".", 1)[-1]
        for value in sweep.values:
            label = (
                f"{leaf}-{value}" if len(experiment.variants) == 1 else f"{variant}_{leaf}-{value}"
            )
            result[label] = _merge(layered, _dotted(sweep.key, value))
    return result


def resolve_runs(data: Mapping[str, Any]) -> dict[str, Run]:
    """Every run of every experiment, by run id; errors name the experiment, variant and key."""
    base, workflow = split(data)
    try:
        from_dict(ExperimentConfig, base)
    except ConfigError as err:
        raise ConfigError(f"base sections: {err}") from None
    runs: dict[str, Run] = {}
    for name, experiment in workflow.experiments.items():
        if not _NAME.match(name):
            raise ConfigError(f"{WORKFLOW_KEY}.experiments.{name}: not a usable target name")
        for variant, overrides in _variants(name, experiment).items():
            for seed in experiment.seeds:
                merged = _merge(_merge(base, overrides), {"train": {"seed": seed}})
                try:
                    config = from_dict(ExperimentConfig, merged)
                except ConfigError as err:
                    where = f"{WORKFLOW_KEY}.experiments.{name}.variants.{variant}"
                    raise ConfigError(f"{where} (base + overrides): {err}") from None
                directory = f"{workflow.results}/{name}/{variant}/seed-{seed}"
                run = Run(name, variant, seed, config, overrides, directory)
                runs[run.run_id] = run
    return runs


def evaluated_rounds(config: ExperimentConfig) -> list[int]:
    """Rounds of training after which the policy is evaluated: 0 (base), every K, and the last."""
    rounds, every = config.train.rounds, config.eval.every
    return sorted({0, rounds, *range(every, rounds + 1, every)})


def _select(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def stage_digest(config: ExperimentConfig, stage: str) -> str:
    """Digest of exactly the sections (or keys) ``stage`` reads (:data:`STAGE_SECTIONS`)."""
    data = to_dict(config)
    return digest({key: _select(data, key) for key in STAGE_SECTIONS[stage]})


def workflow_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of a workflow config: the package's sections + ``workflow``."""
    schema = json_schema(ExperimentConfig)
    workflow = json_schema(WorkflowConfig)
    for key in ("$schema", "title"):
        workflow.pop(key)
    schema["properties"][WORKFLOW_KEY] = workflow
    schema["title"] = "jagg-pipeline workflow config"
    assert schema["$schema"] == SCHEMA_DIALECT
    return schema
