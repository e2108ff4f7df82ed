"""A prompt pool's conditioning: the encode stage's artifact, written in batches, read by text.

The folder::

    conditioning.safetensors  per conditioning key a tensor [N, ...] for the pool's N distinct
                              prompts in pool order, token axes zero-padded to the pool's
                              longest where they differ (QwenImage's masked text; Flux and SD3
                              pad T5 to max_sequence_length in every call); when
                              backbone.cfg_scale > 1, the negative prompt's own conditioning
                              [1, ...] under negative_<key>
    prompts.json              the N distinct prompts
    config.yaml, manifest.json  stage "encode"; the manifest's "text" holds the backbone keys
                              the conditioning depends on (:func:`text_keys`)

Owns writing it with memory bounded by one batch (:func:`write_conditioning`: batches are
spilled to a staging folder, then streamed into the one safetensors file, its digest taken as
it is written), reading back only the rows of given prompts (:class:`PoolConditioning`,
safetensors slices of the memory-mapped file: a pool of 100k prompts is never loaded whole),
and what a consumer checks first (:func:`open_conditioning`: the stage, every file's digest,
each text key).
"""

from __future__ import annotations

import glob
import json
import math
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jagg_pipeline.backbones.conditioning import NEGATIVE, pad_tokens
from jagg_pipeline.io.artifacts import DigestingWriter, atomic_output, atomic_write_json
from jagg_pipeline.io.manifest import (
    CHECKED_SECTIONS,
    STAGE_SECTIONS,
    ManifestError,
    check_input,
    manifest_path,
)
from jagg_pipeline.support.errors import InputError, shown

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

STAGE = "encode"
CONDITIONING_FILE = "conditioning.safetensors"
PROMPTS_FILE = "prompts.json"
TEXT_FIELD = "text"  # the manifest's record of text_keys()
# safetensors' dtype names of the tensors conditioning holds.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
}


class ConditioningError(InputError):
    """A ``--conditioning`` folder does not hold what the stage needs."""


def text_keys(config: RunConfig) -> dict[str, Any]:
    """The config keys a pool's conditioning depends on, by dotted name, with their values.

    Those of :data:`~jagg_pipeline.io.manifest.STAGE_SECTIONS` ``["encode"]``: the checkpoint
    (family, path, revision), its dtype, the token cap, the negative prompt and CFG.
    """
    values = {}
    for key in STAGE_SECTIONS[STAGE]:
        node = config
        for part in key.split("."):
            node = getattr(node, part)
        values[key] = node
    return values


