"""Model files checked by their headers: whether a file or folder is the format its loader reads.

Nothing here loads a weight or imports torch: a safetensors file is checked by its JSON
header (and that the file holds the bytes it announces), a ``torch.save`` file by its zip
archive's central directory (or the legacy format's magic number) and the names its pickle
holds, read without running it (:mod:`pickletools`); a transformers folder by its
``config.json`` and the weight files beside it. Each check returns the problem as text
naming the file (None: it is fine), for :mod:`jagg_pipeline.workflow.checks` to refuse
before any job starts.
"""

from __future__ import annotations

import json
import pickletools
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# A safetensors header longer than this is a corrupt length field (real ones are a few MB).
_MAX_HEADER = 100 << 20
# The pickle of a torch checkpoint's structure, without its tensor data, is KBs to a few MB.
_MAX_PICKLE = 256 << 20
# The number torch's legacy (pre-zip) format pickles first.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# Errors pickletools raises on bytes that are no (complete) pickle.
_PICKLE_ERRORS = (ValueError, EOFError, struct.error, UnicodeDecodeError)

# The transformers weight files of a saved model, in the order from_pretrained looks for them.
HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# A saved processor: its image processor's config (transformers 5 writes the first, older
# versions the second) and its tokenizer (the fast tokenizer's file, or the BPE vocabulary).
PROCESSOR_CONFIGS = ("processor_config.json", "preprocessor_config.json")
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


def json_problem(path: Path) -> str | None:
    """Why ``path`` is not a JSON object (None: it is one)."""
    if not path.is_file():
        return f"{path} not found"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path} is not readable JSON ({err})"
    return None if isinstance(data, dict) else f"{path} holds no JSON object"


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object :func:`json_problem` passed."""
    return json.loads(path.read_text(encoding="utf-8"))


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a safetensors file: its header (length, JSON, tensor offsets)."""
    size = path.stat().st_size
    with path.open("rb") as stream:
        head = stream.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            return f"{path} is not a safetensors file (no header: {_first_bytes(head)})"
        try:
            header = json.loads(stream.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{path} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (its header is no JSON object)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    if len(ends) != len(header) - ("__metadata__" in header):
        return f"{path} is not a safetensors file (a header entry has no data_offsets)"
    if ends and max(ends) > size - 8 - length:
        return (
            f"{path} is truncated: its header announces {max(ends)} bytes of tensors, it holds "
            f"{size - 8 - length} (an interrupted download?)"
        )
    return None


def _first_bytes(head: bytes) -> str:
    return f"it starts with {head[:8]!r}" if head else "it is empty"


def torch_checkpoint_problem(path: Path, names: Iterable[str] = ()) -> str | None:
    """Why ``path`` is not a ``torch.save`` file whose pickle holds each of ``names``.

    The zip format (torch >= 1.6): one ``<archive>/data.pkl`` in its central directory; the
    legacy format: the pickled magic number first. ``names`` are the strings (the keys of
    dicts, say) the pickle of the structure must hold, read with :mod:`pickletools`, so no
    code in the file runs and no tensor is read.
    """
    with path.open("rb") as stream:
        head = stream.read(8)
    if head.startswith(b"PK"):
        strings = _zip_pickle_strings(path)
    elif head.startswith(b"\x80"):
        strings = _legacy_pickle_strings(path)
    elif safetensors_problem(path) is None:
        return f"{path} is a safetensors file, not a torch checkpoint (torch.save)"
    else:
        return (
            f"{path} is not a torch checkpoint (neither a zip archive nor a pickle: "
            f"{_first_bytes(head)})"
        )
    if isinstance(strings, str):
        return strings
    missing = [name for name in names if name not in strings]
    if missing:
        return (
            f"{path} is a torch checkpoint without {', '.join(map(repr, missing))}: not the "
            "model it should hold"
        )
    return None


def _zip_pickle_strings(path: Path) -> set[str] | str:
    """The strings in the structure pickle of a zip-format torch checkpoint, or the problem."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                return f"{path} is a zip archive but no torch checkpoint (no one */data.pkl in it)"
            if pickles[0].file_size > _MAX_PICKLE:
                return f"{path}: its data.pkl is {pickles[0].file_size} bytes, no checkpoint's"
            data = archive.read(pickles[0])
    except (zipfile.BadZipFile, OSError) as err:
        return f"{path} is not a readable zip archive ({err}; truncated?)"
    try:
        return _strings(pickletools.genops(data))
    except _PICKLE_ERRORS as err:
        return f"{path}: its data.pkl is no pickle ({err})"


def _legacy_pickle_strings(path: Path) -> set[str] | str:
    """The strings of a legacy torch checkpoint's pickles (magic, version, sys info, object)."""
    strings: set[str] = set()
    with path.open("rb") as stream:
        try:
            for index in range(4):
                ops = list(pickletools.genops(stream))
                if index == 0 and not any(arg == _LEGACY_MAGIC for _, arg, _ in ops):
                    return f"{path} is a pickle but no torch checkpoint (no torch magic number)"
                strings |= _strings(ops)
        except _PICKLE_ERRORS as err:
            return f"{path} is not a complete torch checkpoint ({err})"
    return strings


def _strings(ops: Iterable[tuple[Any, Any, Any]]) -> set[str]:
    return {arg for _, arg, _ in ops if isinstance(arg, str)}


def hf_model_problem(folder: Path, model_type: str) -> str | None:
    """Why ``folder`` is not a transformers ``save_pretrained`` folder of a ``model_type`` model.

    Its ``config.json`` must name that ``model_type`` and its weights (:data:`HF_WEIGHTS`,
    the first there; an index's files all) must pass their header checks.
    """
    config = folder / "config.json"
    problem = json_problem(config)
    if problem:
        return f"{problem}: no saved transformers model"
    found = _read_json(config).get("model_type")
    if found != model_type:
        return f"{config} describes a {found!r} model, not a {model_type!r} one"
    weights = next((folder / name for name in HF_WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        return f"{folder} holds no weights ({', '.join(HF_WEIGHTS)}: none there)"
    if not weights.name.endswith(".index.json"):
        return _weights_problem(weights)
    problem = json_problem(weights)
    shards = _read_json(weights).get("weight_map") if problem is None else None
    if not isinstance(shards, dict):
        return problem or f"{weights} has no weight_map"
    for name in sorted(set(map(str, shards.values()))):
        shard = folder / name
        problem = (
            _weights_problem(shard)
            if shard.is_file()
            else f"{weights} lists {shard}, which is missing"
        )
        if problem:
            return problem
    return None


def _weights_problem(path: Path) -> str | None:
    if path.name.endswith(".safetensors"):
        return safetensors_problem(path)
    return torch_checkpoint_problem(path)


def hf_processor_problem(folder: Path) -> str | None:
    """Why ``folder`` holds no saved processor: an image-processor config and a tokenizer."""
    configs = [folder / name for name in PROCESSOR_CONFIGS if (folder / name).is_file()]
    if not configs:
        return f"{folder} holds no processor ({' or '.join(PROCESSOR_CONFIGS)}: none there)"
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_FILES):
        choices = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        return f"{folder} holds no tokenizer ({choices}: none there)"
    return json_problem(configs[0])
