"""Prompt sets from local files: txt, json, jsonl, csv and parquet, with a column option.

- ``.txt``: one prompt per line (blank lines skipped; a line ends at a newline only, so a
  prompt may hold U+2028 or a form feed);
- ``.json``: a list of strings (HPDv2's benchmark files) or of objects with the column;
- ``.jsonl``: one string or one object with the column per line;
- ``.csv``: a header row; ``.parquet``: any table (needs pyarrow).
Tabular formats read ``column`` (default ``"prompt"``); DrawBench's CSV calls it ``Prompts``
and Pick-a-Pic's parquet ``caption``. Errors name the file, and for a missing column, the
columns that exist.
:func:`~jagg_pipeline.io.tables.read_table` reads the tabular formats. The toy world's captions
live with the toy world; :func:`resolve_prompts` is the one place where a stage's prompt source
(a file, or ``toy:train`` / ``toy:heldout``) becomes a list, and :func:`draw_prompts` the one
place where a round's prompts are drawn from it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jagg_pipeline.io.tables import TABLE_SUFFIXES, TableError, read_lines, read_table
from jagg_pipeline.support.errors import shown

DEFAULT_COLUMN = "prompt"
PROMPT_SUFFIXES = (".txt", *TABLE_SUFFIXES)
# Prompt files are tables (or text): their errors are the table reader's.
PromptFileError = TableError
# The toy world's caption split (jagg_pipeline.rewards.toy_scene.split): source -> index in it.
TOY_SOURCES = {"toy:train": 0, "toy:heldout": 1}


def column_values(path: str | os.PathLike[str], rows: list[Any], column: str) -> list[Any]:
    """``row[column]`` for every row; the error names the file, the row and existing columns."""
    values = []
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise PromptFileError(
                f"{path}: row {number} is a {type(row).__name__}, not an object with "
                f"column {column!r}"
            )
        if column not in row:
            raise PromptFileError(
                f"{path}: no column {column!r} (row {number} has {', '.join(map(repr, row))}); "
                "choose one with the column option"
            )
        values.append(row[column])
    return values


def load_prompts(path: str | os.PathLike[str], column: str | None = None) -> list[str]:
    """The prompts in ``path``, in file order; ``column`` selects them in tabular files.

    json/jsonl files holding bare strings need no column. Empty files and non-string or empty
    prompts are errors.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        if column is not None:
            raise PromptFileError(f"{path}: a .txt file has no columns (got column {column!r})")
        prompts = [line.strip() for line in read_lines(path)]
        prompts = [p for p in prompts if p]
    elif suffix in TABLE_SUFFIXES:
        rows = read_table(path)
        if column is None and rows and all(isinstance(row, str) for row in rows):
            prompts = rows
        else:
            prompts = column_values(path, rows, column or DEFAULT_COLUMN)
    else:
        raise PromptFileError(f"{path}: unsupported prompt file; use one of {PROMPT_SUFFIXES}")
    for number, prompt in enumerate(prompts, 1):
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptFileError(
                f"{path}: prompt {number} is not a non-empty string: {shown(prompt)}"
            )
        if "\x00" in prompt:
            raise PromptFileError(f"{path}: prompt {number} holds a NUL byte: {shown(prompt)}")
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def resolve_prompts(source: str | os.PathLike[str], column: str | None = None) -> list[str]:
    """The prompt pool of a stage: ``toy:train`` / ``toy:heldout`` or a prompt file.

    The toy sources are the captions of the toy world's fixed train / held-out split, in its
    order; anything else is read with :func:`load_prompts` (``column`` for tabular files).
    """
    text = os.fspath(source)
    if text.startswith("toy:"):
        index = _toy_split(text, column)
        from jagg_pipeline.rewards.toy_scene import split

        return [attributes.caption() for attributes in split()[index]]
    return load_prompts(text, column)


def check_prompts(source: str | os.PathLike[str], column: str | None = None) -> list[str] | None:
    """Raise PromptFileError where :func:`resolve_prompts` would, without torch.

    A toy set's name and column are checked (its captions are not drawn: None), a prompt
    file is read whole and its prompts returned: the workflow checks every prompt file a
    config names while it is parsed.
    """
    text = os.fspath(source)
    if text.startswith("toy:"):
        _toy_split(text, column)
        return None
    return load_prompts(text, column)


def prompt_place(path: str | os.PathLike[str], number: int) -> str:
    """Where prompt ``number`` (1-based, as :func:`load_prompts` counts) is in ``path``.

    ``line L`` in a .txt file (whose blank lines are no prompts), else ``prompt N``.
    """
    if Path(path).suffix.lower() != ".txt":
        return f"prompt {number}"
    lines = (n for n, line in enumerate(read_lines(path), 1) if line.strip())
    return f"line {next(itertools.islice(lines, number - 1, None))}"


def _toy_split(source: str, column: str | None) -> int:
    """The index of toy prompt set ``source`` in the toy world's split."""
    if source not in TOY_SOURCES:
        raise PromptFileError(
            f"{shown(source)}: unknown toy prompt set; use one of {', '.join(TOY_SOURCES)}"
        )
    if column is not None:
        raise PromptFileError(
            f"{shown(source)}: the toy prompt sets have no columns ({shown(column)})"
        )
    return TOY_SOURCES[source]


def draw_prompts(pool: Sequence[str], count: int, seed: int) -> list[str]:
    """``count`` prompts drawn from ``pool`` with ``seed``, without replacement.

    A pool smaller than ``count`` is walked through in whole shuffled passes, so every prompt
    appears before any appears twice. Deterministic for a given pool, count and seed.
    """
    import torch

    if not pool:
        raise ValueError("cannot draw prompts from an empty pool")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    generator = torch.Generator().manual_seed(seed)
    drawn: list[str] = []
    while len(drawn) < count:
        drawn += [pool[i] for i in torch.randperm(len(pool), generator=generator).tolist()]
    return drawn[:count]
