"""The MLflow tracker: the only module of the package that imports mlflow.

Layout: one MLflow experiment per ``tracking.experiment``; in it a parent run per workflow
target (tag ``jagg_parent``) and one child run per variant and seed (tag ``jagg_run_key``).
Pushing is idempotent: runs are found by their tags, params are set once, and only metric
points (key, step) not yet in the run are logged. Two processes pushing different runs at
once are safe: experiment creation tolerates losing the race, and when two parents of one
target appear the oldest wins and the other is deleted. A ``sqlite:`` store is additionally
serialised with a file lock beside the database (SQLite allows one writer; on a shared
filesystem across nodes use a server instead).
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from mlflow.entities import Metric, Param, RunStatus, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from jagg_pipeline.tracking import PARENT_TAG, RUN_KEY_TAG, RunRecord, TrackedRun

# MLflow's limits per log_batch call.
BATCH_METRICS = 1000
BATCH_PARAMS = 100
PARENT_TAGS = ("jagg_version", "snakemake_target", "git_commit")


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


class MlflowTracker:
    """Pushes :class:`RunRecord` s to, and reads runs back from, one MLflow experiment."""

    def __init__(self, uri: str, experiment: str) -> None:
        self.uri = uri
        self.database = _sqlite_file(uri)
        if self.database is not None:
            self.database.parent.mkdir(parents=True, exist_ok=True)
        # A new SQLite store migrates its schema on first use: one process at a time.
        with self._lock():
            self.client = MlflowClient(tracking_uri=uri)
            self.experiment_id = self._experiment(experiment)

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

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
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
        return self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.{tag} = '{value}'",
            run_view_type=ViewType.ACTIVE_ONLY,
            order_by=["attributes.start_time ASC"],
            max_results=1000,
        )

    def _parent(self, record: RunRecord) -> str:
        runs = self._search(PARENT_TAG, record.target)
        if not runs:
            tags = {PARENT_TAG: record.target, "jagg_target": record.target}
            tags |= {k: record.tags[k] for k in PARENT_TAGS if k in record.tags}
            self.client.create_run(self.experiment_id, tags=tags, run_name=record.target)
            runs = self._search(PARENT_TAG, record.target)
        winner, *losers = sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))
        for loser in losers:  # a concurrent push created one too
            with contextlib.suppress(MlflowException):
                self.client.delete_run(loser.info.run_id)
        return winner.info.run_id

    def _child(self, record: RunRecord, parent: str) -> str:
        runs = self._search(RUN_KEY_TAG, record.key)
        if runs:
            return runs[0].info.run_id
        tags = {**record.tags, "mlflow.parentRunId": parent}
        return self.client.create_run(
            self.experiment_id, tags=tags, run_name=record.name
        ).info.run_id

    def _new_points(self, run_id: str, record: RunRecord) -> list[Metric]:
        logged: set[tuple[str, int]] = set()
        for key in {name for name, _, _ in record.metrics}:
            logged |= {(key, m.step) for m in self.client.get_metric_history(run_id, key)}
        now = int(time.time() * 1000)
        return [
            Metric(key, value, now, step)
            for key, value, step in record.metrics
            if (key, step) not in logged
        ]

    def push(self, record: RunRecord, parent_files: Sequence[Path] = ()) -> str:
        """Create or update the run of ``record`` under its target's parent; its run id."""
        with self._lock():
            parent = self._parent(record)
            run_id = self._child(record, parent)
            run = self.client.get_run(run_id)
            params = [Param(k, v) for k, v in record.params.items() if k not in run.data.params]
            tags = [RunTag(k, v) for k, v in record.tags.items() if run.data.tags.get(k) != v]
            points = self._new_points(run_id, record)
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

    def runs(self, target: str) -> list[TrackedRun]:
        """Every child run of ``target``'s parent, with all its metric points."""
        parents = self._search(PARENT_TAG, target)
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

    def artifacts(self, run_id: str, path: str = "") -> list[str]:
        """Paths of the artifacts under ``path`` of a run (recursively)."""
        found = []
        for item in self.client.list_artifacts(run_id, path or None):
            found += self.artifacts(run_id, item.path) if item.is_dir else [item.path]
        return found
