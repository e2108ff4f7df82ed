"""Lost files of a finished run under retention (``workflow.keep_every``) are made again and
leak nothing.

A finished run of 4 rounds keeping every 2nd (rounds 1 and 3 kept, 0 and 2 transient), built
once per module, then a copy of it per loss: a transient round's rollout metric line, its
train line, both, a kept round's line. Each rerun makes the lost line again, leaves no
``transient/`` folder behind (Snakemake keeps a temp() output that a target asks for, so the
lost lines are forced instead), leaves every kept file byte-identical and reruns the rounds
from the one after the last kept round before the loss to the end, and no more. The same
4 rounds as one block (``workflow.rounds_per_job: 4``) resume after the last kept checkpoint.
A finished run with nothing lost has nothing to do.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from block_helpers import round_lines
from stage_helpers import EVAL_PROMPTS, experiment, tiny_checkpoint, write_prompts
from workflow_helpers import (
    comparable_outputs,
    copy_run,
    job_counts,
    snakemake,
    without_blocks,
    write_config,
)

ROUNDS, KEEP_EVERY = 4, 2
RUN = "results/all/jagg/seed-0"
# What a loss in round 2 or 3 reruns: rounds 2 (transient) and 3 (kept), the evaluation after
# 4 rounds, the summary, its push and the comparison page, and the target.
ROUNDS_2_TO_3 = {
    "rollout_transient": 1,
    "score": 2,
    "train_transient": 1,
    "rollout": 1,
    "train": 1,
    "evaluate": 1,
    "summary": 1,
    "track": 1,
    "compare": 1,
    "all": 1,
    "total": 11,
}
LOSSES = {
    "transient-rollout-line": ["round-0002/metrics/rollout.jsonl"],
    "transient-train-line": ["round-0002/metrics/train.jsonl"],
    "transient-both-lines": ["round-0002/metrics/rollout.jsonl", "round-0002/metrics/train.jsonl"],
    "kept-train-line": ["round-0003/metrics/train.jsonl"],
}


def _finished(workdir: Path, base: Path, rounds_per_job: int) -> Path:
    """``workdir`` holding the finished 4-round run (tiny SD3, evaluated after 0 and 4 rounds)."""
    sections = experiment(
        "sd3",
        tiny_checkpoint("sd3", base),
        write_prompts(base / "eval_prompts.txt", EVAL_PROMPTS),
        train={"rounds": ROUNDS},
        eval={"every": ROUNDS, "max_prompts": 1, "samples_per_prompt": 1, "num_steps": 2},
    )
    sections["workflow"] = {
        "keep_every": KEEP_EVERY,
        "rounds_per_job": rounds_per_job,
        "experiments": {"all": {"seeds": [0], "variants": {"jagg": {}}}},
    }
    write_config(workdir, sections)
    done = snakemake(workdir, "--cores", "2", "all", timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(workdir.rglob("transient")), "a finished run keeps no transient folder"
    return workdir


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The finished run of single-round jobs (module-wide: tests copy it)."""
    base = tmp_path_factory.mktemp("retention-losses")
    return _finished(base / "workflow", base, 1)


def _rerun_after_loss(reference: Path, workdir: Path, lost: list[str]) -> dict[str, int]:
    """Copy ``reference`` (with its .snakemake metadata) to ``workdir``, delete ``lost`` (run
    files), run the target again; check what it left and return its job counts."""
    copy_run(reference, workdir)
    for name in lost:
        (workdir / RUN / name).unlink()
    result = snakemake(workdir, "--cores", "2", "all", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all((workdir / RUN / name).is_file() for name in lost)
    assert round_lines(workdir / RUN, ROUNDS) == round_lines(reference / RUN, ROUNDS)
    assert sorted(workdir.rglob("transient")) == []
    # Every kept file (checkpoints, rollouts, scores, evaluations, the summary) has the bytes
    # it had; files of timings aside (round_lines compares the metric lines without them).
    ours, before = (
        without_blocks(comparable_outputs(workdir)),
        without_blocks(comparable_outputs(reference)),
    )
    assert ours.keys() == before.keys()
    assert [name for name in ours if ours[name] != before[name]] == []
    return job_counts(result.stdout + result.stderr)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_finished_run_has_nothing_to_do(finished):
    again = snakemake(finished, "--cores", "2", "--dry-run", "all")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("loss", LOSSES)
def test_a_lost_line_is_made_again_from_the_last_kept_round_and_leaks_nothing(
    finished, tmp_path, loss
):
    counts = _rerun_after_loss(finished, tmp_path / "workflow", LOSSES[loss])
    assert counts == ROUNDS_2_TO_3


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_block_with_a_lost_line_resumes_after_its_last_kept_checkpoint(
    finished, tmp_path_factory
):
    base = tmp_path_factory.mktemp("retention-losses-block")
    # The prompt pools the single-round run encoded (the same keys): no encode jobs.
    shutil.copytree(finished / "results/conditioning", base / "workflow/results/conditioning")
    reference = _finished(base / "workflow", base, ROUNDS)
    counts = _rerun_after_loss(reference, base / "rerun", ["round-0002/metrics/train.jsonl"])
    assert counts == {"block": 1, "summary": 1, "track": 1, "compare": 1, "all": 1, "total": 5}
    record = json.loads((base / "rerun" / RUN / "round-0003/block.json").read_text())
    assert record["resumed_at"] == 2
