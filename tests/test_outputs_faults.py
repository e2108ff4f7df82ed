"""Deleted, missing or unwritable outputs are noticed and named, never silently dropped.

- a run folder with a gap (a round, a round's metric lines, an evaluation that its config
  calls for) is refused by summarize and track, one line naming what is missing, nothing
  written; rounds beyond its config (an earlier, longer run) are not read;
- after a finished workflow run, a deleted round's scores and a deleted evaluation are
  rebuilt by the next run of the target, and the curves come out the same;
- a command that cannot write its output says so in one line naming the path (a workflow
  job's stderr is its log);
- every rename of an atomic writer is followed by a flush of the folder it renamed into, so
  that the new name survives a power cut.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from workflow_helpers import copy_run, snakemake, synthetic_run

from jagg_pipeline.io.artifacts import OutputError, atomic_directory, atomic_write_text
from jagg_pipeline.reports.summary import read_run
from jagg_pipeline.support.errors import InputError

GAPS = {
    "round folder": "round-0001",
    "round record": "round-0000/metrics/score.jsonl",
    "evaluation": "eval/trained-0002",
}


def jagg(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )


def two_runs(root: Path) -> list[str]:
    """Two synthetic runs (tracking off) under ``root``; their ``--run`` arguments."""
    args = []
    for variant in ("exact", "jagg"):
        folder = synthetic_run(root / variant / "seed-0", variant, tracking={"backend": "none"})
        args += ["--run", variant, "0", str(folder)]
    return args


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("gap", GAPS)
def test_a_run_with_a_gap_is_refused_naming_what_is_missing(tmp_path, gap):
    runs = two_runs(tmp_path)
    missing = tmp_path / "jagg/seed-0" / GAPS[gap]
    shutil.rmtree(missing) if missing.is_dir() else missing.unlink()
    with pytest.raises(InputError, match=f"^{missing}: missing"):
        read_run(tmp_path / "jagg/seed-0", "jagg", 0)
    summary = _one_error_line(jagg("summarize", *runs, "--out", "summary", cwd=tmp_path))
    assert f"{missing}: missing" in summary
    assert not (tmp_path / "summary").exists()  # refused before writing anything
    tracked = jagg("track", "--experiment", "all", *runs, "--out", "tracked.json", cwd=tmp_path)
    assert f"{missing}: missing" in _one_error_line(tracked)
    assert not (tmp_path / "tracked.json").exists()


def test_rounds_beyond_the_config_and_damaged_lines_are_handled(tmp_path):
    """Folders left by an earlier, longer run are not read; a damaged line names its file."""
    run = synthetic_run(tmp_path / "run", "jagg", rounds=2)
    before = read_run(run, "jagg", 0)
    shutil.copytree(run / "round-0001", run / "round-0002")
    shutil.copytree(run / "eval/trained-0002", run / "eval/trained-0004")
    after = read_run(run, "jagg", 0)
    assert after.lines == before.lines and after.evaluations == before.evaluations
    record = run / "round-0001/metrics/train.jsonl"
    record.write_text(record.read_text()[:-10] + "\n")
    with pytest.raises(InputError, match=f"^{record}:1: not a JSON metrics line"):
        read_run(run, "jagg", 0)


def test_a_command_that_cannot_write_its_output_names_it(tmp_path):
    runs = two_runs(tmp_path)
    (tmp_path / "results").write_text("a file where the results folder should be\n")
    out = tmp_path / "results/summary"
    line = _one_error_line(jagg("summarize", *runs, "--out", str(out), cwd=tmp_path))
    assert f"{out}: cannot write it: Not a directory" in line, line


def test_the_atomic_writers_name_the_output_they_cannot_write(tmp_path):
    target = tmp_path / "stage"
    # A writer refused inside the staging folder (no permission, read-only filesystem).
    with pytest.raises(OutputError) as refused, atomic_directory(target) as staging:
        raise PermissionError(errno.EACCES, "Permission denied", str(staging / "a.bin"))
    assert refused.value.strerror.startswith(f"{target}: cannot write it: Permission denied")
    assert not list(tmp_path.iterdir())  # no staging folder left
    # The same error about an input the writer reads is the input's, left as it is.
    elsewhere = tmp_path / "inputs/rollout.safetensors"
    with pytest.raises(PermissionError) as raised, atomic_directory(target):
        raise PermissionError(errno.EACCES, "Permission denied", str(elsewhere))
    assert not isinstance(raised.value, OutputError)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    with pytest.raises(OutputError) as refused:
        atomic_write_text(blocker / "sub/summary.json", "{}\n")
    assert refused.value.strerror.startswith(f"{blocker / 'sub'}: cannot write it")


def test_every_rename_of_the_atomic_writers_is_followed_by_a_flush_of_its_folder(
    tmp_path, monkeypatch
):
    """Files, folders (new, and replacing an old one) and a file renamed inside a staged
    folder (DCP's .metadata): each rename's folder is fsynced after the rename."""
    events: list[tuple[str, tuple[int, int]]] = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def folder_key(path: Path) -> tuple[int, int]:
        info = os.stat(path)
        return info.st_dev, info.st_ino

    def recording_fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            events.append(("flushed", (info.st_dev, info.st_ino)))
        fsync(fd)

    def recording(move):
        def moved(source, destination):
            move(source, destination)
            events.append(("renamed", folder_key(Path(destination).parent)))

        return moved

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording(replace))
    monkeypatch.setattr(os, "rename", recording(rename))
    atomic_write_text(tmp_path / "new/summary.json", "{}\n")
    for _ in range(2):  # made, then replacing the first
        with atomic_directory(tmp_path / "stage") as staging:
            (staging / "policy").mkdir()
            (staging / "policy/.metadata.tmp").write_text("keys\n")
            os.rename(staging / "policy/.metadata.tmp", staging / "policy/.metadata")
    renames = [index for index, (kind, _) in enumerate(events) if kind == "renamed"]
    assert len(renames) == 1 + 2 + 3  # the file; per folder its .metadata, then the swap
    unflushed = [events[i] for i in renames if ("flushed", events[i][1]) not in events[i + 1 :]]
    assert unflushed == []


@pytest.mark.slow
def test_deleted_outputs_of_a_finished_run_are_rebuilt_with_the_same_curves(tmp_path, reduced_all):
    copy_run(reduced_all, tmp_path)
    results = tmp_path / "results/all"
    summary = results / "summary"
    curves = (summary / "curves.png").read_bytes()
    before = json.loads((summary / "summary.json").read_text())
    scores = results / "exact/seed-0/round-0001/scores"
    evaluation = results / "jagg/seed-0/eval/trained-0000"
    shutil.rmtree(scores)
    shutil.rmtree(evaluation)
    plan = snakemake(tmp_path, "--cores", "2", "all", "--dry-run", timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    for rebuilt in (f"{scores}", f"{evaluation}"):
        assert rebuilt.removeprefix(f"{tmp_path}/") in plan.stdout, plan.stdout[-3000:]
    done = snakemake(tmp_path, "--cores", "2", "all", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (scores / "scores.parquet").is_file() and (evaluation / "metrics.json").is_file()
    assert (summary / "curves.png").read_bytes() == curves
    after = json.loads((summary / "summary.json").read_text())
    for variant in ("exact", "jagg"):
        del before[variant]["update_seconds"], after[variant]["update_seconds"]
    assert after == before
    again = snakemake(tmp_path, "--cores", "2", "all", timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr
