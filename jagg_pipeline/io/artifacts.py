"""Writing outputs so that a crash never leaves a half-written file behind, and metric lines.

A file written by :func:`atomic_write_bytes` (and so :func:`atomic_write_text` and
:func:`atomic_write_json`), :func:`atomic_write_safetensors` or a :class:`DigestingWriter`
(sharded checkpoints) has the digest of its bytes recorded as they are written, in a ledger
of this process keyed by the file's device, inode, size and mtime: renames keep the entry,
a rewrite drops it. A manifest takes its digests from there (:mod:`jagg_pipeline.io.manifest`),
so no writer reads its output back to hash it. New digests are blake3
(:data:`DIGEST_ALGORITHM`). :func:`atomic_output` (a path for writers that want one) records
nothing: what it wrote is hashed by reading when a manifest lists it.

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
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from jagg_pipeline.support.modes import apply_umask, umask

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


# --------------------------------------------------------------------------------------------
# Digests recorded while writing
# --------------------------------------------------------------------------------------------

# The digest of new manifests; a manifest that names none was written with sha256.
DIGEST_ALGORITHM = "blake3"
LEGACY_DIGEST_ALGORITHM = "sha256"
DIGEST_ALGORITHMS = (DIGEST_ALGORITHM, LEGACY_DIGEST_ALGORITHM)


def new_hasher(algorithm: str = DIGEST_ALGORITHM) -> Any:
    """An empty hasher of ``algorithm`` (hashlib's ``update`` and ``hexdigest``).

    blake3 spreads a large update over every core and releases the GIL meanwhile, so the
    threads of a sharded write hash and write at once.
    """
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3(max_threads=blake3.AUTO)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(
        f"digest algorithm {algorithm!r}: the known ones are {', '.join(DIGEST_ALGORITHMS)}"
    )


FileKey = tuple[int, int, int, int]


def file_key(stat: os.stat_result) -> FileKey:
    """What names a file's bytes in the ledger: device, inode, size and mtime (ns).

    A rename keeps all four (temporary files, staging folders); a rewrite makes a new inode
    (atomic writes) or moves the mtime. One rewritten in place to the same size within the
    filesystem's timestamp tick would keep its key: no writer here does that.
    """
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


# A few hundred bytes an entry; a file whose entry was dropped is hashed by reading if needed.
_LEDGER_ENTRIES = 1 << 16
_ledger: OrderedDict[FileKey, tuple[str, str]] = OrderedDict()
_written = {"files": 0, "bytes": 0}
_ledger_lock = threading.Lock()  # DCP writes a rank's files from several threads


def _record(stat: os.stat_result, algorithm: str, hexdigest: str) -> None:
    key = file_key(stat)
    with _ledger_lock:
        _written["files"] += 1
        _written["bytes"] += stat.st_size
        _ledger[key] = (algorithm, hexdigest)
        _ledger.move_to_end(key)
        while len(_ledger) > _LEDGER_ENTRIES:
            _ledger.popitem(last=False)


def recorded_digest(path: str | os.PathLike[str], algorithm: str = DIGEST_ALGORITHM) -> str | None:
    """The ``algorithm`` digest this process recorded while writing ``path``'s current bytes.

    None when it did not write them (another process did, or they changed since).
    """
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    with _ledger_lock:
        entry = _ledger.get(file_key(stat))
    return entry[1] if entry is not None and entry[0] == algorithm else None


def written_counts() -> dict[str, int]:
    """Files and bytes this process hashed while writing them (since the last reset)."""
    with _ledger_lock:
        return dict(_written)


def reset_written_counts() -> None:
    """Zero :func:`written_counts` (the ledger itself is kept)."""
    with _ledger_lock:
        _written.update(files=0, bytes=0)


class DigestingWriter:
    """A file opened for writing (``wb``) that hashes its bytes as they are written.

    Closing it records the digest in this process's ledger (``record=False``: when
    :meth:`record` is called, after a rename, say). Writes are sequential (there is no
    seek), so what was hashed is what the file holds; bytes written past it to the file
    descriptor would change the size, and a file whose size is not the hashed size is not
    recorded. An exception inside ``with`` closes it unrecorded.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        algorithm: str = DIGEST_ALGORITHM,
        *,
        record: bool = True,
    ) -> None:
        self.path = Path(path)
        self.algorithm = algorithm
        self._hasher = new_hasher(algorithm)
        self._size = 0
        self._auto_record = record
        self._final: os.stat_result | None = None  # the closed file, until recorded
        self._raw: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 (closed by close())

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        self._hasher.update(view[:written])
        self._size += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:  # for fsync
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def close(self) -> None:
        """Close the file; record its digest unless constructed with ``record=False``."""
        if self._raw.closed:
            return
        self._raw.close()
        # After close: on a network filesystem the last bytes (and the mtime) land then.
        stat = os.stat(self.path)
        self._final = stat if stat.st_size == self._size else None
        if self._auto_record:
            self.record()

    def record(self) -> None:
        """Record the closed file's digest in the ledger (once)."""
        if self._final is not None:
            _record(self._final, self.algorithm, self._hasher.hexdigest())
            self._final = None

    def __enter__(self) -> DigestingWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self._raw.close()


