"""Prompt sets from local files: txt, json, jsonl, csv and parquet, with a column option.

- ``.txt``: one prompt per line (blank lines skipped);
- ``.json``: a list of strings (HPDv2's benchmark files) or of objects with the column;
- ``.jsonl``: one string or one object with the column per line;
- ``.csv``: a header row; ``.parquet``: any table (needs pyarrow).
Tabular formats read ``column`` (default ``"prompt"``); DrawBench's CSV calls it ``Prompts``
and Pick-a-Pic's parquet ``caption``. Errors name the file, and for a missing column, the
columns that exist.
:func:`~jagg_pipeline.tables.read_table` reads the tabular formats. The toy world's prompt
generator lives with the toy world.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jagg_pipeline.tables import TABLE_SUFFIXES, TableError, read_table

DEFAULT_COLUMN = "prompt"
PROMPT_SUFFIXES = (".txt", *TABLE_SUFFIXES)
# Prompt files are tables (or text): their errors are the table reader's.
PromptFileError = TableError


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
        if not path.is_file():
            raise PromptFileError(f"{path}: no such file")
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
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
            raise PromptFileError(f"{path}: prompt {number} is not a non-empty string: {prompt!r}")
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts
