"""A rerun costs what changed: each job's rerun trigger is what it reads of its run's config.

On a copy of the finished reduced `all` (workflow_helpers.REDUCED: two variants, two rounds,
evaluations after 0 and 2 rounds): more rounds run only the new rounds and what summarises
them; a reward setting no job reads reruns nothing; a value that training reads reruns every
training round and what follows, and none of the rollouts sampled before the first of them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from workflow_helpers import REDUCED, copy_run, job_counts, snakemake, write_config

pytestmark = pytest.mark.slow

RUNS = ("results/all/exact/seed-0", "results/all/jagg/seed-0")
# The jobs that summarise an experiment after any change of its runs.
SUMMARY_JOBS = {"summary": 1, "track": 1, "compare": 1, "all": 1}


def finished_copy(reduced_all: Path, workdir: Path, edit) -> Path:
    """``reduced_all`` (with its .snakemake records) copied to ``workdir``, its config edited."""
    copy_run(reduced_all, workdir)
    data = copy.deepcopy(REDUCED)
    edit(data)
    write_config(workdir, data)
    return workdir


def planned(workdir: Path) -> tuple[dict[str, int], str]:
    """The jobs a dry run of `all` plans in ``workdir`` (rule -> count) and its output."""
    result = snakemake(workdir, "--cores", "2", "all", "--dry-run", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    counts.pop("total", None)
    return counts, result.stdout


def planned_outputs(plan: str) -> str:
    """The ``output:`` lines of a dry run's jobs."""
    return "\n".join(line for line in plan.splitlines() if line.strip().startswith("output:"))


def checkpoint_manifests(workdir: Path, rounds: range) -> dict[str, bytes]:
    return {
        f"{run}/{r}": (workdir / run / f"round-{r:04d}/checkpoint/manifest.json").read_bytes()
        for run in RUNS
        for r in rounds
    }


def test_more_rounds_run_only_the_new_rounds_and_their_summary(reduced_all, tmp_path):
    def three_rounds(data):
        data["workflow"]["experiments"]["all"]["overrides"]["train"]["rounds"] = 3

    workdir = finished_copy(reduced_all, tmp_path, three_rounds)
    counts, plan = planned(workdir)
    # Per variant: round 2's rollout, score and train, the evaluation after 3 rounds.
    assert counts == {"rollout": 2, "score": 2, "train": 2, "evaluate": 2, **SUMMARY_JOBS}, plan
    outputs = planned_outputs(plan)
    assert "round-0000" not in outputs and "round-0001" not in outputs, outputs
    before = checkpoint_manifests(workdir, range(2))
    done = snakemake(workdir, "--cores", "2", "all", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_manifests(workdir, range(2)) == before
    for run in RUNS:
        assert (workdir / run / "round-0002/checkpoint/manifest.json").is_file()
        assert (workdir / run / "eval/trained-0003/metrics.json").is_file()
    again = snakemake(workdir, "--cores", "2", "all", "--dry-run", timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout


def test_a_reward_setting_that_no_job_reads_reruns_nothing(reduced_all, tmp_path):
    def unused_rewards(data):
        # Neither rewards.weights nor eval.metrics names them.
        data["rewards"] = {"pickscore": {"batch_size": 3}, "clipscore": {"dtype": "bfloat16"}}

    workdir = finished_copy(reduced_all, tmp_path, unused_rewards)
    result = snakemake(workdir, "--cores", "2", "all", "--dry-run", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Nothing to be done" in result.stdout + result.stderr, result.stdout


def test_a_value_that_training_reads_reruns_it_and_what_follows(reduced_all, tmp_path):
    def clip_range(data):
        data["grpo"] = {"clip_range": 1e-3}

    workdir = finished_copy(reduced_all, tmp_path, clip_range)
    counts, plan = planned(workdir)
    # Per variant: both training rounds, round 1's rollout and score (sampled from round 0's
    # checkpoint), the evaluation after 2 rounds; not round 0's rollout or the base policy's
    # evaluation.
    assert counts == {"rollout": 2, "score": 2, "train": 4, "evaluate": 2, **SUMMARY_JOBS}, plan
    outputs = planned_outputs(plan)
    assert "round-0000/rollout" not in outputs and "trained-0000" not in outputs, outputs
