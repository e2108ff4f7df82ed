"""Audit finished outputs at rest: every manifest under a folder, every file it lists, re-hashed.

Stages verify what they read when they read it (:mod:`jagg_pipeline.io.verify`), but a kept
file that rots between runs (a flipped byte, a truncated shard, a lost manifest) is found
only when something reads it: Snakemake sees the file present and calls the target done.
:func:`audit` looks instead of waiting: it finds every stage output under the given paths
(a folder with ``manifest.json``, a file with ``FILE.manifest.json``), re-hashes every data
file its manifest lists, in parallel, and reports each problem naming the file: missing,
changed since it was written, present but unlisted, a manifest that cannot be read, an
output whose manifest is gone (its resolved ``config.yaml`` and ``metrics.jsonl`` remain),
and a consumer whose recorded input digest no longer matches that input (made from bytes the
input no longer holds). It reads only: nothing is moved, rewritten or deleted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jagg_pipeline.io.artifacts import METRICS_NAME
from jagg_pipeline.io.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    ManifestError,
    data_files,
    digest_path,
    file_digest,
    manifest_algorithm,
    manifest_path,
)

FILE_MANIFEST_SUFFIX = ".manifest.json"


@dataclass(frozen=True)
class Problem:
    """One finding: the file (or output) it is about, the output it belongs to, and why."""

    path: Path
    output: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class Audit:
    """What :func:`audit` checked and found."""

    outputs: tuple[Path, ...]
    files: int
    bytes: int
    problems: tuple[Problem, ...]
    # Outputs whose manifest lists no digests (written before files were recorded): nothing
    # to check them against, which is not a fault of theirs.
    unverifiable: tuple[Problem, ...] = ()

    @property
    def bad_outputs(self) -> tuple[Path, ...]:
        """The outputs with at least one problem, each once, in path order."""
        return tuple(sorted({p.output for p in self.problems}))


@dataclass(frozen=True)
class _Check:
    """One listed file to re-hash against its manifest's digest."""

    file: Path
    output: Path
    algorithm: str
    expected: str
    size: int


def find_outputs(paths: Iterable[str | Path]) -> tuple[list[Path], list[Problem]]:
    """Every stage output at or under ``paths``, and the outputs whose manifest is gone.

    A folder output is one holding ``manifest.json``; a file output is ``FILE`` beside
    ``FILE.manifest.json``. A folder holding the resolved ``config.yaml`` and
    ``metrics.jsonl`` of a stage but no manifest was finished once and lost it (or is being
    rewritten now): no stage reads it, yet Snakemake takes it as done.
    """
    outputs: set[Path] = set()
    lost: list[Problem] = []
    for top in map(Path, paths):
        if not top.exists():
            raise FileNotFoundError(f"{top}: no such file or folder to verify")
        if (enclosing := _enclosing_output(top)) is not None:
            outputs.add(enclosing)
            continue
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            here = Path(folder)
            names = set(files)
            if MANIFEST_NAME in names:
                outputs.add(here)
            elif CONFIG_NAME in names and METRICS_NAME in names:
                lost.append(
                    Problem(
                        here / MANIFEST_NAME,
                        here,
                        "missing: this output was finished once (its config.yaml and "
                        "metrics.jsonl are here) and no stage will read it without its manifest",
                    )
                )
            for name in names:
                if name.endswith(FILE_MANIFEST_SUFFIX) and name != FILE_MANIFEST_SUFFIX:
                    outputs.add(here / name[: -len(FILE_MANIFEST_SUFFIX)])
    return sorted(outputs), sorted(lost, key=lambda p: p.path)


def _enclosing_output(path: Path) -> Path | None:
    """The output ``path`` is, is inside, or is the manifest of (none for a folder of outputs).

    A file inside a checkpoint, its ``policy/`` folder, or a manifest given by name all
    verify their whole output.
    """
    if path.is_file():
        if path.name == MANIFEST_NAME:
            return path.parent
        if path.name.endswith(FILE_MANIFEST_SUFFIX):
            return path.with_name(path.name[: -len(FILE_MANIFEST_SUFFIX)])
        if path.with_name(path.name + FILE_MANIFEST_SUFFIX).is_file():
            return path
    # A folder's own manifest is found by the walk, with the outputs below it.
    for folder in path.absolute().parents:
        if (folder / MANIFEST_NAME).is_file():
            return folder if path.is_absolute() else Path(os.path.relpath(folder))
    return None


def _read(output: Path) -> dict[str, Any] | Problem:
    """The manifest of ``output``, or the problem reading it."""
    where = manifest_path(output)
    try:
        manifest = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return Problem(where, output, f"unreadable manifest ({err})")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        return Problem(where, output, "not a manifest (no JSON object with a files listing)")
    return manifest


