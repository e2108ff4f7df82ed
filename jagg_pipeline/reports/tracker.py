"""What a tracker is: the record pushed per run, the run read back, and the store's address.

:mod:`jagg_pipeline.reports.tracking` turns run folders into records and pushes them through a
:class:`Tracker`; :mod:`jagg_pipeline.reports.mlflow_store` is the MLflow one, :class:`NullTracker`
the one for ``tracking.backend: none``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from jagg_pipeline.config.run import TrackingConfig
from jagg_pipeline.support.errors import InputError

RUN_KEY_TAG = "jagg_run_key"
PARENT_TAG = "jagg_parent"
Point = tuple[str, float, int]  # (metric, value, step = round)


class TrackingError(InputError):
    """The tracker cannot be reached or read, or lost runs pushed to it.

    One line naming the store's URI (or SQLite file) and the fix.
    """


@dataclass
class RunRecord:
    """Everything pushed for one run (experiment, variant, seed)."""

    key: str
    experiment: str
    name: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: list[Point]
    artifacts: list[tuple[Path, str]] = field(default_factory=list)


@dataclass
class TrackedRun:
    """A run read back from a tracker: its tags and every metric point."""

    variant: str
    seed: int
    tags: dict[str, str]
    metrics: list[Point]


class Tracker(Protocol):
    """Where runs go: push them (idempotently) and read an experiment's runs back."""

    def push(self, record: RunRecord, parent_files: Sequence[Path] = ()) -> str: ...

    def runs(self, experiment: str) -> list[TrackedRun]: ...

    def missing(self, keys: Sequence[str]) -> list[str]: ...


class NullTracker:
    """``tracking.backend: none``: pushes nothing, has nothing."""

    def push(self, record: RunRecord, parent_files: Sequence[Path] = ()) -> str:
        return ""

    def runs(self, experiment: str) -> list[TrackedRun]:
        return []

    def missing(self, keys: Sequence[str]) -> list[str]:
        return []


def tracking_uri(config: TrackingConfig) -> str:
    """``MLFLOW_TRACKING_URI`` when set (a server for a cluster), else ``tracking.uri``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or config.uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URI (None for any other store)."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
