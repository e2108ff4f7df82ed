"""The MLflow tracker: the only module of the package that imports mlflow.

Layout: one MLflow experiment per ``tracking.mlflow_experiment``; in it a parent run per workflow
experiment (tag ``jagg_parent``) and one child run per variant and seed (tag ``jagg_run_key``).
Pushing is idempotent: runs are found by their tags, params are set once, and only metric
points (key, step) not yet in the run are logged. Two processes pushing different runs at
once are safe: experiment creation tolerates losing the race, and when two parents of one
experiment appear the oldest wins and the other is deleted. A ``sqlite:`` store is additionally
serialised with a file lock beside the database (SQLite allows one writer; on a shared
filesystem across nodes use a server instead).

A run whose files changed since it was pushed (a rerun: other timings, other values) is
replaced: the old MLflow run is deleted and a new one holds what the files hold now, so the
comparison read back from MLflow and the summary read from the files never disagree. Every
failure of the store is one :class:`~jagg_pipeline.reports.tracker.TrackingError` line naming it; a
server that cannot be reached fails within about 25 s (MLflow's own HTTP defaults retry for
minutes; its environment variables still win when set).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import requests
from mlflow.entities import Metric, Param, RunStatus, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from sqlalchemy.exc import SQLAlchemyError

from jagg_pipeline.reports.tracker import (
    PARENT_TAG,
    RUN_KEY_TAG,
    RunRecord,
    TrackedRun,
    TrackingError,
    sqlite_file,
)

# MLflow's limits per log_batch call.
BATCH_METRICS = 1000
BATCH_PARAMS = 100
# Runs per search request (MLflow's default page).
SEARCH_PAGE = 1000
PARENT_TAGS = ("jagg_version", "snakemake_target", "git_commit")
# Three tries of at most 5 s each, 1 + 2 s apart: a server that refuses connections fails
# `track` in about 5 s, one that never answers in about 25 s (MLflow's defaults: 7 retries,
# 120 s timeout, minutes). A single request of `track` takes well under a second.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}
# What a store that cannot be reached or read raises.
STORE_ERRORS = (MlflowException, SQLAlchemyError, requests.RequestException)
REPLACES_TAG = "jagg_replaces"
# The part of a failed request's long message that says why.
OS_REASON = re.compile(r"\[Errno -?\d+\] [^'\")]+|Read timed out\. \(read timeout=[\d.]+\)")


def _cause(err: BaseException) -> str:
    """The gist of a store error in one short line: the OS error or the timeout if any."""
    text = str(err)
    reason = OS_REASON.search(text)
    if reason:
        return reason.group(0)
    first = (text.strip().splitlines() or [type(err).__name__])[0]
    return first if len(first) <= 240 else first[:240] + "..."


class MlflowTracker:
    """Pushes :class:`RunRecord` s to, and reads runs back from, one MLflow experiment.

    ``create``: make the SQLite file and the experiment when missing; without it a store or
    experiment that is not there has no runs (and nothing is written).
    """

    def __init__(self, uri: str, mlflow_experiment: str, create: bool = True) -> None:
        self.uri = uri
        self.name = mlflow_experiment
        self.database = sqlite_file(uri)
        self.client: MlflowClient | None = None
        self.experiment_id: str | None = None
        if self.database is None:
            for name, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(name, value)
        elif self.database.is_file() and self.database.stat().st_size == 0:
            raise TrackingError(
                f"{self.database}: empty (0 bytes), not an MLflow store: a store that held "
                "runs was truncated or replaced. Restore it from a backup, or delete it to "
                "start a new store"
            )
        elif not self.database.is_file() and not create:
            return
        elif create:
            self.database.parent.mkdir(parents=True, exist_ok=True)
        # A new SQLite store migrates its schema on first use: one process at a time.
        with self._lock(), self._store_errors():
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(mlflow_experiment)
            if found is not None:
                self.experiment_id = found.experiment_id
            elif create:
                self.experiment_id = self._create_experiment(mlflow_experiment)

    @contextlib.contextmanager
    def _store_errors(self) -> Iterator[None]:
        """Turn a store that cannot be reached or read into one line naming it."""
        try:
            yield
        except STORE_ERRORS as err:
            if self.database is not None:
                where = f"{self.database}: the SQLite MLflow store (tracking.uri {self.uri})"
                fix = (
                    "if the file is damaged, restore it from a backup, or move it aside to "
                    "start a new store"
                )
            else:
                where = f"MLflow tracking server {self.uri}"
                fix = (
                    "check that it runs and is reachable from here, or point tracking.uri "
                    "(or MLFLOW_TRACKING_URI) at one that is"
                )
            raise TrackingError(f"{where} cannot be used ({_cause(err)}); {fix}") from None

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        if self.database is None:
            yield
            return
        with open(f"{self.database}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _create_experiment(self, name: str) -> str:
        # A local store keeps artifacts beside its database (not in ./mlruns of whatever
        # directory a job runs in); a server decides for itself.
        location = None
        if self.database is not None:
            location = (self.database.parent / "mlartifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:  # another process created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def _search(self, tag: str, value: str) -> list:
        """Every active run of the experiment whose ``tag`` is ``value``, oldest first.

        Page by page: one search returns at most a page, silently leaving out the rest.
        """
        if self.experiment_id is None:  # no store or no experiment: no runs
            return []
        found, token = [], None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.{tag} = '{value}'",
                run_view_type=ViewType.ACTIVE_ONLY,
                order_by=["attributes.start_time ASC"],
                max_results=SEARCH_PAGE,
                page_token=token,
            )
            found += page
            token = page.token
            if not token:
                return found

    def _parent(self, record: RunRecord) -> str:
        runs = self._search(PARENT_TAG, record.experiment)
        if not runs:
            tags = {PARENT_TAG: record.experiment, "jagg_target": record.experiment}
            tags |= {k: record.tags[k] for k in PARENT_TAGS if k in record.tags}
            self.client.create_run(self.experiment_id, tags=tags, run_name=record.experiment)
            runs = self._search(PARENT_TAG, record.experiment)
        winner, *losers = sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))
        for loser in losers:  # a concurrent push created one too
            with contextlib.suppress(MlflowException):
                self.client.delete_run(loser.info.run_id)
        return winner.info.run_id

    def _new_child(self, record: RunRecord, parent: str, replaces: str = "") -> Any:
        tags = {**record.tags, "mlflow.parentRunId": parent}
        if replaces:
            tags[REPLACES_TAG] = replaces
        return self.client.create_run(self.experiment_id, tags=tags, run_name=record.name)

    def _logged(self, run: Any, record: RunRecord) -> dict[tuple[str, int], list[float]]:
        """Every metric point of ``run`` (its keys and ``record``'s), values by (key, step)."""
        logged: dict[tuple[str, int], list[float]] = {}
        for key in {name for name, _, _ in record.metrics} | set(run.data.metrics):
            for m in self.client.get_metric_history(run.info.run_id, key):
                logged.setdefault((key, m.step), []).append(m.value)
        return logged

    @staticmethod
    def _changed(run: Any, record: RunRecord, logged: dict) -> str | None:
        """What ``run`` holds that ``record`` (the files now) does not, or None.

        Points the record adds are not a change: they are logged into the same run.
        """
        for key, value in sorted(run.data.params.items()):
            if record.params.get(key) != value:
                return f"param {key}"
        wanted = {(key, step): value for key, value, step in record.metrics}
        for (key, step), values in sorted(logged.items()):
            if any(value != wanted.get((key, step)) for value in values):
                return f"metric {key} at round {step}"
        return None

    def push(self, record: RunRecord, parent_files: Sequence[Path] = ()) -> str:
        """Create or update the run of ``record`` under its experiment's parent; its run id.

        A run whose logged params or points differ from ``record`` is replaced by a new one.
        """
        with self._lock(), self._store_errors():
            if self.experiment_id is None:
                self.experiment_id = self._create_experiment(self.name)
            parent = self._parent(record)
            found = self._search(RUN_KEY_TAG, record.key)
            run = self.client.get_run(found[0].info.run_id) if found else None
            logged = self._logged(run, record) if run else {}
            changed = self._changed(run, record, logged) if run else None
            if run is None or changed:
                replaces = run.info.run_id if run else ""
                if run is not None:
                    self.client.delete_run(replaces)
                    print(
                        f"{record.name}: its files changed since MLflow run {replaces} was "
                        f"pushed ({changed} differs): that run is deleted, a new one replaces "
                        "it",
                        file=sys.stderr,
                    )
                run, logged = self._new_child(record, parent, replaces), {}
            run_id = run.info.run_id
            params = [Param(k, v) for k, v in record.params.items() if k not in run.data.params]
            tags = [RunTag(k, v) for k, v in record.tags.items() if run.data.tags.get(k) != v]
            now = int(time.time() * 1000)
            points = [
                Metric(key, value, now, step)
                for key, value, step in record.metrics
                if (key, step) not in logged
            ]
            for start in range(0, max(len(params), len(tags)), BATCH_PARAMS):
                chunk = slice(start, start + BATCH_PARAMS)
                self.client.log_batch(run_id, params=params[chunk], tags=tags[chunk])
            for start in range(0, len(points), BATCH_METRICS):
                self.client.log_batch(run_id, metrics=points[start : start + BATCH_METRICS])
            for path, where in record.artifacts:
                self.client.log_artifact(run_id, str(path), where or None)
            for path in parent_files:
                self.client.log_artifact(parent, str(path))
            self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
            self.client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED))
        return run_id

    def runs(self, experiment: str) -> list[TrackedRun]:
        """Every child run of ``experiment``'s parent, with all its metric points."""
        with self._store_errors():
            parents = self._search(PARENT_TAG, experiment)
            if not parents:
                return []
            children = self._search("mlflow.parentRunId", parents[0].info.run_id)
            tracked = []
            for run in children:
                points = [
                    (key, m.value, m.step)
                    for key in run.data.metrics
                    for m in self.client.get_metric_history(run.info.run_id, key)
                ]
                tags = run.data.tags
                tracked.append(
                    TrackedRun(tags["jagg_variant"], int(tags["jagg_seed"]), dict(tags), points)
                )
        return tracked

    def missing(self, keys: Sequence[str]) -> list[str]:
        """The run keys of ``keys`` that no active run of the experiment carries."""
        with self._store_errors():
            return [key for key in keys if not self._search(RUN_KEY_TAG, key)]

    def artifacts(self, run_id: str, path: str = "") -> list[str]:
        """Paths of the artifacts under ``path`` of a run (recursively)."""
        found = []
        with self._store_errors():
            for item in self.client.list_artifacts(run_id, path or None):
                found += self.artifacts(run_id, item.path) if item.is_dir else [item.path]
        return found
