"""Writing outputs so that a crash never leaves a half-written file behind, and metric lines.

Every stage folder holds ``metrics.jsonl``: one flat JSON object per line (``stage``, ``round``,
``step``, then scalar ``key: value`` pairs, nested names joined by dots). A training round
keeps a copy of its rollout, score and train stages' lines in ``round-<r>/metrics/<stage>.jsonl``
(:func:`round_record`), which outlives the stage folders (``workflow.keep_every`` deletes most
rounds' checkpoints and rollouts); the workflow's collection and tracking rules read those
without knowing any stage.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# A policy is ``base`` (the backbone's own weights) or a checkpoint folder, which keeps its
# weights in POLICY_DIR: the folder the consumers of a checkpoint digest and read.
BASE = "base"
POLICY_DIR = "policy"


def policy_weights_dir(policy: str | Path) -> Path:
    """Where a checkpoint directory keeps its policy weights (what consumers digest)."""
    return Path(policy) / POLICY_DIR


class OutputError(OSError):
    """An output could not be written; the message names it.

    What stood there before is intact. The command line reports it as one ``error:`` line
    (in a workflow job's log).
    """


class DiskFullError(OutputError):
    """A write ran out of space (or quota); what stood at the target before is intact."""


# What an unwritable destination raises: no permission, a read-only filesystem, or a file
# where a folder should be (and the reverse).
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR)


def _out_of_space(err: BaseException, folder: Path | None = None) -> bool:
    # Writers in other languages (safetensors) report it in their own words, and torch's zip
    # writer (sharded checkpoints) as a short write: then the folder's free space tells.
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(err) or "os error 28" in str(err):
        return True
    return folder is not None and folder.exists() and shutil.disk_usage(folder).free < 1 << 20


def _disk_full(target: Path, err: BaseException) -> DiskFullError:
    cause = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
    return DiskFullError(
        errno.ENOSPC,
        f"{target}: no space left on the device while writing it ({cause}); what was there "
        "before is intact. Free some space and rerun.",
    )


def _about(target: Path, name: Path) -> bool:
    """Whether an error about path ``name`` is about writing ``target``.

    That is: the target, a folder above it, its hidden siblings (``.NAME.*``: temporary copy,
    staging folder, retired self), or anything inside the target or its staging folder.
    """
    sibling = name.parent == target.parent and name.name.startswith(f".{target.name}.")
    inside = (target, staging_path(target))
    return (
        name == target
        or name in target.parents
        or sibling
        or any(folder in name.parents for folder in inside)
    )


def _refuse_unwritable(target: Path, err: BaseException) -> None:
    """Raise :class:`OutputError` naming ``target`` when ``err`` says it cannot be written.

    An error about another path (an input the writer reads) is left alone.
    """
    if not isinstance(err, OSError) or isinstance(err, OutputError):
        return
    if err.errno not in _UNWRITABLE:
        return
    names = [Path(name) for name in (err.filename, err.filename2) if name is not None]
    if names and not any(_about(target, name) for name in names):
        return
    where = f" ({names[0]})" if names and names[0] != target else ""
    raise OutputError(
        err.errno,
        f"{target}: cannot write it: {err.strerror}{where}; make its folder writable by this "
        "user (or free the path) and rerun. What was there before is intact.",
    ) from err


def make_folder(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p path``; a folder that cannot be made raises :class:`OutputError` naming it."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _refuse_unwritable(folder, err)
        raise
    return folder


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For writers that want a file name (parquet, safetensors, torch.save); on any error the
    temporary file is removed and ``path`` is left as it was (a full disk raises
    :class:`DiskFullError`, an unwritable destination :class:`OutputError`, both naming
    ``path``). Temporary files of a killed earlier write of ``path`` are removed first.
    """
    target = Path(path)
    make_folder(target.parent)
    try:
        for leftover in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
            leftover.unlink(missing_ok=True)  # of a write killed before it could clean up
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        _refuse_unwritable(target, err)
        raise
    os.close(fd)
    # mkstemp makes the file private (0600); results on a shared filesystem are for the group
    # too, so give it the mode a plain open() would.
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if _out_of_space(err):
            raise _disk_full(target, err) from err
        _refuse_unwritable(target, err)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename)."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """:func:`atomic_write_text` of ``data`` as indented JSON."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def staging_path(target: str | os.PathLike[str]) -> Path:
    """``.NAME.partial`` beside ``target``: where :func:`atomic_directory` builds it."""
    target = Path(target)
    return target.with_name(f".{target.name}.partial")


