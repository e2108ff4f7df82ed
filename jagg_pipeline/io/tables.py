"""Tables on disk: reading json/jsonl/csv/parquet rows and writing csv/jsonl/parquet atomically.

Prompt files, image manifests and the per-sample score tables between the score and train
stages all go through here, the numbers of every table the reports print through
:func:`format_number`, and their tables through :func:`markdown_table` and :func:`html_table`.
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from jagg_pipeline.io.artifacts import atomic_write_bytes, atomic_write_text
from jagg_pipeline.support.errors import InputError

TABLE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
WRITE_SUFFIXES = (".csv", ".jsonl", ".parquet")


class TableError(InputError):
    """A table file is missing, malformed or lacks the requested column."""


def format_number(value: float, spec: str = ".3f") -> str:
    """``value`` in format ``spec``, a value that rounds to zero printed as zero does.

    ``format(-0.0001, ".3f")`` is ``-0.000``, which reads as a measured negative; here it is
    ``0.000`` (``+0.000`` for a ``+`` spec), as exactly 0.0 prints, padding kept.
    """
    text = format(value, spec)
    if isinstance(value, float) and format(abs(value), spec) == format(0.0, spec):
        return format(0.0, spec)
    return text


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table of the cells as given (one header row), ending with a newline."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def html_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """The same table as HTML, each cell escaped."""

    def row(tag: str, cells: Sequence[str]) -> str:
        return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>\n"

    return "<table>\n" + row("th", head) + "".join(row("td", r) for r in rows) + "</table>"


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of file ``path``.

    A missing or unreadable file, or bytes that are not UTF-8, are one TableError naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        bad = err.object[err.start : err.start + 1]
        raise TableError(
            f"{path}: not UTF-8 text (byte {err.start} is {bad!r}); save the file as UTF-8"
        ) from None
    except OSError as err:
        raise TableError(f"{path}: cannot read it ({err.strerror or err})") from None


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    r"""The lines of UTF-8 text file ``path`` (:func:`read_text`), split at line ends only.

    Line ends are ``\n``, ``\r\n`` and ``\r`` (text mode reads all three as ``\n``).
    ``str.splitlines`` would also split at U+2028, U+2029, U+0085, vertical tabs and form
    feeds, which a prompt (or a JSON string) may hold: one line would become two.
    """
    return read_text(path).split("\n")


def read_table(path: str | os.PathLike[str]) -> list[Any]:
    """Rows of a json/jsonl/csv/parquet file: dicts (or bare strings, for json/jsonl lists)."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            rows = json.loads(read_text(path))
        except json.JSONDecodeError as err:
            raise TableError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(rows, list):
            raise TableError(f"{path}: expected a JSON list, got {type(rows).__name__}")
        return rows
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(read_lines(path), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise TableError(f"{path}:{number}: not valid JSON ({err})") from None
        return rows
    if suffix == ".csv":
        try:
            return list(csv.DictReader(io.StringIO(read_text(path), newline="")))
        except csv.Error as err:
            raise TableError(f"{path}: not valid CSV ({err})") from None
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TableError(f"{path}: reading parquet needs pyarrow installed") from None
        # One file: ParquetFile reads it without pyarrow.dataset, which imports pandas (0.3 s).
        try:
            return pq.ParquetFile(path).read().to_pylist()
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise TableError(f"{path}: not a readable parquet file ({err})") from None
    raise TableError(f"{path}: unsupported table format; use one of {TABLE_SUFFIXES}")


def write_table(path: str | os.PathLike[str], rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` (dicts with the same keys) as csv, jsonl or parquet, by suffix, atomically.

    The table is made in memory and its digest recorded as it is written
    (:func:`~jagg_pipeline.io.artifacts.atomic_write_bytes`).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in WRITE_SUFFIXES:
        raise TableError(
            f"{path}: cannot write {suffix or 'no suffix'}; use one of {WRITE_SUFFIXES}"
        )
    if not rows:
        raise TableError(f"{path}: no rows to write")
    if suffix == ".jsonl":
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, buffer.getvalue())
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows), sink)
        atomic_write_bytes(path, sink.getvalue())
    return path