def distinct(prompts: Iterable[str]) -> list[str]:
    """``prompts`` without repeats, in first-seen order: the rows of a pool's artifact."""
    return list(dict.fromkeys(prompts))


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_conditioning(
    out: str | Path,
    prompts: Sequence[str],
    batches: Iterable[Mapping[str, torch.Tensor]],
    negative: Mapping[str, torch.Tensor] | None,
) -> Path:
    """Write ``prompts.json`` and ``conditioning.safetensors`` of ``prompts`` into ``out``.

    ``prompts``: distinct; ``batches``: their conditioning in order, a few rows at a time,
    each padded as one encoding call pads; ``negative``: the negative prompt's own
    conditioning [1, ...], or None without CFG. Each batch is spilled to a file beside
    ``out`` as it comes, then the batches are streamed into the one file, padded to the
    longest batch: memory holds one batch, never the pool. Returns the safetensors file.
    """
    from safetensors.torch import save_file

    out = Path(out)
    if len(set(prompts)) != len(prompts):
        raise ValueError("write_conditioning: prompts must be distinct (see distinct())")
    # Beside ``out``, not in it (no batch file can become one of its data files); the
    # leftovers of a killed earlier write go first.
    prefix = f".{out.name}.batches-"
    for leftover in out.parent.glob(f"{glob.escape(prefix)}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=out.parent) as staging:
        parts, rows = [], 0
        for number, batch in enumerate(batches):
            part = Path(staging, f"batch-{number:06d}.safetensors")
            save_file({k: v.contiguous() for k, v in batch.items()}, str(part))
            parts.append(part)
            rows += next(iter(batch.values())).shape[0]
        if rows != len(prompts):
            raise ValueError(f"write_conditioning: {rows} rows for {len(prompts)} prompts")
        target = _stream(out / CONDITIONING_FILE, parts, dict(negative or {}))
    atomic_write_json(out / PROMPTS_FILE, list(prompts))
    return target


def _stream(path: Path, parts: list[Path], negative: dict[str, torch.Tensor]) -> Path:
    """One safetensors file of the batch files ``parts`` (and ``negative``), written in order.

    Every key's tensor is the batches' rows stacked, the other axes zero-padded to the
    largest batch's; ``negative`` goes in as it is, under :data:`NEGATIVE` + key.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[torch.dtype, list[int]]] = {}
    for part in parts:
        with safe_open(str(part), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is no mapping)
                view = handle.get_slice(key)
                dtype = _dtype(view.get_dtype())
                shape = list(view.get_shape())
                if key not in shapes:
                    shapes[key] = (dtype, [0, *shape[1:]])
                total = shapes[key][1]
                total[0] += shape[0]
                total[1:] = [max(a, b) for a, b in zip(total[1:], shape[1:], strict=True)]
    for key, value in negative.items():
        shapes[NEGATIVE + key] = (value.dtype, list(value.shape))

    def blocks(key: str) -> Iterator[torch.Tensor]:
        if key.startswith(NEGATIVE):
            yield negative[key.removeprefix(NEGATIVE)]
            return
        for part in parts:
            with safe_open(str(part), "pt") as handle:
                yield _padded(handle.get_tensor(key), shapes[key][1][1:])

    header: dict[str, Any] = {}
    offset = 0
    for key in sorted(shapes):
        dtype, shape = shapes[key]
        size = dtype.itemsize * math.prod(shape)
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors does
    with atomic_output(path) as tmp, DigestingWriter(tmp, record=False) as stream:
        stream.write(struct.pack("<Q", len(encoded)))
        stream.write(encoded)
        for key in sorted(shapes):
            for block in blocks(key):
                stream.write(block.contiguous().reshape(-1).view(torch.uint8).numpy())
        if stream.tell() != 8 + len(encoded) + offset:
            raise RuntimeError(f"{path}: wrote {stream.tell()} bytes, the header describes more")
    stream.record()  # in place now: its inode, size and mtime are the target's
    return path


def _dtype(name: str) -> torch.dtype:
    for dtype, known in _SAFETENSORS_DTYPES.items():
        if known == name:
            return dtype
    raise ValueError(f"conditioning tensors of safetensors dtype {name} are not supported")


def _padded(tensor: torch.Tensor, trailing: Sequence[int]) -> torch.Tensor:
    """``tensor`` zero-padded on its token axis (dim 1) to ``trailing``; no other axis varies."""
    if list(tensor.shape[2:]) != list(trailing[1:]):
        raise ValueError(f"batches differ beyond the token axis: {tensor.shape} vs {trailing}")
    return pad_tokens(tensor, trailing[0]) if tensor.dim() > 1 else tensor


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class PoolConditioning:
    """The conditioning of a pool's prompts, read by text, only the rows asked for.

    A :class:`~jagg_pipeline.backbones.conditioning.ConditioningSource`: give it to a backbone
    (``use_precomputed``) and its ``encode_prompts`` reads rows here. Open it through
    :func:`open_conditioning`, which checks the folder first.
    """

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        self.file = self.directory / CONDITIONING_FILE
        prompts = json.loads((self.directory / PROMPTS_FILE).read_text(encoding="utf-8"))
        self.index = {prompt: row for row, prompt in enumerate(prompts)}
        with safe_open(str(self.file), "pt") as handle:
            keys = list(handle.keys())
        self.keys = [key for key in keys if not key.startswith(NEGATIVE)]
        self.negative_keys = [key for key in keys if key.startswith(NEGATIVE)]

    def __len__(self) -> int:
        return len(self.index)

    def rows(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each key's rows of ``prompts`` (repeats allowed) [len(prompts), ...], as stored.

        Only those rows are read: one slice of the file per run of consecutive rows.
        """
        missing = [prompt for prompt in prompts if prompt not in self.index]
        if missing:
            raise ConditioningError(
                f"{self.directory / PROMPTS_FILE}: holds no conditioning of prompt "
                f"{shown(missing[0])} ({len(missing)} of {len(prompts)} missing): it was "
                "encoded from another prompt pool; run `encode` on this pool (--prompts, "
                "--column) or leave out --conditioning"
            )
        wanted = [self.index[prompt] for prompt in prompts]
        unique = sorted(set(wanted))
        place = {row: i for i, row in enumerate(unique)}
        order = torch.tensor([place[row] for row in wanted], dtype=torch.int64)
        from safetensors import safe_open

        with safe_open(str(self.file), "pt") as handle:
            return {
                key: torch.cat([handle.get_slice(key)[a:b] for a, b in _runs(unique)])[order]
                for key in self.keys
            }

    def negative(self) -> dict[str, torch.Tensor]:
        """The negative prompt's conditioning [1, ...], keyed without :data:`NEGATIVE`."""
        if not self.negative_keys:
            raise ConditioningError(
                f"{self.file}: holds no negative prompt's conditioning (encoded with "
                "backbone.cfg_scale 1); run `encode` with this config"
            )
        from safetensors import safe_open

        with safe_open(str(self.file), "pt") as handle:
            return {
                key.removeprefix(NEGATIVE): handle.get_tensor(key) for key in self.negative_keys
            }


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``rows`` as half-open runs of consecutive rows."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


def open_conditioning(directory: str | Path, config: RunConfig) -> PoolConditioning:
    """The pool conditioning in ``directory``, once it is shown to fit ``config``.

    Refused (naming the file): anything but a finished ``encode`` output, a file whose bytes
    differ from its manifest's digest, an output made under another value of a text key
    (:func:`text_keys`, the key named).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConditioningError(
            f"--conditioning {directory}: no such folder; run `encode` to make it"
        )
    manifest = check_input(directory, stage=STAGE, config=config, sections=CHECKED_SECTIONS[STAGE])
    recorded = manifest.get(TEXT_FIELD) or {}
    for key, value in text_keys(config).items():
        if key not in recorded or recorded[key] != value:
            raise ManifestError(
                f"{directory}: was encoded with {key} {shown(recorded.get(key))}, this config "
                f"has {shown(value)} (manifest {manifest_path(directory)}); run `encode` with "
                "this config"
            )
    return PoolConditioning(directory)
