"""Where reward weights come from: a local path first, a Hugging Face Hub id second.

A value that exists on disk is used as is. A value shaped like a hub id (``owner/name``, or
``owner/name/file`` for a single file) is fetched through the Hugging Face cache; with
``HF_HUB_OFFLINE=1`` that only looks in the local cache, so a missing model fails at once.
Anything else is a missing local path. Every failure raises :class:`RewardConfigError` naming
the config key to set, with the underlying error chained for the details.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from jagg_pipeline.rewards.base import RewardConfigError

T = TypeVar("T")

# Hub repo ids are "owner/name" with word characters, dots and dashes; a leading "." or "/"
# or a "~" means the user meant a filesystem path.
_REPO = r"[A-Za-z0-9_][\w.-]*/[\w.-]+"
_HUB_REPO = re.compile(rf"^{_REPO}$")
_HUB_FILE = re.compile(rf"^(?P<repo>{_REPO})/(?P<file>[\w.-]+(/[\w.-]+)*)$")


def _missing(key: str, value: str, wanted: str, cause: str) -> RewardConfigError:
    return RewardConfigError(f"{key}: {value} not found ({cause}); set it to {wanted}")


def load_pretrained_dir(key: str, value: str, wanted: str, load: Callable[[str], T]) -> T:
    """``load(value)`` for a ``from_pretrained`` directory or hub repo id, errors naming ``key``.

    ``wanted`` describes what the key should hold, for the error message.
    """
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise RewardConfigError(f"{key}: {value} is a file; set it to {wanted}")
        source = str(path)
    elif _HUB_REPO.match(value):
        source = value
    else:
        raise _missing(key, value, wanted, "no such local directory, and not a hub id")
    try:
        return load(source)
    # transformers reports missing files and hub failures as OSError, malformed ids as ValueError
    except (OSError, ValueError) as err:
        where = "local directory" if source != value else "hub id, not in the local cache"
        raise _missing(key, value, wanted, f"{where}: {err}".rstrip(".")) from err


def resolve_file(key: str, value: str, wanted: str) -> Path:
    """A local file, or ``owner/name/file`` downloaded into (or found in) the hub cache."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise RewardConfigError(f"{key}: {value} is a directory; set it to {wanted}")
    match = _HUB_FILE.match(value)
    if match is None:
        raise _missing(key, value, wanted, "no such local file, and not a hub 'owner/name/file'")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(match["repo"], match["file"]))
    # hub errors (offline, missing entry, HTTP) are OSErrors, a malformed id a ValueError
    except (OSError, ValueError) as err:
        cause = f"hub file, not in the local cache: {type(err).__name__}"
        raise _missing(key, value, wanted, cause) from err
