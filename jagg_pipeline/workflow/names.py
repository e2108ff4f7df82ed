"""Names that become folders, wildcard values and rule names: what is usable, what is taken.

Every name of a workflow config that becomes a folder and a wildcard value (targets, variants,
cross entries, sweep labels, policies, prompt sets) must be one path component that no shell or
glob reads specially (:func:`check_name`). A target is also a rule of the Snakefile, so it may
not be named like one of the workflow's own rules (read from the rule files:
:func:`workflow_rules`) or like a folder the workflow keeps under ``workflow.results``
(:data:`RESERVED_FOLDERS`) (:func:`check_target_name`). Torch-free.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path

from jagg_pipeline.config.fields import ConfigError
from jagg_pipeline.support.errors import shown
from jagg_pipeline.workflow.layout import COMPARISON, CONDITIONING

WORKFLOW_KEY = "workflow"
# Checked with fullmatch: `$` would let a trailing newline through.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,119}")
# Folders the workflow keeps directly under workflow.results (mlartifacts: the default
# MLflow store's artifacts).
RESERVED_FOLDERS: tuple[str, ...] = (
    "toyworld",
    COMPARISON,
    "bench",
    "logs",
    "benchmarks",
    "mlartifacts",
    CONDITIONING,
)
# The checkout this package sits in: its Snakefile and workflow/rules/*.smk.
REPOSITORY = Path(__file__).resolve().parents[2]
# `rule NAME:` and `use rule OTHER as NAME with:` at the start of a line; the targets' rules
# are made in a loop (`rule:` with `name:`), so they are not read as the workflow's own.
_RULE = re.compile(r"^(?:rule|checkpoint)\s+(\w+)\s*:|^use\s+rule\s+\w+\s+as\s+(\w+)", re.M)


@functools.cache
def workflow_rules(repository: Path = REPOSITORY) -> tuple[str, ...]:
    """The names of the workflow's own rules, read from its Snakefile and rule files.

    Empty outside a checkout (an installed package has no workflow; the Snakefile itself
    refuses a target named like a rule).
    """
    files = [repository / "Snakefile", *sorted((repository / "workflow/rules").glob("*.smk"))]
    names: list[str] = []
    for path in files:
        if path.is_file():
            names += [a or b for a, b in _RULE.findall(path.read_text())]
    return tuple(dict.fromkeys(names))


def check_name(where: str, name: str) -> None:
    """Refuse ``name`` (of the setting ``where``) unless it is one usable path component.

    That is a letter or digit, then letters, digits, '_', '-', '.', no '..', at most 120
    characters: nothing a shell, a glob or a path reads specially.
    """
    if not _NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{where}: {shown(name)} is not a usable name (it becomes a folder and a job "
            "name); use a letter or digit, then letters, digits, '_', '-', '.' (no '..', at "
            "most 120 characters)"
        )


def check_target_name(kind: str, name: str, taken: Mapping[str, str] = {}) -> None:
    """Refuse a target name that is no usable folder and rule name, or is taken already.

    ``taken``: name -> what uses it (other targets, the toy world's folder).
    """
    where = f"{WORKFLOW_KEY}.{kind}.{name}"
    if not name.isidentifier():
        raise ConfigError(
            f"{where if name.isprintable() else f'{WORKFLOW_KEY}.{kind}'}: {shown(name)} is not "
            "a usable target name; use a letter, then letters, digits and '_'"
        )
    check_name(where, name)
    if name in RESERVED_FOLDERS:
        raise ConfigError(
            f"{where}: {name!r} is the folder of the workflow's own {name} outputs under "
            "workflow.results; rename the target"
        )
    if name in workflow_rules():
        raise ConfigError(f"{where}: {name!r} is a rule of the workflow; rename the target")
    if name in taken:
        raise ConfigError(f"{where}: {name!r} is taken by {taken[name]}; rename the target")
