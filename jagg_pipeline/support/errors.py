"""The error a user can fix: bad input, reported as one line naming the key or the file.

Every config, manifest, table, prompt-file, policy and checkpoint problem raises a subclass of
:class:`InputError`; the command line turns exactly these into ``error: <message>`` and lets
anything else (a bug) keep its traceback. Torch-free.
"""

from __future__ import annotations

import reprlib
from typing import Any

# Longest value an error message quotes (the rest becomes an ellipsis).
SHOWN_CHARS = 80
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, SHOWN_CHARS, SHOWN_CHARS
_SHOWN.maxdict = _SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = 6


class InputError(ValueError):
    """A config key, an input file, a policy or a model path that does not fit; names it."""


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN_CHARS` with an ellipsis.

    Bounded however large ``value`` is (the whole repr is never built): a hostile value is
    quoted, not printed.
    """
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 3]}..."
