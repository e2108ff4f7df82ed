"""`verify` finds what rotted in a finished run's kept files, names each, and touches nothing.

Snakemake judges a finished target by file times, so after a flipped byte in a kept
checkpoint it says "Nothing to be done"; `verify` re-hashes every output's files against its
manifest. Each fault here is real damage to a copy of the reduced `all` run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3
from train_helpers import flip_byte
from workflow_helpers import copy_run, snakemake

RUN = "results/all/exact/seed-0"


def verify(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m jagg_pipeline verify ARGS`` run in ``workdir``, as the docs say."""
    return subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", "verify", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too): relative path -> sha256 of its bytes."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def bad_lines(result: subprocess.CompletedProcess) -> list[str]:
    return sorted(line for line in result.stdout.splitlines() if line.startswith("BAD "))


@pytest.fixture
def finished(reduced_all, tmp_path):
    """A private copy of the reduced `all` workdir (with Snakemake's metadata)."""
    copy_run(reduced_all, tmp_path)
    return tmp_path


@pytest.mark.slow
def test_a_clean_run_verifies_every_output_it_holds(finished):
    manifests = sorted((finished / "results").rglob("manifest.json"))
    result = verify(finished)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every stage output and both toy-world folders list their files; none is unverifiable.
    assert f"verified {len(manifests)} outputs, " in result.stdout
    assert "all as their manifests say" in result.stdout
    assert "UNVERIFIED" not in result.stdout and "BAD" not in result.stdout
    assert {m.parent.name for m in manifests} >= {"checkpoint", "rollout", "scores", "sd3", "clip"}
    # A file or folder inside an output, or its manifest, verifies that whole output.
    checkpoint = f"{RUN}/round-0000/checkpoint"
    for inside in (
        f"{checkpoint}/policy",
        f"{checkpoint}/policy/.metadata",
        f"{checkpoint}/manifest.json",
    ):
        one = verify(finished, inside)
        assert one.returncode == 0 and "verified 1 output, 7 files" in one.stdout, one.stdout
    # A folder of no outputs is an error, not a pass.
    none = verify(finished, "results/logs")
    assert none.returncode == 1 and "no stage output there" in none.stderr, none.stderr


@pytest.mark.slow
def test_each_kind_of_damage_is_named_once_and_nothing_is_touched(finished):
    round0, round1 = finished / RUN / "round-0000", finished / RUN / "round-0001"
    flipped = round0 / "checkpoint/policy/__0_0.distcp"
    flip_byte(flipped)
    truncated = round1 / "rollout/shard-0.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    deleted = round1 / "checkpoint/trainer/rng.safetensors"
    deleted.unlink()
    added = round0 / "scores/notes.txt"
    added.write_text("a file of the user's\n")
    garbled = finished / "results/all/jagg/seed-0/eval/trained-0000/manifest.json"
    garbled.write_text(garbled.read_text()[:40])
    lost = finished / "results/all/jagg/seed-0/round-0001/scores/manifest.json"
    lost.unlink()
    # An input rebuilt with other bytes, its own manifest updated to match: it verifies,
    # but the checkpoint trained from it was made from what it held before.
    summary = finished / "results/all/jagg/seed-0/round-0000/scores/summary.json"
    summary.write_text(summary.read_text() + "\n")
    manifest_file = summary.with_name("manifest.json")
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["summary.json"] = blake3(summary.read_bytes()).hexdigest()
    manifest_file.write_text(json.dumps(manifest))

    # Snakemake sees the files there and their times in order: the damage goes unnoticed.
    plan = snakemake(finished, "--cores", "1", "all", "comparison", "--dry-run", timeout=300)
    assert "Nothing to be done" in plan.stdout + plan.stderr, plan.stdout[-2000:]

    before = tree(finished)
    result = verify(finished, "results", "--jobs", "2", "--json", str(finished.parent / "v.json"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert tree(finished) == before
    rel = lambda path: path.relative_to(finished).as_posix()  # noqa: E731
    expected = {
        rel(flipped): "corrupt or changed since it was written",
        rel(truncated): "corrupt or changed since it was written",
        rel(deleted): "missing, though manifest.json lists it",
        rel(added): "not listed in manifest.json",
        rel(garbled): "unreadable manifest",
        rel(lost): "missing: this output was finished once",
        rel(finished / "results/all/jagg/seed-0/round-0000/checkpoint/manifest.json"): (
            "made from input 'scores'"
        ),
    }
    lines = bad_lines(result)
    assert len(lines) == len(expected), lines
    for path, reason in expected.items():
        assert [line for line in lines if line.startswith(f"BAD {path}: {reason}")], (path, lines)
    # The repair list names each damaged output once.
    repairs = [line.strip() for line in result.stdout.splitlines() if line.startswith("  rm -r ")]
    assert len(repairs) == len(set(repairs)) == len(expected)
    findings = json.loads((finished.parent / "v.json").read_text())
    assert len(findings["problems"]) == len(expected) and findings["unverifiable"] == []
    # One file at a time finds the same.
    assert bad_lines(verify(finished, "results", "--jobs", "1")) == lines


@pytest.mark.slow
def test_the_repair_it_prints_restores_the_same_bytes(finished):
    checkpoint = finished / RUN / "round-0000/checkpoint"

    def data(folder: Path) -> dict[str, str]:  # its timings aside
        return {name: h for name, h in tree(folder).items() if name != "metrics.jsonl"}

    original = data(checkpoint)
    flip_byte(checkpoint / "policy/__0_0.distcp")
    found = verify(finished, f"{RUN}/round-0000")
    assert found.returncode == 1
    assert f"  rm -r {RUN}/round-0000/checkpoint" in found.stdout.splitlines()
    shutil.rmtree(checkpoint)
    rerun = snakemake(finished, "--cores", "2", "all", "comparison", timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert data(checkpoint) == original
    again = verify(finished)
    assert again.returncode == 0, again.stdout


def test_a_path_that_is_not_there_is_one_line(tmp_path):
    result = verify(tmp_path, "no-such-folder")
    assert result.returncode == 1
    assert result.stderr.strip() == "verify: no-such-folder: no such file or folder to verify"
