"""Where model weights come from: a local path first, a Hugging Face Hub id second.

A value that exists on disk is used as is. A value shaped like a hub id (``owner/name``, or
``owner/name/file`` for a single file) is fetched through the Hugging Face cache; with
``HF_HUB_OFFLINE=1`` that only looks in the local cache, so a missing model fails at once.
Anything else is a missing local path. Every failure raises the caller's error type (a
:class:`~jagg_pipeline.config.fields.ConfigError`) naming the config key to set, with the
underlying error chained for the details. Backbones and rewards both resolve through here.
A pipeline folder's ``model_index.json`` is checked against the backbone family here too,
without torch, so the workflow refuses a bad ``backbone.path`` while it is parsed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from jagg_pipeline.config.fields import ConfigError
from jagg_pipeline.support.errors import shown

T = TypeVar("T")

# Hub repo ids are "owner/name" with word characters, dots and dashes; a leading "." or "/"
# or a "~" means the user meant a filesystem path.
_REPO = r"[A-Za-z0-9_][\w.-]*/[\w.-]+"
HUB_REPO = re.compile(rf"^{_REPO}$")
HUB_FILE = re.compile(rf"^(?P<repo>{_REPO})/(?P<file>[\w.-]+(/[\w.-]+)*)$")
# The diffusers pipeline class (model_index.json "_class_name") of each backbone family.
PIPELINE_CLASSES: dict[str, str] = {
    "flux": "FluxPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "qwenimage": "QwenImagePipeline",
}
MODEL_INDEX = "model_index.json"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set now (huggingface_hub reads it only at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _missing(error: type[Exception], key: str, value: str, wanted: str, cause: str) -> Exception:
    return error(f"{key}: {value} not found ({cause}); set it to {wanted}")


def local_or_hub(
    key: str, value: str, wanted: str, want_dir: bool, error: type[Exception]
) -> Path | str:
    """The existing local path, or ``value`` itself when it is shaped like a hub id.

    Anything else raises ``error`` naming ``key`` (a missing local path); so does a local
    path that is a directory where a file is wanted (``want_dir`` false), or the reverse.
    Nothing is downloaded: what a hub id holds is its caller's to look up.
    """
    path = Path(value).expanduser()
    if path.exists():
        if path.is_dir() != want_dir:
            kind = "a directory" if path.is_dir() else "a file"
            raise error(f"{key}: {value} is {kind}; set it to {wanted}")
        return path
    pattern = HUB_REPO if want_dir else HUB_FILE
    if pattern.fullmatch(value):
        return value
    shape = "'owner/name'" if want_dir else "'owner/name/file'"
    local = "directory" if want_dir else "file"
    raise _missing(error, key, value, wanted, f"no such local {local}, and not a hub {shape}")


def load_pretrained_dir(
    key: str,
    value: str,
    wanted: str,
    load: Callable[[str], T],
    error: type[Exception] = ConfigError,
) -> T:
    """``load(value)`` for a ``from_pretrained`` directory or hub repo id, errors naming ``key``.

    ``wanted`` describes what the key should hold, for the error message.
    """
    source = local_or_hub(key, value, wanted, True, error)
    try:
        return load(str(source))
    # transformers reports missing files and hub failures as OSError, malformed ids as ValueError
    except (OSError, ValueError) as err:
        where = "local directory" if isinstance(source, Path) else "hub id, not in the local cache"
        raise _missing(error, key, value, wanted, f"{where}: {err}".rstrip(".")) from err


def snapshot_dir(
    key: str,
    value: str,
    wanted: str,
    *,
    revision: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    error: type[Exception] = ConfigError,
) -> Path:
    """A local directory, or the hub repo ``value`` snapshotted (only ``allow_patterns``)."""
    source = local_or_hub(key, value, wanted, True, error)
    if isinstance(source, Path):
        return source
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                source,
                revision=revision,
                allow_patterns=list(allow_patterns) if allow_patterns else None,
                local_files_only=hub_offline(),
            )
        )
    # hub failures (offline cache miss, unknown repo, HTTP) are OSErrors, a bad id a ValueError
    except (OSError, ValueError) as err:
        cause = f"hub id, not in the local cache or not downloadable: {type(err).__name__}"
        raise _missing(error, key, value, wanted, cause) from err


def resolve_file(key: str, value: str, wanted: str, error: type[Exception] = ConfigError) -> Path:
    """A local file, or ``owner/name/file`` downloaded into (or found in) the hub cache."""
    source = local_or_hub(key, value, wanted, False, error)
    if isinstance(source, Path):
        return source
    from huggingface_hub import hf_hub_download

    match = HUB_FILE.fullmatch(source)
    try:
        return Path(hf_hub_download(match["repo"], match["file"], local_files_only=hub_offline()))
    # hub errors (offline, missing entry, HTTP) are OSErrors, a malformed id a ValueError
    except (OSError, ValueError) as err:
        cause = f"hub file, not in the local cache: {type(err).__name__}"
        raise _missing(error, key, value, wanted, cause) from err


def read_model_index(
    directory: Path, key: str, value: str, family: str, error: type[Exception] = ConfigError
) -> dict:
    """``model_index.json`` of checkpoint ``directory``, checked against ``family``.

    It must name the family's pipeline class and every component folder it lists must be
    there; errors name the config ``key`` and its ``value``.
    """
    index_file = directory / MODEL_INDEX
    if not index_file.is_file():
        raise error(
            f"{key}={shown(value)}: {index_file} not found; point {key} at a diffusers-format "
            "pipeline directory (with model_index.json, transformer/, vae/, scheduler/, ...)"
        )
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{key}={shown(value)}: {index_file} is not readable JSON ({err})") from None
    found = index.get("_class_name") if isinstance(index, dict) else None
    expected = PIPELINE_CLASSES[family]
    if found != expected:
        section = key.rsplit(".", 1)[0]
        raise error(
            f"{key}={shown(value)} holds a {shown(found)} checkpoint, but "
            f"{section}.family={family!r} expects {expected}; fix {section}.family or {key}"
        )
    for name, entry in index.items():
        if isinstance(entry, list) and entry[0] is not None and not (directory / name).is_dir():
            raise error(
                f"{key}={shown(value)}: model_index.json lists {name!r} but {directory / name} "
                "is missing (incomplete download?)"
            )
    return index


def check_pipeline_dir(key: str, value: str, family: str, revision: str | None = None) -> None:
    """Refuse a checkpoint setting that a stage would refuse, without loading anything.

    A local directory must be a ``family`` pipeline (:func:`read_model_index`); a hub id is
    looked up in the local cache when ``HF_HUB_OFFLINE`` is set (else the stage downloads
    it); anything else is a missing directory. Raises ConfigError naming ``key``.
    """
    wanted = "a local diffusers-format directory (the one holding model_index.json) or a hub id"
    source = local_or_hub(key, value, wanted, True, ConfigError)
    if isinstance(source, Path):
        read_model_index(source, key, value, family)
    elif hub_offline():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, MODEL_INDEX, revision=revision)
        if not isinstance(cached, str):
            raise _missing(
                ConfigError, key, value, wanted, "hub id, not in the local cache (HF_HUB_OFFLINE)"
            )
        read_model_index(Path(cached).parent, key, value, family)
