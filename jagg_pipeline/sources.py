"""Where model weights come from: a local path first, a Hugging Face Hub id second.

A value that exists on disk is used as is. A value shaped like a hub id (``owner/name``, or
``owner/name/file`` for a single file) is fetched through the Hugging Face cache; with
``HF_HUB_OFFLINE=1`` that only looks in the local cache, so a missing model fails at once.
Anything else is a missing local path. Every failure raises the caller's error type (a
:class:`~jagg_pipeline.configtools.ConfigError`) naming the config key to set, with the
underlying error chained for the details. Backbones and rewards both resolve through here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from jagg_pipeline.configtools import ConfigError

T = TypeVar("T")

# Hub repo ids are "owner/name" with word characters, dots and dashes; a leading "." or "/"
# or a "~" means the user meant a filesystem path.
_REPO = r"[A-Za-z0-9_][\w.-]*/[\w.-]+"
HUB_REPO = re.compile(rf"^{_REPO}$")
HUB_FILE = re.compile(rf"^(?P<repo>{_REPO})/(?P<file>[\w.-]+(/[\w.-]+)*)$")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set now (huggingface_hub reads it only at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _missing(error: type[Exception], key: str, value: str, wanted: str, cause: str) -> Exception:
    return error(f"{key}: {value} not found ({cause}); set it to {wanted}")


def _local_or_hub(
    key: str, value: str, wanted: str, want_dir: bool, error: type[Exception]
) -> Path | str:
    """The existing local path, or ``value`` itself when it is shaped like a hub id."""
    path = Path(value).expanduser()
    if path.exists():
        if path.is_dir() != want_dir:
            kind = "a directory" if path.is_dir() else "a file"
            raise error(f"{key}: {value} is {kind}; set it to {wanted}")
        return path
    pattern = HUB_REPO if want_dir else HUB_FILE
    if pattern.match(value):
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
    source = _local_or_hub(key, value, wanted, True, error)
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
    source = _local_or_hub(key, value, wanted, True, error)
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
    source = _local_or_hub(key, value, wanted, False, error)
    if isinstance(source, Path):
        return source
    from huggingface_hub import hf_hub_download

    match = HUB_FILE.match(source)
    try:
        return Path(hf_hub_download(match["repo"], match["file"], local_files_only=hub_offline()))
    # hub errors (offline, missing entry, HTTP) are OSErrors, a malformed id a ValueError
    except (OSError, ValueError) as err:
        cause = f"hub file, not in the local cache: {type(err).__name__}"
        raise _missing(error, key, value, wanted, cause) from err
