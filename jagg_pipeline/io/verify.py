"""Consumers verify what they read, once per node.

A stage input is verified against the digests its producer's manifest lists
(:func:`~jagg_pipeline.io.manifest.verify_files`), but only the files the consumer reads: a
rollout of a checkpoint reads ``policy/``, never the optimizer state; a training rank reads
the ``policy/``, optimizer and EMA files its own rows live in (:func:`verify_sharded`
plans them from each folder's ``.metadata``, before any model is built), the rollout's
shard files and the score table, after :func:`~jagg_pipeline.io.manifest.check_made`
checked what the input is (its stage, the config sections it was made under) without
hashing anything.

Under a process group :func:`verify_reads` is a collective that hashes each file once per
node: the ranks all-gather (host, files they read); each file read on a host is hashed by
one of that host's ranks that read it, the files spread over those ranks by size, largest
first to the least loaded; the failures are all-gathered, so every rank raises the same
:class:`~jagg_pipeline.io.manifest.ManifestError`, naming the file. Without one (or with
``collective=False``: a process reading on its own) the process verifies its reads itself.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jagg_pipeline.io.manifest import (
    ManifestError,
    verify_files,
)
from jagg_pipeline.io.shards import METADATA_FILE


@dataclass(frozen=True)
class Reads:
    """Files a process reads of one finished output: names relative to it, as listed."""

    output: Path
    manifest: Mapping[str, Any]
    names: tuple[str, ...]

    @property
    def root(self) -> Path:
        """The folder the names are relative to (a file output's is its parent)."""
        return self.output.parent if self.output.is_file() else self.output


def verify_sharded(
    folders: Sequence[str | Path],
    output: str | Path,
    manifest: Mapping[str, Any],
    *,
    collective: bool | None = None,
    also: Sequence[Reads] = (),
) -> None:
    """Verify what loading each sharded folder (inside ``output``) whole reads, before it loads.

    Needs no model: each folder's ``.metadata`` is verified first (with ``also``, other
    reads of the same job, in the same pass), since planning reads it; then the chunk files
    this process reads (:func:`~jagg_pipeline.io.shards.files_read_by_rows`): under a process
    group (``collective``, as in :func:`verify_reads`) the files of this rank's rows, else
    every file.
    """
    import torch.distributed as dist

    from jagg_pipeline.io import shards

    if collective is None:
        collective = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)
    output = Path(output)

    def names(folder: Path, files: Iterable[str]) -> tuple[str, ...]:
        return tuple(f"{folder.relative_to(output).as_posix()}/{name}" for name in sorted(files))

    paths = [Path(folder) for folder in folders]
    metadata = {METADATA_FILE}
    first = [*also, *(Reads(output, manifest, names(f, metadata)) for f in paths)]
    verify_reads(first, collective=collective)
    chunks = []
    for folder in paths:
        files = set(shards.files_read_by_rows(folder, rank, world_size)) - metadata
        chunks.append(Reads(output, manifest, names(folder, files)))
    verify_reads(chunks, collective=collective)


def verify_reads(reads: Sequence[Reads], *, collective: bool | None = None) -> None:
    """Refuse a corrupt, changed or missing file among ``reads``, hashing only those.

    ``collective`` (default: whether a process group exists): every rank calls this, and a
    file read on a node is hashed once on that node (see the module docstring); every rank
    raises the same error. False: this process verifies its reads alone.
    """
    import torch.distributed as dist

    if collective is None:
        collective = dist.is_available() and dist.is_initialized()
    if not collective or dist.get_world_size() == 1:
        for read in reads:
            verify_files(read.output, read.manifest, read.names)
        return
    files = {_key(read, name): _size(read.root / name) for read in reads for name in read.names}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (socket.gethostname(), files))
    mine = assign(everyone)[dist.get_rank()]
    error = None
    try:
        for read in reads:
            if names := [name for name in read.names if _key(read, name) in mine]:
                verify_files(read.output, read.manifest, names)
    except (ManifestError, OSError) as err:
        error = str(err)
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if failed := next((e for e in errors if e is not None), None):
        raise ManifestError(failed)


def assign(everyone: Sequence[tuple[str, Mapping[str, int]]]) -> list[set[str]]:
    """Which files each rank hashes: ``everyone[rank]`` is (host, {file: bytes} it reads).

    Each file read on a host goes to exactly one of that host's ranks reading it: largest
    file first, to the reader with the fewest bytes so far (then the lowest rank).
    """
    hashed: list[set[str]] = [set() for _ in everyone]
    load = [0] * len(everyone)
    readers: dict[tuple[str, str], list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, (host, files) in enumerate(everyone):
        for file, size in files.items():
            readers.setdefault((host, file), []).append(rank)
            sizes[file] = size
    for host, file in sorted(readers, key=lambda hf: (-sizes[hf[1]], hf)):
        rank = min(readers[host, file], key=lambda r: (load[r], r))
        hashed[rank].add(file)
        load[rank] += sizes[file]
    return hashed


def _key(read: Reads, name: str) -> str:
    """One spelling of a file for every rank: its absolute path."""
    return os.path.abspath(read.root / name)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # missing: whoever hashes it reports it
