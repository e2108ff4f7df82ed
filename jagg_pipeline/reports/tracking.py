"""Experiment tracking: a run's finished stage folders pushed to a tracker, and read back.

Stages never track anything: the workflow's ``track`` rule calls :func:`track_runs` once the
runs are finished. A run becomes a :class:`RunRecord` (params = the flattened resolved config,
tags, metrics with step = round, artifacts), which a tracker pushes idempotently: the run is
found again by its ``jagg_run_key`` tag (experiment/variant/seed@config digest), metric points
already there are not logged twice. :func:`open_tracker` gives the MLflow tracker
(:mod:`jagg_pipeline.reports.mlflow_store`, the only module that imports mlflow) or, for
``tracking.backend: none``, :class:`NullTracker`, which imports nothing.

Metric names are ``<stage>/<key>`` of the stages' metrics.jsonl lines (rollout, score,
evaluate: one line per round; train: one line per optimizer step, folded into one value per
round: times and call counts summed, the rest averaged), so :func:`lines_from_points` turns
them back into the lines :mod:`jagg_pipeline.reports.summary` reads: the comparison is computed the
same way from MLflow as from the files.

What goes wrong is one :class:`TrackingError` line naming the store (its URI, or its SQLite
file): a server that cannot be reached (within seconds, not MLflow's minutes of retries), a
store that cannot be read, and a store that lost runs pushed to it before: :func:`track_runs`
keeps a ledger of what it pushed where (``track``: ``pushed.json`` beside its ``--out``), so
an emptied or replaced store is reported instead of silently filled anew.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from jagg_pipeline import __version__
from jagg_pipeline.config.fields import digest
from jagg_pipeline.config.run import TrackingConfig
from jagg_pipeline.io.artifacts import atomic_write_json, evaluation_name
from jagg_pipeline.reports.summary import RunMetrics, read_run
from jagg_pipeline.reports.tracker import (
    RUN_KEY_TAG,
    NullTracker,
    Point,
    RunRecord,
    TrackedRun,
    Tracker,
    TrackingError,
    tracking_uri,
)
from jagg_pipeline.workflow.layout import run_id, variant_seed

# Train keys summed over a round's optimizer steps (the rest are averaged).
SUMMED = re.compile(
    r"^(time\.|backward_calls$|network_calls$|samples$|windows\.\d+\.backward_calls$)"
)
# Flattened structure, not measurements.
SKIPPED = re.compile(
    r"^(global_step|skipped_steps|windows\.\d+\.(window|steps\.\d+)"
    r"|probe\.\d+\.(index|steps\.\d+|interval\.\d+|sigma_start|sigma_end))$"
)


def open_tracker(config: TrackingConfig, create: bool = True) -> Tracker:
    """The tracker of ``config`` (mlflow is imported only for ``backend: mlflow``).

    ``create``: start the store and the experiment where there are none yet (``track``);
    without it (``compare``), a store or an experiment that is not there has no runs, and
    nothing is written.
    """
    if config.backend == "none":
        return NullTracker()
    from jagg_pipeline.reports.mlflow_store import MlflowTracker

    return MlflowTracker(tracking_uri(config), config.mlflow_experiment, create)


def _flat(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            _flat(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = json.dumps(value) if not isinstance(value, str) else value


def flat_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The resolved config as ``dotted.key -> value`` strings (MLflow params)."""
    out: dict[str, str] = {}
    _flat(config, "", out)
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def metric_points(run: RunMetrics) -> list[Point]:
    """``(stage/key, value, round)`` for every numeric metric of the run's lines."""
    points: list[Point] = []
    per_round: dict[tuple[str, int], list[float]] = {}
    for line in run.lines:
        stage, round_index = line["stage"], line["round"]
        if round_index is None:
            continue
        for key, value in line.items():
            number = _number(value)
            if key in ("stage", "round", "step") or number is None or SKIPPED.match(key):
                continue
            if stage == "train":
                per_round.setdefault((key, round_index), []).append(number)
            else:
                points.append((f"{stage}/{key}", number, round_index))
    for (key, round_index), values in per_round.items():
        value = sum(values) if SUMMED.match(key) else statistics.fmean(values)
        points.append((f"train/{key}", value, round_index))
    return sorted(points, key=lambda p: (p[0], p[2]))


def lines_from_points(points: Iterable[Point]) -> list[dict[str, Any]]:
    """The inverse of :func:`metric_points`: one metrics line per (stage, round)."""
    lines: dict[tuple[str, int], dict[str, Any]] = {}
    for name, value, step in points:
        stage, key = name.split("/", 1)
        line = lines.setdefault((stage, step), {"stage": stage, "round": step, "step": 0})
        line[key] = value
    return [lines[k] for k in sorted(lines)]


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _run_config(directory: str | Path) -> dict[str, Any]:
    """The resolved ``config.yaml`` of the run in ``directory``, as plain data."""
    return yaml.safe_load((Path(directory) / "config.yaml").read_text()) or {}


def _key(config: Mapping[str, Any], experiment: str, variant: str, seed: int) -> str:
    return f"{run_id(experiment, variant, seed)}@{digest(config)[:12]}"


def run_key(directory: str | Path, experiment: str, variant: str, seed: int) -> str:
    """A run's identity in the tracker: ``experiment/variant/seed-s@<config digest>``.

    An edited variant is a new run; the old one stays in the tracker for comparison.
    """
    return _key(_run_config(directory), experiment, variant, seed)


