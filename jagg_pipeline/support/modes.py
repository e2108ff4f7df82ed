"""The permission bits an output gets: what the process's umask grants, whoever wrote it.

Some writers make their files private whatever the umask says (safetensors 0.8's
``save_file`` creates them 0600, ``tempfile.mkstemp`` too); on a shared filesystem the
group could then not read rollouts, checkpoints or exports. The writers of outputs re-apply
the umask's mode to what such a writer left, before the output is renamed into place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it.

    Linux reports it in ``/proc/self/status``; elsewhere it is read by setting and restoring
    it, which a thread creating a file meanwhile would see (so that is only the fallback).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike[str], mask: int | None = None) -> None:
    """Give ``path`` the mode a plain ``open`` (file) or ``mkdir`` (folder) would have given it.

    ``mask``: the umask (None: the process's, :func:`umask`); links are left alone.
    """
    mask = umask() if mask is None else mask
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        os.chmod(path, 0o777 & ~mask)
    elif stat.S_ISREG(mode):
        os.chmod(path, 0o666 & ~mask)
