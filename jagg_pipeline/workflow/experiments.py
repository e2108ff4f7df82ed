"""Experiments as data: the ``workflow`` section of config.yaml, resolved into runs.

The Snakemake workflow's config is the package's sections (the *base* experiment) plus a
``workflow`` section naming experiments and evaluations. An experiment is a set of variants
(overrides of the base, e.g. ``jagg: {mode: exact}``), crossed with named groups of overrides
(``cross``) and a sweep over one dotted key when given, each run for every seed; an evaluation
is policies x prompt sets x seeds, evaluated without training. A run is one (target, variant,
seed) with its fully resolved :class:`~jagg_pipeline.config.run.RunConfig`. This module
owns that resolution, how config data is layered (:func:`merge`: sections merge key by key,
every other value, a mapping of reward weights included, replaces), the run layout
(``<results>/<target>/<variant>/seed-<s>/``), which rounds are evaluated and which keep their
checkpoint and rollout (``workflow.keep_every``), and the digests of the config sections each
stage reads (the rules' params: an edit reruns exactly the jobs it affects) and the names of the
prompt pools the encode rule encodes once (:func:`pool_key`). It also refuses
what would run wrong: a name that is no single path component (every name becomes a folder and
a shell argument), an unusable results folder, seeds or sweep values given twice, a seed set
where ``seeds`` rules, two variants that are one config (what the runs' inputs hold is
checked by :mod:`jagg_pipeline.workflow.checks`). Torch-free: every Snakemake job parses the
Snakefile, which calls this.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.config.tools import (
    SCHEMA_DIALECT,
    ConfigError,
    digest,
    field,
    from_dict,
    json_schema,
)
from jagg_pipeline.io.artifacts import evaluated_rounds
from jagg_pipeline.io.manifest import stage_values
from jagg_pipeline.support.errors import shown

WORKFLOW_KEY = "workflow"
# Every name that becomes a folder and a wildcard value (targets, variants, cross entries,
# sweep labels, policies, prompt sets): one path component that no shell or glob reads
# specially (checked with fullmatch: `$` would let a trailing newline through).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,119}")
# Folders the workflow keeps directly under workflow.results (mlartifacts: the default
# MLflow store's artifacts), and the workflow's own rules (the Snakefile refuses a target
# named like any of its rules; a test keeps this list whole): no target may be named so.
RESERVED_FOLDERS: tuple[str, ...] = (
    "toyworld",
    "comparison",
    "bench",
    "logs",
    "benchmarks",
    "mlartifacts",
    "conditioning",
)
WORKFLOW_RULES: tuple[str, ...] = (
    "toyworld_clip",
    "toyworld_pretrain",
    "toyworld_backbone",
    "encode",
    "rollout",
    "rollout_transient",
    "score",
    "train",
    "train_transient",
    "block",
    "block_transient",
    "evaluate",
    "summary",
    "track",
    "compare",
    "bench_update",
    "bench",
    "comparison",
)


@dataclass
class SweepConfig:
    """One key crossed over a list of values; each value becomes a variant ``<leaf>-<value>``."""

    key: str = field(help="dotted config key, e.g. jagg.jagg_frac")
    values: list[Any] = field(help="the values to run (at least one)")


@dataclass
class ExperimentConfig:
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
    sweep: SweepConfig | None = field(None, help="crossed with every variant, when given")


@dataclass
class EvaluationConfig:
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
class ToyWorldConfig:
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
class ContainersConfig:
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

    # The comparison target was called report, Snakemake's word for its own HTML report.
    MOVED_KEYS: ClassVar[dict[str, str]] = {"report": "workflow.comparison"}

    results: str = field("results", help="root of every run's outputs, logs and benchmarks")
    toyworld: ToyWorldConfig = field(default_factory=ToyWorldConfig, help="the embedded toy world")
    experiments: dict[str, ExperimentConfig] = field(
        default_factory=dict, help="target name -> experiment"
    )
    evaluations: dict[str, EvaluationConfig] = field(
        default_factory=dict, help="target name -> evaluation (no training)"
    )
    containers: ContainersConfig = field(
        default_factory=ContainersConfig,
        help="the images the rules run in under --sdm apptainer, per environment family",
    )
    comparison: list[str] = field(
        default_factory=lambda: ["all"],
        help="experiments the `comparison` target collects (each experiment target makes its "
        "own page too)",
    )
    keep_every: int | None = field(
        None,
        help="keep the checkpoint and rollout of every K-th round of a run (round r when "
        "(r + 1) % K == 0), of its last round and of every evaluated round; the other rounds' "
        "are deleted once the next round no longer needs them (their metrics stay in "
        "round-<r>/metrics/). null: keep every round",
        minimum=1,
    )
    rounds_per_job: int = field(
        1,
        help="rounds of a run per job: 1 runs each round as its rollout, score and train jobs "
        "(each loads its models and hands over files); K > 1 runs K consecutive rounds in one "
        "block job over the training ranks, the models resident and rollouts and scores in "
        "memory, with the same results bit for bit (K >= train.rounds: the whole run in one "
        "job). For long runs, large models, a busy queue; 1 for inspecting and debugging a "
        "round",
        minimum=1,
    )
    encode_prompts: bool = field(
        True,
        help="encode each prompt pool once (the encode rule, <results>/conditioning/<pool>/) "
        "so that rollout and evaluate load no text encoder; false encodes each round's prompts "
        "inline, for pools too large to store (about N prompts x the bytes of one: Flux's T5 "
        "512 x 4096 bf16 is 4 MB a prompt)",
    )

    def __post_init__(self) -> None:
        check_folder(f"{WORKFLOW_KEY}.results", self.results)
        check_folder(f"{WORKFLOW_KEY}.toyworld.root", self.toyworld.root)


def check_folder(key: str, value: str) -> None:
    """Refuse a folder setting ``key`` that is no usable folder of its own.

    Refused: empty, the filesystem root or the working directory itself, a control character
    (a line break), a leading ``~`` (nothing expands it). Relative and absolute paths, spaces
    included, are fine.
    """
    problem = None
    if not value.strip():
        problem = "is empty"
    elif any(ord(char) < 32 or ord(char) == 127 for char in value):
        problem = "holds a control character (a line break?)"
    elif value.startswith("~"):
        problem = "starts with '~', which is not expanded here; write the full path"
    elif os.path.normpath(value) in ("/", "//"):
        problem = "is the filesystem root"
    elif os.path.normpath(value) == ".":
        problem = "is the working directory itself"
    if problem:
        raise ValueError(
            f"{key}: {shown(value)} {problem}; name a folder of its own, e.g. 'results'"
        )


@dataclass(frozen=True)
class Run:
    """One (target, variant, seed) with its resolved config and where it lives.

    ``policy``: for an evaluation run, what it evaluates (``base`` or a checkpoint folder);
    None for a training run, which evaluates its own rounds. ``keep_every``:
    ``workflow.keep_every`` (which rounds keep their checkpoint and rollout);
    ``rounds_per_job``: ``workflow.rounds_per_job`` (its blocks of rounds).
    """

    experiment: str
    variant: str
    seed: int
    config: RunConfig
    overrides: dict[str, Any]
    directory: str
    policy: str | None = None
    keep_every: int | None = None
    rounds_per_job: int = 1

    @property
    def run_id(self) -> str:
        """``experiment/variant/seed-s``: stable, unique, the run's folder below results."""
        return f"{self.experiment}/{self.variant}/seed-{self.seed}"

    @property
    def evaluated_rounds(self) -> list[int]:
        """Rounds trained before each evaluation (an evaluation run: only its policy, as 0)."""
        if self.policy is not None:
            return [0]
        return evaluated_rounds(self.config.train.rounds, self.config.eval.every)

    @property
    def kept_rounds(self) -> list[int]:
        """Training rounds whose checkpoint and rollout stay on disk (:func:`kept_rounds`)."""
        return [] if self.policy is not None else kept_rounds(self.config, self.keep_every)

    @property
    def blocks(self) -> list[range]:
        """The rounds of each block job, in order, ``workflow.rounds_per_job`` each.

        None when each round runs as its own jobs (``rounds_per_job`` 1) and for an
        evaluation run. See :func:`blocks`.
        """
        if self.policy is not None or self.rounds_per_job == 1:
            return []
        return blocks(self.config.train.rounds, self.rounds_per_job)

    def block_evaluations(self, block: range) -> list[int]:
        """The evaluations a block runs, as rounds trained before each.

        ``n`` past the block's first round up to its end (the policy it starts from is its
        predecessor's last), and the base policy (0) in the first block.
        """
        first = block.start
        return [n for n in self.evaluated_rounds if first < n <= block.stop or n == first == 0]


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
_FILE_SECTIONS = {**_sections(RunConfig), WORKFLOW_KEY: WorkflowConfig}


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


