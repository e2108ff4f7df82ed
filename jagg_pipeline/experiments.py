"""Experiments as data: the ``workflow`` section of config.yaml, resolved into runs.

The Snakemake workflow's config is the package's sections (the *base* experiment) plus a
``workflow`` section naming experiments and evaluations. An experiment is a set of variants
(overrides of the base, e.g. ``jagg: {mode: exact}``), crossed with named groups of overrides
(``cross``) and a sweep over one dotted key when given, each run for every seed; an evaluation
is policies x prompt sets x seeds, evaluated without training. A run is one (target, variant,
seed) with its fully resolved :class:`~jagg_pipeline.config.ExperimentConfig`. This module
owns that resolution, how config data is layered (:func:`merge`: sections merge key by key,
every other value, a mapping of reward weights included, replaces), the run layout
(``<results>/<target>/<variant>/seed-<s>/``), which rounds are evaluated and which keep their
checkpoint and rollout (``workflow.keep_every``), and the digests of the config sections each
stage reads (the rules' params: an edit reruns exactly the jobs it affects). Torch-free: every
Snakemake job parses the Snakefile, which calls this.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

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
    # The jagg keys decide which velocities a rollout stores (rollout.velocity_steps).
    "rollout": (
        "backbone",
        "sampler",
        "train.seed",
        "jagg.mode",
        "jagg.window",
        "jagg.anchors",
        "jagg.jagg_frac",
        "jagg.no_interp",
        "jagg.reuse_velocities",
    ),
    "score": ("rewards", "advantage"),
    "train": ("backbone", "sampler", "advantage", "grpo", "jagg", "rewards", "train"),
    "evaluate": ("backbone", "sampler.batch_size", "eval", "rewards"),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Folders the workflow keeps directly under workflow.results, and the workflow's own rules
# (the Snakefile refuses a target named like any of its rules; a test keeps this list whole):
# no target may be named so.
RESERVED_FOLDERS: tuple[str, ...] = ("toyworld", "report", "bench", "logs", "benchmarks")
WORKFLOW_RULES: tuple[str, ...] = (
    "toyworld_clip",
    "toyworld_backbone",
    "rollout",
    "rollout_transient",
    "score",
    "train",
    "train_transient",
    "evaluate",
    "summary",
    "track",
    "compare",
    "bench_update",
    "bench",
    "report",
)


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
    cross: dict[str, dict[str, dict[str, Any]]] = field(
        default_factory=dict,
        help="named groups of named overrides (e.g. backbone: {sd3: ..., flux: ...}, mode: "
        "{exact: ..., jagg: ...}), crossed with each other and the variants: a variant per "
        "combination, named by its labels joined with '_' (a sweep over several keys: one "
        "group per key)",
    )
    sweep: Sweep | None = field(None, help="crossed with every variant, when given")


@dataclass
class Evaluation:
    """A named evaluation target: policies x prompt sets x seeds, scored, no training."""

    description: str = field("", help="one line shown in the workflow's summary")
    policies: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"base": {}},
        help="label -> the policy: {} for backbone.path, {checkpoint: a train output folder "
        "such as results/all/jagg/seed-0/round-0003/checkpoint}, or base-section overrides "
        "such as {backbone: {path: /models/my-diffusers-folder}}",
    )
    prompts: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"heldout": {}},
        help="label -> overrides of the eval section (prompts, column, max_prompts, ...)",
    )
    metrics: list[str] | None = field(
        None, help="the reward names scored (null: eval.metrics of the base sections)"
    )
    seeds: list[int] = field(
        default_factory=lambda: [1234], help="eval.seed of each repetition (the noise)"
    )
    overrides: dict[str, Any] = field(
        default_factory=dict, help="applied to the base sections for every policy first"
    )


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
    evaluations: dict[str, Evaluation] = field(
        default_factory=dict, help="target name -> evaluation (no training)"
    )
    containers: Containers = field(
        default_factory=Containers,
        help="the images the rules run in under --sdm apptainer, per environment family",
    )
    report: list[str] = field(
        default_factory=lambda: ["all"], help="experiments the `report` target collects"
    )
    keep_every: int | None = field(
        None,
        help="keep the checkpoint and rollout of every K-th round of a run (round r when "
        "(r + 1) % K == 0), of its last round and of every evaluated round; the other rounds' "
        "are deleted once the next round no longer needs them (their metrics stay in "
        "round-<r>/metrics/). null: keep every round",
        minimum=1,
    )


@dataclass(frozen=True)
class Run:
    """One (target, variant, seed) with its resolved config and where it lives.

    ``policy``: for an evaluation run, what it evaluates (``base`` or a checkpoint folder);
    None for a training run, which evaluates its own rounds. ``keep_every``:
    ``workflow.keep_every`` (which rounds keep their checkpoint and rollout).
    """

    experiment: str
    variant: str
    seed: int
    config: ExperimentConfig
    overrides: dict[str, Any]
    directory: str
    policy: str | None = None
    keep_every: int | None = None

    @property
    def run_id(self) -> str:
        """``experiment/variant/seed-s``: stable, unique, the run's folder below results."""
        return f"{self.experiment}/{self.variant}/seed-{self.seed}"

    @property
    def evaluated_rounds(self) -> list[int]:
        """Rounds trained before each evaluation (an evaluation run: only its policy, as 0)."""
        return [0] if self.policy is not None else evaluated_rounds(self.config)

    @property
    def kept_rounds(self) -> list[int]:
        """Training rounds whose checkpoint and rollout stay on disk (:func:`kept_rounds`)."""
        return [] if self.policy is not None else kept_rounds(self.config, self.keep_every)


