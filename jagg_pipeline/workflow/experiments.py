"""Experiments as data: the ``workflow`` section's experiments and evaluations, resolved into runs.

An experiment (``workflow.experiments.<name>``) is a set of variants (overrides of the base
sections, e.g. ``jagg: {mode: exact}``), crossed with named groups of overrides (``cross``) and
a sweep over one dotted key when given, each run for every seed; an evaluation
(``workflow.evaluations.<name>``) is policies x prompt sets x seeds, evaluated without training.
A run (:class:`~jagg_pipeline.workflow.runs.Run`) is one (target, variant, seed) with its fully
resolved :class:`~jagg_pipeline.config.run.RunConfig`, living in its folder of the run layout
(:mod:`jagg_pipeline.workflow.layout`). This module owns that resolution and refuses what would
run wrong: an unusable name (:mod:`jagg_pipeline.workflow.names`), seeds or sweep values given
twice, a seed set where ``seeds`` rules, two variants that are one config (what the runs' inputs
hold is checked by :mod:`jagg_pipeline.workflow.checks`). Torch-free: every Snakemake job parses
the Snakefile, which calls this.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from typing import Any

from jagg_pipeline.config.fields import ConfigError, digest, from_dict
from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.support.errors import shown
from jagg_pipeline.workflow.layout import run_directory
from jagg_pipeline.workflow.names import WORKFLOW_KEY, check_name, check_target_name
from jagg_pipeline.workflow.runs import Run
from jagg_pipeline.workflow.sections import (
    EvaluationConfig,
    ExperimentConfig,
    SweepConfig,
    WorkflowConfig,
    merge_experiment,
    split,
)


def _dotted(key: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for ``key`` ``"a.b"``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


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
            overrides = merge_experiment(overrides, layer)
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
        name: merge_experiment(experiment.overrides, overrides)
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
        name: (
            policies[labels[0]],
            merge_experiment(merge_experiment(evaluation.overrides, metrics), layered),
        )
        for name, (labels, layered) in _crossed(where, [overrides, prompts]).items()
    }


def _resolve(base, workflow, target, variant, overrides, seed_key, seed, policy=None) -> Run:
    merged = merge_experiment(merge_experiment(base, overrides), _dotted(seed_key, seed))
    try:
        config = from_dict(RunConfig, merged)
    except ConfigError as err:
        raise ConfigError(f"{target}.variants.{variant} (base + overrides): {err}") from None
    name = target.rsplit(".", 1)[-1]
    directory = run_directory(workflow.results, name, variant, seed)
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