_EXPERIMENT_SECTIONS = _sections(RunConfig)


def _dotted(key: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``key`` ``"a.b"``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def check_name(where: str, name: str) -> None:
    """Refuse ``name`` (of the setting ``where``) unless it is one usable path component.

    That is a letter or digit, then letters, digits, '_', '-', '.', no '..', at most 120
    characters: nothing a shell, a glob or a path reads specially.
    """
    if not _NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{where}: {shown(name)} is not a usable name (it becomes a folder and a job "
            "name); use a letter or digit, then letters, digits, '_', '-', '.' (no '..', at "
            "most 120 characters)"
        )


def _check_labels(where: str, labels: Mapping[str, Any], what: str) -> None:
    if not labels:
        raise ConfigError(f"{where}: name at least one {what}")
    for label in labels:
        # A label with a line break in it would break the message's key; the value shows it.
        check_name(f"{where}.{label}" if label.isprintable() else where, label)


def _check_seeds(where: str, seeds: list[int]) -> None:
    if not seeds:
        raise ConfigError(f"{where}: name at least one seed")
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ConfigError(
            f"{where}: seed(s) {', '.join(map(str, repeated))} given twice (the same runs "
            "twice); list each seed once"
        )


def _refuse_seed(where: str, overrides: Mapping[str, Any], seed_key: str, seeds: str) -> None:
    """Refuse overrides that set the dotted ``seed_key``: each run's seed is one of ``seeds``."""
    node: Any = overrides
    *parents, leaf = seed_key.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, Mapping) else None
    if isinstance(node, Mapping) and leaf in node:
        raise ConfigError(
            f"{where}.{seed_key}: the seed of each run comes from {seeds}, so this would be "
            "ignored; list the seeds there (e.g. seeds: [0, 1, 2]) instead"
        )


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