def _fsync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries to disk.

    A file created or renamed into a folder survives a power cut only once the folder is
    flushed too: the file's own fsync does not cover its name.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it, rename it, fsync the folder.

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
    try:
        yield Path(tmp)
        # mkstemp made the file private (0600), and a writer may have replaced it with another
        # private one (safetensors' save_file does): outputs on a shared filesystem are for
        # the group too, so it gets the mode a plain open() would have given it.
        apply_umask(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if _out_of_space(err):
            raise _disk_full(target, err) from err
        _refuse_unwritable(target, err)
        raise
    _fsync_folder(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` (bytes or a buffer) to ``path`` atomically, its digest recorded.

    Writers that make their file in memory (safetensors, parquet, PNG) come here, so the
    manifest of their output never reads them back.
    """
    with atomic_output(path) as tmp, DigestingWriter(tmp, record=False) as stream:
        stream.write(data)
    stream.record()  # the file is in place: its inode, size and mtime are the target's
    return Path(path)


def atomic_write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, Any]) -> Path:
    """Write torch ``tensors`` (on the CPU, contiguous) as a safetensors file, atomically.

    safetensors writes them straight from their memory: holding the file's bytes in memory
    first would double a rollout shard's host memory. Its digest is recorded all the same,
    hashed from the header safetensors wrote (read back: a few kB) and the tensors' bytes in
    the order of the header's offsets, which by the format are the file's bytes; when the
    offsets do not tile the file to its end, nothing is recorded.
    """
    from safetensors.torch import save_file

    with atomic_output(path) as tmp:
        save_file(dict(tensors), str(tmp))
        digest = _safetensors_digest(tmp, tensors)
        stat = os.stat(tmp)
    if digest is not None:
        _record(stat, DIGEST_ALGORITHM, digest)
    return Path(path)


def _safetensors_digest(path: Path, tensors: Mapping[str, Any]) -> str | None:
    import torch

    with open(path, "rb") as handle:
        length = handle.read(8)
        header = handle.read(int.from_bytes(length, "little"))
    layout = json.loads(header)
    spans = sorted(
        (entry["data_offsets"], name) for name, entry in layout.items() if name != "__metadata__"
    )
    hasher = new_hasher(DIGEST_ALGORITHM)
    hasher.update(length + header)
    end = 0
    for (start, stop), name in spans:
        data = tensors[name].detach().reshape(-1).view(torch.uint8).numpy()
        if start != end or stop - start != data.nbytes:
            return None
        hasher.update(data)
        end = stop
    if len(length) + len(header) + end != path.stat().st_size:
        return None
    return hasher.hexdigest()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename), recorded."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """:func:`atomic_write_text` of ``data`` as indented JSON."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def staging_path(target: str | os.PathLike[str]) -> Path:
    """``.NAME.partial`` beside ``target``: where :func:`atomic_directory` builds it."""
    target = Path(target)
    return target.with_name(f".{target.name}.partial")


def _retired_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _settle_tree(directory: str | os.PathLike[str]) -> None:
    """Give everything under ``directory`` the umask's mode, then flush its files and folders.

    The mode: writers of whole folders (safetensors' save_file under save_pretrained, the
    toy world's samples) leave private files, which the group could not read.
    """
    directory = Path(directory)
    mask = umask()
    apply_umask(directory, mask)
    folders = [directory]
    for path in sorted(directory.rglob("*")):
        apply_umask(path, mask)
        if path.is_dir():
            folders.append(path)  # its entries, renamed ones too (DCP's .metadata)
        elif path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    for folder in folders:
        _fsync_folder(folder)


@contextmanager
def atomic_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging directory; on success flush it and swap it in for ``target``.

    Leftovers of a killed earlier write (``.NAME.partial``, ``.NAME.old``) are removed first.
    The swap renames an existing ``target`` to ``.NAME.old``, the staging directory to
    ``target``, then deletes the old one: a reader sees the old output or the new one, never a
    mix. On an exception the staging directory is removed and ``target`` is left as it was.
    A ``target`` that is not a folder (a file) is refused before anything is written
    (:class:`OutputError`): it is not an earlier output to replace.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputError(
            errno.ENOTDIR,
            f"{target}: is a file, where a folder is to be written; nothing was written and "
            "the file is as it was. Move it away (or choose another path) and rerun.",
        )
    staging, retired = staging_path(target), _retired_path(target)
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    make_folder(staging)
    try:
        yield staging
        _settle_tree(staging)
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
            try:
                shutil.rmtree(retired)
            except OSError as err:
                # The new output is in place by now: "cannot write it" would be untrue.
                raise OutputError(
                    err.errno,
                    f"{target}: written, but its previous version, moved aside to {retired}, "
                    f"could not be deleted ({err.strerror}); delete it yourself.",
                ) from err
        else:
            os.replace(staging, target)
    except OSError as err:
        _refuse_unwritable(target, err)
        raise
    _fsync_folder(target.parent)


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


def write_round_record(
    round_folder: str | os.PathLike[str], stage: str, records: Iterable[Mapping[str, Any]]
) -> Path:
    """Write a round's metric lines of ``stage`` (:func:`metrics_record` dicts), atomically.

    What :func:`keep_round_record` copies from a stage folder, for a stage whose folder a
    block of rounds keeps in memory.
    """
    text = "".join(json.dumps(record) + "\n" for record in records)
    return atomic_write_text(round_record(round_folder, stage), text)