def split(data: Mapping[str, Any]) -> tuple[dict[str, Any], WorkflowConfig]:
    """The base sections' data and the parsed ``workflow`` section of a Snakemake config."""
    base = {key: value for key, value in data.items() if key != WORKFLOW_KEY}
    section = data.get(WORKFLOW_KEY) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{WORKFLOW_KEY}: expected a mapping, got {section!r}")
    workflow = from_dict(WorkflowConfig, section, prefix=WORKFLOW_KEY)
    return base, workflow


def _sections(cls: type) -> dict[str, type]:
    """The fields of dataclass ``cls`` that are sections (dataclasses) themselves."""
    hints = get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if dataclasses.is_dataclass(hints[f.name])
    }


# A workflow config file: the experiment's sections and the workflow section.
_FILE_SECTIONS = {**_sections(ExperimentConfig), WORKFLOW_KEY: WorkflowConfig}


def merge(
    base: Mapping[str, Any],
    overrides: Mapping[str, Any],
    sections: Mapping[str, type] | None = None,
) -> dict[str, Any]:
    """``base`` with ``overrides`` layered on: sections merge key by key, the rest replaces.

    A mapping that names a set replaces too (``rewards.weights``, an experiment's
    ``variants``): a later layer's weights are the weights, never the union.

    ``sections``: which keys of this level are sections (default: a workflow config file's).
    """
    sections = _FILE_SECTIONS if sections is None else sections
    merged = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        inner = sections.get(key)
        if (
            inner is not None
            and isinstance(value, Mapping)
            and isinstance(merged.get(key), Mapping)
        ):
            merged[key] = merge(merged[key], value, _sections(inner))
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Experiment data (the base sections, overrides) layered as :func:`merge` does."""
    return merge(base, overrides, _EXPERIMENT_SECTIONS)


_EXPERIMENT_SECTIONS = _sections(ExperimentConfig)


def _dotted(key: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``key`` ``"a.b"``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _check_labels(where: str, labels: Mapping[str, Any], what: str) -> None:
    if not labels:
        raise ConfigError(f"{where}: name at least one {what}")
    for label in labels:
        if not _NAME.match(str(label)):
            raise ConfigError(f"{where}.{label}: use letters, digits, '_', '-', '.'")


def _crossed(
    where: str, groups: list[dict[str, dict[str, Any]]]
) -> dict[str, tuple[tuple[str, ...], dict[str, Any]]]:
    """Every combination of one entry per group: name -> (labels, layered overrides).

    Overrides are layered in group order; the name is the labels joined by '_', where groups
    of a single entry add nothing to the name.
    """
    result: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {}
    for combination in itertools.product(*(list(g.items()) for g in groups)):
        labels = tuple(str(label) for label, _ in combination)
        shown = [label for label, group in zip(labels, groups, strict=True) if len(group) > 1]
        name = "_".join(shown) or labels[0]
        if name in result:
            raise ConfigError(
                f"{where}: two combinations are both named {name!r} ({labels} and "
                f"{result[name][0]}); rename a variant or an entry"
            )
        overrides: dict[str, Any] = {}
        for _, layer in combination:
            overrides = _merge(overrides, layer)
        result[name] = (labels, overrides)
    return result


def _variants(name: str, experiment: Experiment) -> dict[str, dict[str, Any]]:
    """Variant name -> its overrides (experiment overrides, variant, cross groups, sweep)."""
    where = f"{WORKFLOW_KEY}.experiments.{name}"
    _check_labels(f"{where}.variants", experiment.variants, "variant (e.g. base: {})")
    if not experiment.seeds:
        raise ConfigError(f"{where}.seeds: name at least one seed")
    for group, entries in experiment.cross.items():
        _check_labels(f"{where}.cross.{group}", entries, "entry")
    groups = [experiment.variants, *experiment.cross.values()]
    sweep = experiment.sweep
    if sweep is not None:
        if not sweep.values:
            raise ConfigError(f"{where}.sweep.values: an empty sweep runs nothing; give values")
        leaf = sweep.key.rsplit(".", 1)[-1]
        groups.append({f"{leaf}-{v}": _dotted(sweep.key, v) for v in sweep.values})
    return {
        name: _merge(experiment.overrides, overrides)
        for name, (_, overrides) in _crossed(where, groups).items()
    }


def _evaluation_variants(name: str, evaluation: Evaluation) -> dict[str, tuple[str, dict]]:
    """Variant name (``<policy>_<prompts>``) -> (the policy, its overrides)."""
    where = f"{WORKFLOW_KEY}.evaluations.{name}"
    _check_labels(f"{where}.policies", evaluation.policies, "policy (e.g. base: {})")
    _check_labels(f"{where}.prompts", evaluation.prompts, "prompt set (e.g. heldout: {})")
    if not evaluation.seeds:
        raise ConfigError(f"{where}.seeds: name at least one seed")
    policies, overrides = {}, {}
    for label, entry in evaluation.policies.items():
        entry = dict(entry)
        policies[label] = str(entry.pop("checkpoint", None) or "base")
        overrides[label] = entry
    metrics = {} if evaluation.metrics is None else {"eval": {"metrics": evaluation.metrics}}
    prompts = {label: {"eval": entry} for label, entry in evaluation.prompts.items()}
    return {
        name: (policies[labels[0]], _merge(_merge(evaluation.overrides, metrics), layered))
        for name, (labels, layered) in _crossed(where, [overrides, prompts]).items()
    }


def check_target_name(kind: str, name: str, taken: Mapping[str, str] = {}) -> None:
    """Refuse a target name that is no usable folder and rule name, or is taken already.

    ``taken``: name -> what uses it (the workflow's own rules, other targets).
    """
    where = f"{WORKFLOW_KEY}.{kind}.{name}"
    if not _NAME.fullmatch(name) or not name.isidentifier():
        raise ConfigError(
            f"{where}: not a usable target name; use a letter, then letters, digits and '_'"
        )
    if name in RESERVED_FOLDERS:
        raise ConfigError(
            f"{where}: {name!r} is the folder of the workflow's own {name} outputs under "
            "workflow.results; rename the target"
        )
    if name in WORKFLOW_RULES:
        raise ConfigError(f"{where}: {name!r} is a rule of the workflow; rename the target")
    if name in taken:
        raise ConfigError(f"{where}: {name!r} is taken by {taken[name]}; rename the target")


def _resolve(base, workflow, target, variant, overrides, seed_key, seed, policy=None) -> Run:
    merged = _merge(_merge(base, overrides), _dotted(seed_key, seed))
    try:
        config = from_dict(ExperimentConfig, merged)
    except ConfigError as err:
        raise ConfigError(f"{target}.variants.{variant} (base + overrides): {err}") from None
    name = target.rsplit(".", 1)[-1]
    directory = f"{workflow.results}/{name}/{variant}/seed-{seed}"
    return Run(name, variant, seed, config, overrides, directory, policy, workflow.keep_every)


def resolve_runs(data: Mapping[str, Any]) -> dict[str, Run]:
    """Every run of every experiment and evaluation, by run id.

    Errors name the target, the variant and the key.
    """
    base, workflow = split(data)
    try:
        from_dict(ExperimentConfig, base)
    except ConfigError as err:
        raise ConfigError(f"base sections: {err}") from None
    runs: dict[str, Run] = {}
    taken: dict[str, str] = {}
    for name, experiment in workflow.experiments.items():
        check_target_name("experiments", name, taken)
        taken[name] = f"{WORKFLOW_KEY}.experiments.{name}"
        target = f"{WORKFLOW_KEY}.experiments.{name}"
        for variant, overrides in _variants(name, experiment).items():
            for seed in experiment.seeds:
                run = _resolve(base, workflow, target, variant, overrides, "train.seed", seed)
                runs[run.run_id] = run
    for name, evaluation in workflow.evaluations.items():
        check_target_name("evaluations", name, taken)
        taken[name] = f"{WORKFLOW_KEY}.evaluations.{name}"
        target = f"{WORKFLOW_KEY}.evaluations.{name}"
        for variant, (policy, overrides) in _evaluation_variants(name, evaluation).items():
            for seed in evaluation.seeds:
                run = _resolve(
                    base, workflow, target, variant, overrides, "eval.seed", seed, policy
                )
                runs[run.run_id] = run
    return runs


def evaluated_rounds(config: ExperimentConfig) -> list[int]:
    """Rounds of training after which the policy is evaluated: 0 (base), every K, and the last."""
    rounds, every = config.train.rounds, config.eval.every
    return sorted({0, rounds, *range(every, rounds + 1, every)})


def kept_rounds(config: ExperimentConfig, keep_every: int | None) -> list[int]:
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
    kept |= {n - 1 for n in evaluated_rounds(config) if n > 0}
    return sorted(kept | {rounds - 1})


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