def _variants(name: str, experiment: ExperimentConfig) -> dict[str, dict[str, Any]]:
    """Variant name -> its overrides (experiment overrides, variant, cross groups, sweep)."""
    where = f"{WORKFLOW_KEY}.experiments.{name}"
    seeds = f"{where}.seeds"
    _check_labels(f"{where}.variants", experiment.variants, "variant (e.g. base: {})")
    _check_seeds(seeds, experiment.seeds)
    _refuse_seed(f"{where}.overrides", experiment.overrides, "train.seed", seeds)
    for label, overrides in experiment.variants.items():
        _refuse_seed(f"{where}.variants.{label}", overrides, "train.seed", seeds)
    for group, entries in experiment.cross.items():
        _check_labels(f"{where}.cross.{group}", entries, "entry")
        for label, overrides in entries.items():
            _refuse_seed(f"{where}.cross.{group}.{label}", overrides, "train.seed", seeds)
    groups = [experiment.variants, *experiment.cross.values()]
    sweep = experiment.sweep
    if sweep is not None:
        groups.append(_sweep_group(f"{where}.sweep", sweep, seeds))
    return {
        name: _merge(experiment.overrides, overrides)
        for name, (_, overrides) in _crossed(where, groups).items()
    }


def _sweep_group(where: str, sweep: SweepConfig, seeds: str) -> dict[str, dict[str, Any]]:
    """The sweep as a group of labelled overrides: ``<leaf>-<value>`` -> the value at its key."""
    if sweep.key == "train.seed":
        raise ConfigError(
            f"{where}.key: train.seed is swept by {seeds} (each run's seed); list the seeds "
            "there (e.g. seeds: [0, 1, 2]) and drop the sweep"
        )
    if not sweep.values:
        raise ConfigError(f"{where}.values: an empty sweep runs nothing; give values")
    leaf = sweep.key.rsplit(".", 1)[-1]
    group: dict[str, dict[str, Any]] = {}
    for index, value in enumerate(sweep.values):
        label = f"{leaf}-{value}"
        if label in group:
            raise ConfigError(
                f"{where}.values[{index}]: {shown(value)} is given twice (the same runs twice); "
                "list each value once"
            )
        if isinstance(value, Mapping | list):
            raise ConfigError(
                f"{where}.values[{index}]: {shown(value)} is no name for a variant; sweep over "
                "single values, or give the settings names with a cross group "
                "(cross: {GROUP: {LABEL: {section: {key: value}}}})"
            )
        check_name(f"{where}.values[{index}]", label)
        group[label] = _dotted(sweep.key, value)
    return group