def run_record(
    directory: str | Path, experiment: str, variant: str, seed: int, snakemake_target: str = ""
) -> RunRecord:
    """What is pushed for the run in ``directory`` (its resolved ``config.yaml`` included)."""
    directory = Path(directory)
    config = _run_config(directory)
    overrides_file = directory / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else {}
    key = _key(config, experiment, variant, seed)
    metrics = read_run(directory, variant, seed)
    tags = {
        RUN_KEY_TAG: key,
        "jagg_target": experiment,
        "jagg_variant": variant,
        "jagg_seed": str(seed),
        "jagg_overrides": json.dumps(overrides, sort_keys=True),
        "jagg_mode": metrics.mode,
        "jagg_setting": metrics.setting,
        "jagg_version": __version__,
        "snakemake_target": snakemake_target or experiment,
    }
    if commit := _git_commit():
        tags["git_commit"] = commit
    if job := os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = job
    artifacts = [(directory / "config.yaml", "")]
    artifacts += [(grid, f"eval/{evaluation_name(n)}") for n, grid in sorted(metrics.grids.items())]
    return RunRecord(
        key=key,
        experiment=experiment,
        name=variant_seed(variant, seed),
        params=flat_params(config),
        tags=tags,
        metrics=metric_points(metrics),
        artifacts=[(path, where) for path, where in artifacts if path.is_file()],
    )


def run_metrics(run: TrackedRun) -> RunMetrics:
    """A tracked run as :mod:`jagg_pipeline.reports.summary` reads runs from their folders."""
    metrics = RunMetrics(
        run.variant,
        run.seed,
        lines_from_points(run.metrics),
        mode=run.tags.get("jagg_mode", ""),
        setting=run.tags.get("jagg_setting", ""),
    )
    for line in metrics.stage("evaluate"):
        # The line's time.* keys are the stage's seconds (jagg_pipeline.support.startup), not
        # metrics.
        metrics.evaluations[line["round"]] = {
            key: value
            for key, value in line.items()
            if key not in ("stage", "round", "step")
            and not key.endswith("_std")
            and not key.startswith("time.")
        }
    return metrics


def tracking_of(directories: Sequence[str | Path]) -> TrackingConfig:
    """The one ``tracking`` section of the runs in ``directories`` (they must agree)."""
    from jagg_pipeline.config.fields import ConfigError, from_dict

    sections = {json.dumps(_run_config(d).get("tracking") or {}) for d in directories}
    if len(sections) != 1:
        raise ConfigError(f"tracking: the runs disagree ({' vs '.join(sorted(sections))})")
    return from_dict(TrackingConfig, json.loads(sections.pop()), prefix="tracking")


def _read_ledger(path: Path | None, uri: str, mlflow_experiment: str) -> dict[str, str]:
    """Run key -> run id of each run pushed to ``mlflow_experiment`` at ``uri`` (``path``)."""
    if path is None or not path.is_file():
        return {}
    try:
        ledger = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TrackingError(
            f"{path}: not a JSON ledger ({err.msg}); delete it (the next push then trusts the "
            "store as it is)"
        ) from None
    return dict(ledger.get(uri, {}).get(mlflow_experiment, {}))


def _write_ledger(path: Path, uri: str, mlflow_experiment: str, pushed: Mapping[str, str]) -> None:
    ledger = json.loads(path.read_text()) if path.is_file() else {}
    ledger.setdefault(uri, {}).setdefault(mlflow_experiment, {}).update(pushed)
    atomic_write_json(path, ledger)


def track_runs(
    runs: Sequence[tuple[str, int, str | Path]],
    experiment: str,
    parent_files: Sequence[Path] = (),
    snakemake_target: str = "",
    ledger: Path | None = None,
) -> dict[str, str]:
    """Push ``runs`` ((variant, seed, directory) of one experiment); run key -> tracker run id.

    Every run is read first (a run with a gap is refused before anything is pushed). With a
    ``ledger`` (a JSON file, kept across failed pushes), a run that was pushed to the same
    store before and is gone from it is a :class:`TrackingError`, and each pushed run is
    recorded there.
    """
    tracking = tracking_of([d for _, _, d in runs])
    records = [
        run_record(directory, experiment, variant, seed, snakemake_target)
        for variant, seed, directory in runs
    ]
    uri, mlflow_experiment = tracking_uri(tracking), tracking.mlflow_experiment
    if tracking.backend == "none":
        ledger = None
    expected = [r.key for r in records if r.key in _read_ledger(ledger, uri, mlflow_experiment)]
    # A store that lost them is not started anew: no new SQLite file, no new experiment.
    tracker = open_tracker(tracking, create=not expected)
    lost = tracker.missing(expected)
    if lost:
        raise TrackingError(
            f"MLflow store {uri}, experiment {mlflow_experiment!r}: {len(lost)} run(s) pushed "
            f"there before are gone ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}; "
            f"ledger {ledger}): the store was emptied or replaced. Restore it (or point "
            f"tracking.uri / MLFLOW_TRACKING_URI at the right one), or delete {ledger} to push "
            "every run into this store anew"
        )
    pushed = {}
    for record in records:
        pushed[record.key] = tracker.push(record, parent_files)
        if ledger is not None:
            _write_ledger(ledger, uri, mlflow_experiment, {record.key: pushed[record.key]})
    return pushed