def _plan(output: Path, manifest: dict[str, Any]) -> tuple[list[_Check], list[Problem]]:
    """The listed files to re-hash, and what a listing alone shows (missing, unlisted)."""
    where = manifest_path(output)
    try:
        algorithm = manifest_algorithm(manifest, where)
    except ManifestError as err:
        return [], [Problem(where, output, str(err).split(": ", 1)[-1])]
    root = output if output.is_dir() else output.parent
    listed: dict[str, str] = manifest["files"]
    checks, problems = [], []
    for name, expected in sorted(listed.items()):
        file = root / name
        if not file.is_file():
            problems.append(Problem(file, output, f"missing, though {where.name} lists it"))
        else:
            checks.append(_Check(file, output, algorithm, expected, file.stat().st_size))
    if output.is_dir():
        for file in data_files(output):
            if file.relative_to(output).as_posix() not in listed:
                problems.append(
                    Problem(file, output, f"not listed in {where.name}: added after it was written")
                )
    return checks, problems


def _stale_inputs(
    output: Path, manifest: dict[str, Any], scope: Sequence[Path], damaged: Sequence[Path]
) -> list[Problem]:
    """The recorded inputs of ``output`` in ``scope`` whose digest is no longer theirs.

    An input's path is as the stage was given it (relative to the workflow's folder); one
    that is gone (a transient round, deleted by retention), outside the audit's ``scope``
    or in a ``damaged`` output (reported already) is skipped. Paths are resolved ones.
    """
    problems = []
    algorithm = manifest_algorithm(manifest)
    for name, entry in sorted((manifest.get("inputs") or {}).items()):
        if not isinstance(entry, dict) or not {"path", "digest"} <= set(entry):
            continue
        path = Path(entry["path"])
        if not path.exists():
            continue
        where = path.resolve()
        if not any(where.is_relative_to(top) for top in scope) or any(
            where.is_relative_to(bad) for bad in damaged
        ):
            continue
        try:
            now = digest_path(path, algorithm)
        except (OSError, ValueError):
            continue
        if now != entry["digest"]:
            problems.append(
                Problem(
                    manifest_path(output),
                    output,
                    f"made from input {name!r} ({path}) as it was before: that input now "
                    "holds other bytes, so this output is stale",
                )
            )
    return problems


def _rehash(item: _Check) -> Problem | None:
    """Hash one listed file; the problem if its bytes are not the listed ones."""
    try:
        digest = file_digest(item.file, item.algorithm)
    except OSError as err:
        return Problem(item.file, item.output, f"unreadable ({err.strerror or err})")
    if digest == item.expected:
        return None
    return Problem(
        item.file,
        item.output,
        f"corrupt or changed since it was written (its {item.algorithm} differs from the "
        "manifest's)",
    )


def audit(
    paths: Sequence[str | Path],
    *,
    jobs: int | None = None,
    progress: Callable[[int], Callable[[int], Any]] | None = None,
) -> Audit:
    """Re-hash every file of every stage output at or under ``paths``; read-only.

    ``jobs``: files hashed at once (default: the usable cores); the largest go first.
    ``progress``: given the bytes to hash once they are known, returns the callback that
    is given the bytes of each file once it is hashed (a progress bar's ``update``).
    """
    outputs, problems = find_outputs(paths)
    checks: list[_Check] = []
    unverifiable: list[Problem] = []
    listed: list[tuple[Path, dict[str, Any]]] = []
    for output in outputs:
        manifest = _read(output)
        if isinstance(manifest, Problem):
            problems.append(manifest)
            continue
        if "files" not in manifest:
            reason = "lists no file digests (an older version wrote it): rebuild it to verify it"
            unverifiable.append(Problem(manifest_path(output), output, reason))
            continue
        planned, found = _plan(output, manifest)
        checks += planned
        problems += found
        if not any(p.path == manifest_path(output) for p in found):
            listed.append((output, manifest))
    checks.sort(key=lambda c: -c.size)
    advance = progress(sum(c.size for c in checks)) if progress is not None else None

    workers = jobs or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for item, problem in zip(checks, pool.map(_rehash, checks), strict=True):
            if advance is not None:
                advance(item.size)
            if problem is not None:
                problems.append(problem)
    # An input that is itself damaged is reported as such, not again through its consumers.
    damaged = [p.output.resolve() for p in problems]
    scope = [Path(p).resolve() for p in paths]
    for output, manifest in listed:
        problems += _stale_inputs(output, manifest, scope, damaged)
    return Audit(
        outputs=tuple(outputs),
        files=len(checks),
        bytes=sum(c.size for c in checks),
        problems=tuple(sorted(problems, key=lambda p: (p.output, p.path))),
        unverifiable=tuple(unverifiable),
    )