def _evaluation_variants(name: str, evaluation: EvaluationConfig) -> dict[str, tuple[str, dict]]:
    """Variant name (``<policy>_<prompts>``) -> (the policy, its overrides)."""
    where = f"{WORKFLOW_KEY}.evaluations.{name}"
    seeds = f"{where}.seeds"
    _check_labels(f"{where}.policies", evaluation.policies, "policy (e.g. base: {})")
    _check_labels(f"{where}.prompts", evaluation.prompts, "prompt set (e.g. heldout: {})")
    _check_seeds(seeds, evaluation.seeds)
    _refuse_seed(f"{where}.overrides", evaluation.overrides, "eval.seed", seeds)
    policies, overrides = {}, {}
    for label, entry in evaluation.policies.items():
        entry = dict(entry)
        policies[label] = str(entry.pop("checkpoint", None) or "base")
        overrides[label] = entry
        _refuse_seed(f"{where}.policies.{label}", entry, "eval.seed", seeds)
    metrics = {} if evaluation.metrics is None else {"eval": {"metrics": evaluation.metrics}}
    for label, entry in evaluation.prompts.items():
        _refuse_seed(f"{where}.prompts.{label}", entry, "seed", seeds)
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
    if not name.isidentifier():
        raise ConfigError(
            f"{where if name.isprintable() else f'{WORKFLOW_KEY}.{kind}'}: {shown(name)} is not "
            "a usable target name; use a letter, then letters, digits and '_'"
        )
    check_name(where, name)
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
        config = from_dict(RunConfig, merged)
    except ConfigError as err:
        raise ConfigError(f"{target}.variants.{variant} (base + overrides): {err}") from None
    name = target.rsplit(".", 1)[-1]
    directory = f"{workflow.results}/{name}/{variant}/seed-{seed}"
    return Run(
        name,
        variant,
        seed,
        config,
        overrides,
        directory,
        policy,
        workflow.keep_every,
        workflow.rounds_per_job,
    )


def resolve_runs(data: Mapping[str, Any]) -> dict[str, Run]:
    """Every run of every experiment and evaluation, by run id.

    Errors name the target, the variant and the key.
    """
    base, workflow = split(data)
    try:
        from_dict(RunConfig, base)
    except ConfigError as err:
        raise ConfigError(f"base sections: {err}") from None
    runs: dict[str, Run] = {}
    taken = _toyworld_folder(workflow)
    for name, experiment in workflow.experiments.items():
        check_target_name("experiments", name, taken)
        taken[name] = f"{WORKFLOW_KEY}.experiments.{name}"
        target = f"{WORKFLOW_KEY}.experiments.{name}"
        for variant, overrides in _variants(name, experiment).items():
            for seed in experiment.seeds:
                run = _resolve(base, workflow, target, variant, overrides, "train.seed", seed)
                runs[run.run_id] = run
        _refuse_twins(target, runs.values())
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
        _refuse_twins(target, runs.values())
    return runs


def _toyworld_folder(workflow: WorkflowConfig) -> dict[str, str]:
    """The folder under ``workflow.results`` holding ``workflow.toyworld.root``, if any.

    Returned as name -> the setting: no target may take that name.
    """
    inner = os.path.relpath(os.path.normpath(workflow.toyworld.root), workflow.results)
    first = inner.split(os.sep)[0]
    if first in (os.curdir, os.pardir):
        return {}
    return {first: f"{WORKFLOW_KEY}.toyworld.root ({workflow.toyworld.root})"}


def _refuse_twins(target: str, runs: Iterable[Run]) -> None:
    """Refuse two variants of ``target`` that resolve to the same config and policy.

    They would be the same runs twice: a sweep value given twice (as 1 and 1.0), an entry that
    changes nothing.
    """
    name = target.rsplit(".", 1)[-1]
    seen: dict[tuple[int, str | None, str], str] = {}
    for run in runs:
        if run.experiment != name:
            continue
        key = (run.seed, run.policy, digest(run.config))
        if key in seen and seen[key] != run.variant:
            raise ConfigError(
                f"{target}: the variants {seen[key]} and {run.variant} resolve to the same "
                "config (the same runs twice: a sweep value given twice, as 1 and 1.0, or "
                "an entry that changes nothing); remove one"
            )
        seen[key] = run.variant


def toyworld_inputs(config: RunConfig, root: str) -> dict[str, str]:
    """The toy-world builds (under ``root``, ``workflow.toyworld.root``) a config points at.

    ``toy_backbone`` when ``backbone.path`` is ``<root>/<family>``, ``toy_clip`` when a
    reward or metric in use is ``toy_clipscore`` with its model at ``<root>/clip``; nothing
    for real checkpoints.
    """
    inputs = {}
    backbone = Path(config.backbone.path)
    if backbone.parent == Path(root) and backbone.name == config.backbone.family:
        inputs["toy_backbone"] = str(backbone)
    used = {*config.rewards.weights, *config.eval.metrics}
    if "toy_clipscore" in used and Path(config.rewards.toy_clipscore.model) == Path(root, "clip"):
        inputs["toy_clip"] = f"{root}/clip"
    return inputs


def kept_rounds(config: RunConfig, keep_every: int | None) -> list[int]:
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
    kept |= {n - 1 for n in evaluated_rounds(rounds, config.eval.every) if n > 0}
    return sorted(kept | {rounds - 1})


def blocks(rounds: int, rounds_per_job: int) -> list[range]:
    """Rounds ``0 .. rounds - 1`` in consecutive blocks of ``rounds_per_job``.

    The last block is shorter when ``rounds_per_job`` does not divide ``rounds``.
    """
    return [
        range(first, min(first + rounds_per_job, rounds))
        for first in range(0, rounds, rounds_per_job)
    ]


def dag_recursion_limit(runs: Iterable[Run]) -> int:
    """A Python recursion limit under which Snakemake can build the DAG of ``runs``.

    Snakemake's ``DAG.update`` recurses a couple of frames per job along the longest chain
    of dependent jobs; a run's chain is one train (or block) job per round (per block). 1000
    rounds of single-round jobs needed 2100 (measured); this leaves room: 1000 + 4 per link.
    """
    longest = max(
        (len(run.blocks) or run.config.train.rounds for run in runs),
        default=0,
    )
    return 1000 + 4 * longest


def pool_key(config: RunConfig, source: str, column: str | None) -> str:
    """The short stable name of a prompt pool's conditioning (``<results>/conditioning/<key>``).

    A digest of the prompt source, its column and the backbone keys the text encoders read
    (``encode``'s :func:`~jagg_pipeline.io.manifest.stage_values`): runs that agree on all of
    them share one pool.
    """
    text = stage_values(config, "encode")
    return digest({"prompts": source, "column": column, "text": text})[:12]


def workflow_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of a workflow config: the package's sections + ``workflow``."""
    schema = json_schema(RunConfig)
    workflow = json_schema(WorkflowConfig)
    for key in ("$schema", "title"):
        workflow.pop(key)
    schema["properties"][WORKFLOW_KEY] = workflow
    schema["title"] = "jagg-pipeline workflow config"
    assert schema["$schema"] == SCHEMA_DIALECT
    return schema
