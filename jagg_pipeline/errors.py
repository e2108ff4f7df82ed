"""The error a user can fix: bad input, reported as one line naming the key or the file.

Every config, manifest, table, prompt-file, policy and checkpoint problem raises a subclass of
:class:`InputError`; the command line turns exactly these into ``error: <message>`` and lets
anything else (a bug) keep its traceback. Torch-free.
"""

from __future__ import annotations


class InputError(ValueError):
    """A config key, an input file, a policy or a model path that does not fit; names it."""
