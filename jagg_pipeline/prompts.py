"""Prompt sets from local files: txt, json, jsonl, csv and parquet, with a column option.

- ``.txt``: one prompt per line (blank lines skipped);
- ``.json``: a list of strings (HPDv2's benchmark files) or of objects with the column;
- ``.jsonl``: one string or one object with the column per line;
- ``.csv``: a header row; ``.parquet``: any table (needs pyarrow).
Tabular formats read ``column`` (default ``"prompt"``); DrawBench's CSV calls it ``Prompts``
and Pick-a-Pic's parquet ``caption``. Errors name the file, and for a missing column, the
columns that exist. :func:`read_table` is the shared row reader (the ``score`` command reads
its image manifests with it). The toy world's prompt generator lives with the toy world.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_COLUMN = "prompt"
TABLE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
PROMPT_SUFFIXES = (".txt", *TABLE_SUFFIXES)


class PromptFileError(ValueError):
    """A prompt or manifest file is missing, malformed or lacks the requested column."""


def read_table(path: str | os.PathLike[str]) -> list[Any]:
    """Rows of a json/jsonl/csv/parquet file: dicts (or bare strings, for json/jsonl lists)."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(rows, list):
            raise PromptFileError(f"{path}: expected a JSON list, got {type(rows).__name__}")
        return rows
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise PromptFileError(f"{path}:{number}: not valid JSON ({err})") from None
        return rows
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PromptFileError(f"{path}: reading parquet needs pyarrow installed") from None
        return pq.read_table(path).to_pylist()
    raise PromptFileError(f"{path}: unsupported table format; use one of {TABLE_SUFFIXES}")


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
