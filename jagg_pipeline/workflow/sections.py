"""The ``workflow`` section of a config, and how config data is layered.

The Snakemake workflow's config is the package's sections (the *base* experiment) plus a
``workflow`` section (:class:`WorkflowConfig`): where results go, the toy world, the
experiments and evaluations the targets run (:mod:`jagg_pipeline.workflow.experiments` resolves
them into runs), the images, retention and blocks of rounds. :func:`merge` layers config data:
sections merge key by key, every other value, a mapping of reward weights included, replaces.
:func:`workflow_schema` is the JSON Schema of a whole workflow config. Torch-free: every
Snakemake job parses the Snakefile, which reads this.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints

from jagg_pipeline.config.fields import ConfigError, field, from_dict
from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.config.schema import SCHEMA_DIALECT, json_schema
from jagg_pipeline.support.errors import shown
from jagg_pipeline.workflow.names import WORKFLOW_KEY


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
        help="the stages' image (toyworld, rollout, encode, score, train, evaluate, bench), "
        "for --sdm apptainer: `make images` builds it and links it here; a .sif, a sandbox "
        "folder or a docker:// address",
    )
    summary: str = field(
        "containers/summary.sif",
        help="the comparison's image (summary, track, compare), torch-free: `make images` "
        "builds it and links it here",
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


_EXPERIMENT_SECTIONS = _sections(RunConfig)


def merge_experiment(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Experiment data (the base sections, overrides) layered as :func:`merge` does."""
    return merge(base, overrides, _EXPERIMENT_SECTIONS)


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