def _retired_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _fsync_tree(directory: str | os.PathLike[str]) -> None:
    """Flush every file under ``directory`` and the directory itself."""
    directory = Path(directory)
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging directory; on success flush it and swap it in for ``target``.

    Leftovers of a killed earlier write (``.NAME.partial``, ``.NAME.old``) are removed first.
    The swap renames an existing ``target`` to ``.NAME.old``, the staging directory to
    ``target``, then deletes the old one: a reader sees the old output or the new one, never a
    mix. On an exception the staging directory is removed and ``target`` is left as it was.
    """
    target = Path(target)
    staging, retired = staging_path(target), _retired_path(target)
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    make_folder(staging)
    try:
        yield staging
        _fsync_tree(staging)
    except BaseException as err:
        full = not isinstance(err, DiskFullError) and _out_of_space(err, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise _disk_full(target, err) from err
        _refuse_unwritable(target, err)
        raise
    try:
        if target.exists():
            os.replace(target, retired)
            os.replace(staging, target)
            shutil.rmtree(retired)
        else:
            os.replace(staging, target)
    except OSError as err:
        _refuse_unwritable(target, err)
        raise


METRICS_NAME = "metrics.jsonl"


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}.{index}", out)
    elif isinstance(value, float) and not math.isfinite(value):
        out[prefix] = None  # strict JSON has no spelling for NaN or infinities
    else:
        out[prefix] = value


def metrics_record(
    stage: str, round_index: int | None, step: int, values: Mapping[str, Any]
) -> dict:
    """One flat metrics line: stage, round (None: unknown), step, then ``values`` dotted."""
    record: dict[str, Any] = {"stage": stage, "round": round_index, "step": step}
    _flatten(values, "", record)
    return record


def append_metrics(
    folder: str | os.PathLike[str],
    stage: str,
    round_index: int | None,
    step: int,
    values: Mapping[str, Any],
) -> None:
    """Append one :func:`metrics_record` to ``folder/metrics.jsonl`` and flush it to disk."""
    line = json.dumps(metrics_record(stage, round_index, step, values)) + "\n"
    with open(Path(folder) / METRICS_NAME, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


# Round r of a run lives in round-<r>/, four digits so that the folders sort in round order
# (the workflow's rules build their patterns from the prefix, its round wildcard is 4 digits).
ROUND_PREFIX = "round-"
ROUND_FOLDER = re.compile(rf"{ROUND_PREFIX}(\d{{4}})")


def round_name(round_index: int) -> str:
    """The folder name of round ``round_index`` in its run: ``round-0003``."""
    return f"{ROUND_PREFIX}{round_index:04d}"


# A run's evaluations live in eval/trained-<n>/: the policy after n trained rounds (0: the base).
EVALUATION_PREFIX = "trained-"
EVALUATION_FOLDER = re.compile(rf"{EVALUATION_PREFIX}(\d{{4}})")


def evaluation_name(trained_rounds: int) -> str:
    """The folder name of the evaluation after ``trained_rounds`` rounds: ``trained-0005``."""
    return f"{EVALUATION_PREFIX}{trained_rounds:04d}"


def evaluated_rounds(rounds: int, every: int) -> list[int]:
    """After how many of ``rounds`` trained rounds the policy is evaluated.

    0 (the base), every ``every`` (a run's ``eval.every``) and the last: the workflow's
    evaluations and the in-process loop's (:func:`jagg_pipeline.stages.loop.run_rounds`).
    """
    return sorted({0, rounds, *range(every, rounds + 1, every)})


# A round's kept metric lines: round-<r>/metrics/<stage>.jsonl, one file per stage of the round.
ROUND_RECORDS = "metrics"
ROUND_STAGES: tuple[str, ...] = ("rollout", "score", "train")


def round_record(round_folder: str | os.PathLike[str], stage: str) -> Path:
    """Where a round keeps the metric lines of ``stage``: ``<round_folder>/metrics/<stage>.jsonl``.

    ``stage``: one of :data:`ROUND_STAGES`.
    """
    if stage not in ROUND_STAGES:
        raise ValueError(f"stage {stage!r}: a round's stages are {', '.join(ROUND_STAGES)}")
    return Path(round_folder) / ROUND_RECORDS / f"{stage}.jsonl"


def keep_round_record(
    stage_folder: str | os.PathLike[str], round_folder: str | os.PathLike[str], stage: str
) -> Path:
    """Copy the finished ``stage_folder``'s metrics.jsonl to its :func:`round_record`.

    Atomically; the workflow's rollout, score and train rules copy it the same way.
    """
    text = (Path(stage_folder) / METRICS_NAME).read_text(encoding="utf-8")
    return atomic_write_text(round_record(round_folder, stage), text)
