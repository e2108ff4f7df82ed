"""``config``: print the resolved run config, a template or the schemas; check a file.

``check`` validates a whole file (the workflow's config.yaml included) and reports every
error at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "print the resolved run config (YAML) or its JSON Schema; check a config file"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``config`` subcommand."""
    p = sub.add_parser(
        "config",
        help=HELP,
        description=(
            "'show' prints the run config with every default filled, after reading "
            "--config (if given) and applying --set overrides; unknown keys and wrong types "
            "fail naming the file and the key. A --config with a top-level workflow section "
            "(the workflow's config.yaml) gives its base experiment (the workflow section is "
            "checked, then set aside), as in every command. 'template' prints the same as "
            "YAML with every key's help as a comment. 'schema' prints the JSON Schema (draft "
            "2020-12) derived from the same dataclasses; with --workflow, the schema of the "
            "workflow's config.yaml (these sections plus the workflow section), which "
            "Snakemake validates against. 'check' validates the whole --config file, base "
            "sections and workflow section (every run of every experiment), and reports every "
            "error at once, one line each naming the file and the dotted key (exit 1), or "
            "summarises the experiments (exit 0)."
        ),
    )
    p.add_argument(
        "what", choices=("show", "template", "schema", "check"), help="what to print or check"
    )
    p.add_argument("--workflow", action="store_true", help="schema: of the workflow's config.yaml")
    p.add_argument("--config", type=Path, help="experiment YAML (default: built-in defaults)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one key (value parsed as YAML); repeatable",
    )
    p.add_argument("--out", type=Path, help="write to this file (atomically) instead of stdout")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.config.fields import ConfigError
    from jagg_pipeline.io.artifacts import atomic_write_text

    if args.what == "check":
        if args.config is None:
            print("error: config check: give the file with --config FILE", file=sys.stderr)
            return 2
        errors, summary = check_config(args.config, args.set)
        for line in errors:
            print(f"error: {line}", file=sys.stderr)
        if errors:
            print(f"{args.config}: {len(errors)} error(s)", file=sys.stderr)
            return 1
        text = "".join(f"{line}\n" for line in summary)
    else:
        try:
            text = _render(args)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.out:
        atomic_write_text(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


def _render(args: argparse.Namespace) -> str:
    """The text of ``show``, ``template`` or ``schema``."""
    import yaml

    from jagg_pipeline.cli.common import read_run_config
    from jagg_pipeline.config.fields import to_dict
    from jagg_pipeline.config.run import RunConfig, from_mapping, schema
    from jagg_pipeline.config.yaml_io import apply_overrides, commented_yaml
    from jagg_pipeline.workflow.sections import workflow_schema

    if args.what == "schema":
        return json.dumps(workflow_schema() if args.workflow else schema(), indent=2) + "\n"
    if args.config is not None:
        config = read_run_config(args.config, args.set)
    elif args.set:
        config = from_mapping(apply_overrides({}, args.set))
    else:
        config = RunConfig()
    data = to_dict(config)
    if args.what == "template":
        return commented_yaml(schema(), data)
    return yaml.safe_dump(data, sort_keys=False)


def check_config(path: Path, overrides: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """Every error of config file ``path`` (after ``--set`` overrides), and a summary.

    Returns ``(errors, summary)``: one line per error, each naming the file and the dotted key
    (empty: the file is good), and the lines that summarise a good file. In order: keys given
    twice (strict YAML); the JSON Schema of the workflow config (every violation, sorted by
    key), with each experiment's overrides, variants and sweep values checked against the base
    sections' schema; then the checks across fields (the dataclasses' ``__post_init__``) of
    the base sections and of every run of every experiment, for the parts the schema passed
    (the runs once the base sections pass: each run would repeat a base section's error);
    then what the runs name (prompt files, checkpoints and their settings, reward model files,
    evaluated rounds), as the workflow checks them
    (:func:`~jagg_pipeline.workflow.checks.check_runs`). A file without a ``workflow``
    section is a run config and checked as the base.
    """
    from jagg_pipeline.config.fields import ConfigError, from_dict
    from jagg_pipeline.config.run import RunConfig, schema
    from jagg_pipeline.config.schema import schema_errors
    from jagg_pipeline.config.yaml_io import apply_overrides, duplicate_keys, read_yaml
    from jagg_pipeline.workflow.checks import check_runs
    from jagg_pipeline.workflow.experiments import resolve_runs
    from jagg_pipeline.workflow.names import WORKFLOW_KEY
    from jagg_pipeline.workflow.sections import split, workflow_schema

    source = f"{path} (with --set {' '.join(overrides)})" if overrides else str(path)
    errors = duplicate_keys(path)
    try:
        # A duplicate key fails the strict read; the others are checked on the last value.
        data = read_yaml(path, duplicates_ok=bool(errors))
        data = apply_overrides(data or {}, overrides) if isinstance(data, dict | None) else data
    except ConfigError as err:
        return [*errors, str(err)], []
    if not isinstance(data, dict):
        return [*errors, f"{path}: the top level must be a mapping"], []

    # 1. The schema: the whole file, then what it leaves free-form (the targets' overrides).
    problems = schema_errors(workflow_schema(), data)
    targets = _targets(data.get(WORKFLOW_KEY))
    for (kind, name), target in targets.items():
        if isinstance(target, dict):
            where = f"{WORKFLOW_KEY}.{kind}.{name}"
            problems += _override_errors(where, kind, target, schema())
    errors += [f"{source}: {key}: {message}" for key, message in problems]
    bad_keys = [key for key, _ in problems]

    # 2. The checks across fields, of the parts the schema passed.
    def clean(prefix: str) -> bool:
        return not any(
            key == prefix or key.startswith((f"{prefix}.", f"{prefix}[")) for key in bad_keys
        )

    base = {key: value for key, value in data.items() if key != WORKFLOW_KEY}
    base_ok = all(clean(key) for key in base) and "(top level)" not in bad_keys
    if base_ok:
        try:
            from_dict(RunConfig, base, source=source)
        except ConfigError as err:
            errors.append(str(err))
            base_ok = False
    if WORKFLOW_KEY not in data:
        return errors, [] if errors else [f"{path}: OK (a run config: no workflow section)"]
    if base_ok:  # else every run would repeat the base sections' errors
        for (kind, name), target in targets.items():
            if clean(f"{WORKFLOW_KEY}.{kind}.{name}"):
                failures = _target_errors(base, kind, name, target, resolve_runs)
                errors += [f"{source}: {failure}" for failure in failures]
    if errors:
        return errors, []
    try:  # what holds across targets (names taken twice), and the runs to summarise
        runs = resolve_runs(data)
    except ConfigError as err:
        return [f"{source}: {err}"], []
    # What the runs name (files, checkpoint settings, evaluated rounds), as the workflow checks.
    problems = check_runs(runs.values(), split(data)[1])
    if problems:
        return [f"{source}: {problem}" for problem in problems], []
    return [], _summary(path, runs, targets)


def _targets(section: object) -> dict[tuple[str, str], object]:
    """(kind, name) -> data of each target (experiments, evaluations) of a workflow section."""
    if not isinstance(section, dict):
        return {}
    targets = {}
    for kind in _SPLIT_GROUP:
        named = section.get(kind)
        if isinstance(named, dict):
            targets.update({(kind, str(name)): target for name, target in named.items()})
    return targets


# Target kind -> the group of labelled overrides whose label leads each variant's name.
_SPLIT_GROUP = {"experiments": "variants", "evaluations": "policies"}


def _summary(path: Path, runs: dict, targets: dict) -> list[str]:
    """A good file's summary: each target's runs, variants and seeds."""
    lines = [f"{path}: OK: base sections, {len(targets)} target(s), {len(runs)} run(s)"]
    for kind, name in targets:
        mine = [run for run in runs.values() if run.experiment == name]
        variants = list(dict.fromkeys(run.variant for run in mine))
        seeds = list(dict.fromkeys(run.seed for run in mine))
        label = "" if kind == "experiments" else f" ({kind[:-1]})"
        lines.append(
            f"  {name}{label}: {len(mine)} run(s) = {len(variants)} variant(s) x "
            f"{len(seeds)} seed(s): {', '.join(variants)}"
        )
    return lines


def _override_errors(where: str, kind: str, target: dict, base: dict) -> list[tuple[str, str]]:
    """Schema errors of what a target layers on the base sections (``base``: their schema).

    The workflow schema leaves overrides free-form: an experiment's ``overrides``,
    ``variants``, ``cross`` entries and sweep values, an evaluation's ``overrides``,
    ``policies`` (less their ``checkpoint``) and ``prompts`` (overrides of ``eval``).
    """
    from jagg_pipeline.config.schema import schema_errors

    def named(group: object, where: str) -> list[tuple[str, object]]:
        if not isinstance(group, dict):
            return []
        return [(f"{where}.{label}", value) for label, value in group.items()]

    parts: list[tuple[str, object]] = [("overrides", target.get("overrides"))]
    if kind == "experiments":
        parts += named(target.get("variants"), "variants")
        cross = target.get("cross")
        for group, entries in cross.items() if isinstance(cross, dict) else ():
            parts += named(entries, f"cross.{group}")
    else:
        policies = named(target.get("policies"), "policies")
        parts += [
            (part, {k: v for k, v in value.items() if k != "checkpoint"})
            for part, value in policies
            if isinstance(value, dict)
        ]
    problems = []
    for part, value in parts:
        if isinstance(value, dict):
            problems += [
                (f"{where}.{part}.{key}", message) for key, message in schema_errors(base, value)
            ]
    if kind == "evaluations":  # a prompt set overrides the eval section
        for part, value in named(target.get("prompts"), "prompts"):
            if isinstance(value, dict):
                problems += [
                    (f"{where}.{part}.{key.removeprefix('eval.')}", message)
                    for key, message in schema_errors(base, {"eval": value})
                ]
    sweep = target.get("sweep")
    if isinstance(sweep, dict) and isinstance(sweep.get("key"), str):
        values = sweep.get("values")
        for index, value in enumerate(values if isinstance(values, list) else []):
            nested: object = value
            for part in reversed(sweep["key"].split(".")):
                nested = {part: nested}
            for key, message in schema_errors(base, nested):
                if message.startswith("unknown key"):
                    problems.append((f"{where}.sweep.key", f"{key}: {message}"))
                else:
                    problems.append((f"{where}.sweep.values[{index}]", f"{key}: {message}"))
    return sorted(set(problems), key=lambda problem: problem[0])


def _target_errors(
    base: dict, kind: str, name: str, target: object, resolve_runs: Callable
) -> list[str]:
    """The errors of one target's runs: each failing variant's first.

    :func:`~jagg_pipeline.workflow.experiments.resolve_runs` stops at a config's first error, so it
    is
    run on the base sections with only this target, and, when one of its runs fails, once per
    entry of its leading group (an experiment's variants, an evaluation's policies) to name
    every one that fails.
    """
    import copy

    from jagg_pipeline.config.fields import ConfigError
    from jagg_pipeline.workflow.names import WORKFLOW_KEY

    def first_error(trimmed: object) -> str | None:
        # The rest of the workflow section does not change a run (its errors are the schema's).
        data = copy.deepcopy({**base, WORKFLOW_KEY: {kind: {name: trimmed}}})
        try:
            resolve_runs(data)
        except ConfigError as err:
            return str(err)
        return None

    first = first_error(target)
    if first is None:
        return []
    where = f"{WORKFLOW_KEY}.{kind}.{name}.variants."
    group = target.get(_SPLIT_GROUP[kind]) if isinstance(target, dict) else None
    if not (first.startswith(where) and isinstance(group, dict) and len(group) > 1):
        return [first]  # not one run's error (or nothing to split)
    failures: dict[str, None] = {}
    for label, entry in group.items():
        message = first_error({**target, _SPLIT_GROUP[kind]: {label: entry}})
        if message is None:
            continue
        if message.startswith(where):
            # Alone, the entry's label drops out of the variant's name; among the others it
            # leads it, joined by '_'.
            alone = message[len(where) :].split(" ", 1)[0]
            shown = label if alone == label else f"{label}_{alone}"
            message = where + shown + message[len(where) + len(alone) :]
        failures[message] = None
    return list(failures) or [first]
