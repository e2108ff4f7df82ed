"""Tensor state on disk, sharded: each process writes and reads only its own part.

The one place that touches ``torch.distributed.checkpoint`` (DCP). A folder holds a state
dict as DCP lays it out: ``.metadata`` (the keys, shapes, dtypes and which file holds which
chunk) and one ``__<rank>_0.distcp`` file per writing rank. Nested dicts and lists are
flattened on the way in (``state.<param>.exp_avg``) and rebuilt on the way out.

- Under a process group (the training job), :func:`save` and :func:`load` are collectives:
  a rank writes the local shards of its DTensors and reads back only the chunks its shards
  overlap, so no rank ever holds the whole state and a folder written by 8 ranks loads on 2.
- Without one (rollout, evaluate, export, tests), :func:`load` reads every chunk into the
  given full tensors, and :func:`read` returns the whole state without a template.

Imports torch only when called: the manifest code (torch-free) reads :data:`METADATA_FILE`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

METADATA_FILE = ".metadata"
# DCP warns when it runs without a process group; here that is the intended single process.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


def _writer(folder: str | Path) -> Any:
    """DCP's file-system writer, deterministic, recording the digest of every file it writes.

    The same state gives the same bytes: DCP's writer would record the folder's path and a
    random save id in ``.metadata``, which would make every rerun's digest differ. Each file
    (``.distcp`` shards from DCP's writer threads, ``.metadata`` written as a temporary file
    and renamed) is hashed as DCP writes it, so the manifest of the folder reads none back
    (:class:`jagg_pipeline.io.artifacts.DigestingWriter`).
    """
    from contextlib import contextmanager

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    from jagg_pipeline.io.artifacts import DigestingWriter

    class DigestingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: str | Path, mode: str) -> Iterator[Any]:
            if mode != "wb":  # reading (DCP's writer opens nothing else)
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with DigestingWriter(path) as stream:
                yield stream

    class Writer(dcp.FileSystemWriter):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = DigestingFileSystem()
            self.path = self.fs.init_path(path)

        def storage_meta(self) -> None:
            return None

    return Writer(str(folder))


def save(state: dict[str, Any], folder: str | Path) -> None:
    """Write ``state`` into ``folder`` (a collective under a process group).

    Every file's digest is recorded as it is written (:func:`_writer`): each rank's are its
    own, :func:`jagg_pipeline.io.manifest.recorded_digests` returns them.
    """
    import torch.distributed.checkpoint as dcp

    with _quiet():
        dcp.save(state, storage_writer=_writer(folder), no_dist=not _distributed())


def load(state: dict[str, Any], folder: str | Path, *, collective: bool | None = None) -> None:
    """Fill ``state``'s tensors in place from ``folder``; its keys must all be there.

    ``collective`` (default: whether a process group exists) makes it a collective in
    which each rank reads the chunks of its own shards; False reads every chunk this process
    asks for, whatever other processes do (a rollout inside a training test, say).
    """
    import torch.distributed.checkpoint as dcp

    collective = _distributed() if collective is None else collective
    with _quiet():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not collective)


def files_read_by_rows(folder: str | Path, rank: int, world_size: int) -> list[str]:
    """The files of ``folder`` that rank ``rank`` of ``world_size`` reads to load it whole.

    Planned from ``.metadata`` alone (the only file read here), before any model exists:
    FSDP2 holds each parameter, its AdamW moments and its EMA by rows (``Shard(0)`` over
    the 1-D mesh, ``torch.chunk``'s split), so the rank reads the chunk files whose rows
    overlap its own, every chunk of a 0-d tensor (a step count) and every non-tensor
    value. A world of one reads every file. The names are relative to ``folder``,
    ``.metadata`` among them.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    entries = metadata.state_dict_metadata
    files = {METADATA_FILE}
    for index, info in metadata.storage_data.items():
        entry = entries[index.fqn]
        if isinstance(entry, TensorStorageMetadata) and len(entry.size) > 0:
            rows = entry.size[0]
            per_rank = -(-rows // world_size)  # torch.chunk: ceil, the last ranks may get none
            low, high = min(rows, rank * per_rank), min(rows, (rank + 1) * per_rank)
            chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
            start = chunk.offsets[0]
            if not (start < high and start + chunk.sizes[0] > low):
                continue
        files.add(info.relative_path)
    return sorted(files)


def keys(folder: str | Path) -> dict[str, tuple[int, ...] | None]:
    """The flattened keys ``folder`` holds: a tensor's full shape, None for other values."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    return {
        key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
    }


def read(folder: str | Path) -> dict[str, Any]:
    """The whole state saved in ``folder``, nested as it was saved, in this one process.

    For small states and tools (tests, export of a LoRA adapter): a full-size state should
    be loaded into the model it belongs to with :func:`load` instead.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    flat: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            flat[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        else:
            flat[key] = None  # filled with the saved object
    with _quiet():
        dcp.load(flat, checkpoint_id=str(folder), no_dist=True)
    paths = metadata.planner_data or {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        _put(nested, paths.get(key, (key,)), value)
    return _lists(nested)


def _put(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 by DCP's flattening of a list, back into lists."""
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(isinstance(k, int) for k in items):
        return [items[i] for i in sorted(items)]
    return items


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The calling rank's shard of a DTensor (the tensor itself when not sharded)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
