"""The workflow on a real SLURM: `snakemake --profile slurm` with the profile installed as
docs/cluster.md says (`make slurm-profile`), against the one-node cluster that `.ci/slurm start`
brings up (.ci/run does). Without a cluster these tests skip, unless CI=true: then they fail.

- the reduced `all` runs through sbatch to completion and its outputs equal the local run's;
- its rounds as blocks (workflow.rounds_per_job 2): one allocation per run, the same outputs;
- a job that fails under SLURM is reported failed and snakemake exits non-zero, in bounded time;
- `scancel` of a running training job, then a rerun: the checkpoint of an uninterrupted run;
- under `--sdm apptainer` each job of the rounds runs in its rule's image (conftest.py's
  ``images``), with the same outputs as the local venv run.

Snakemake runs under `timeout -s KILL` (a status query that never answers would
hang it, deaf to SIGTERM); the jobs a test leaves behind are cancelled when the module ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from train_helpers import assert_same_checkpoint
from workflow_helpers import (
    REDUCED,
    ROOT,
    SNAKEMAKE,
    blocks_workdir,
    comparable_outputs,
    containers_config,
    copy_run,
    with_toy_world_of,
    without_blocks,
    write_config,
)

CI = os.environ.get("CI", "").lower() == "true"
# The profile waits 20 s before the first status check (polite on a shared cluster); the plugin
# then backs off by 10 s per check while nothing finishes. Tiny jobs want the shortest wait.
FAST_POLL = ("--slurm-init-seconds-before-status-checks", "2")
KILL_AFTER = 900
# One group: the tests (and their cleanup, which cancels leftover jobs) share the one cluster.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(KILL_AFTER + 300),
    pytest.mark.xdist_group("slurm"),
]


def slurm_missing() -> str | None:
    """Why no SLURM cluster can take jobs here, or None when one can."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "the SLURM client commands (sbatch, sinfo) are not installed"
    try:
        nodes = subprocess.run(
            ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s (is slurmctld running?)"
    if nodes.returncode != 0:
        return f"sinfo failed: {nodes.stderr.strip()}"
    if not {"idle", "mixed", "allocated"} & set(nodes.stdout.split()):
        return f"no SLURM node is up (sinfo says {nodes.stdout.strip() or 'nothing'!r})"
    return None


def jobs_in(workdir: Path) -> list[dict[str, str]]:
    """SLURM's jobs (finished ones too, for MinJobAge) that ran in ``workdir``."""
    listing = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--format=%i|%T|%k|%Z"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    jobs = [
        dict(zip(("id", "state", "comment", "workdir"), line.split("|"), strict=True))
        for line in listing.splitlines()
    ]
    return [job for job in jobs if Path(job["workdir"]) == workdir]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """The environment of a user who ran `make slurm-profile`; cancels leftover jobs after."""
    missing = slurm_missing()
    if missing:
        message = f"{missing}; start a one-node cluster with `.ci/slurm start` (as root)"
        if CI:
            pytest.fail(f"CI=true and no SLURM: {message}")
        pytest.skip(message)
    config_home = tmp_path_factory.mktemp("config-home")
    subprocess.run(
        ["make", "--no-print-directory", "slurm-profile", f"XDG_CONFIG_HOME={config_home}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    assert (config_home / "snakemake/slurm/config.yaml").is_file()
    yield {**os.environ, "XDG_CONFIG_HOME": str(config_home), "HF_HUB_OFFLINE": "1"}
    base = tmp_path_factory.getbasetemp()
    listing = subprocess.run(
        ["squeue", "--noheader", "--format=%i|%Z"], capture_output=True, text=True, timeout=30
    ).stdout
    leftovers = [
        line.split("|")[0]
        for line in listing.splitlines()
        if line.split("|")[-1].startswith(str(base))
    ]
    if leftovers:
        subprocess.run(["scancel", *leftovers], timeout=30)


def slurm_command(workdir: Path, *args: str, kill_after: int = KILL_AFTER) -> list[str]:
    """`snakemake --profile slurm ARGS` in ``workdir``, killed after ``kill_after`` seconds."""
    run = [*SNAKEMAKE, "--directory", str(workdir), "--profile", "slurm", *FAST_POLL, *args]
    return ["timeout", "-s", "KILL", str(kill_after), *run]


def on_slurm(workdir: Path, env: dict, *args: str, kill_after: int = KILL_AFTER):
    """Run :func:`slurm_command` to the end."""
    return subprocess.run(
        slurm_command(workdir, *args, kill_after=kill_after),
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )


def test_reduced_all_on_slurm_equals_the_local_run(slurm_env, reduced_all, tmp_path):
    write_config(tmp_path, REDUCED)
    started = time.monotonic()
    result = on_slurm(tmp_path, slurm_env, "all", "comparison")
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"reduced `all` on SLURM: {time.monotonic() - started:.0f} s")
    jobs = jobs_in(tmp_path)
    assert jobs and {job["state"] for job in jobs} == {"COMPLETED"}, jobs
    kinds = {job["comment"].split("_wildcards")[0] for job in jobs}
    # A round's rollout and score share one allocation (group "sample").
    # track and compare run on the submitting host (localrules), not through sbatch.
    expected = {"rule_toyworld_clip", "rule_train", "rule_evaluate", "rule_summary"}
    assert expected | {"rule_sample_rollout_score"} <= kinds, kinds
    assert not kinds & {"rule_track", "rule_compare"}, kinds
    assert (tmp_path / "results/all/tracking/tracked.json").is_file()
    ours, local = comparable_outputs(tmp_path), comparable_outputs(reduced_all)
    assert ours.keys() == local.keys()
    assert [name for name in ours if ours[name] != local[name]] == []


def test_a_block_of_rounds_on_slurm_equals_the_local_single_rounds(
    slurm_env, reduced_all, tmp_path
):
    """workflow.rounds_per_job 2: each run's two rounds are one sbatch allocation (the block
    job), and every output equals the local run of single-round jobs."""
    blocks_workdir(reduced_all, tmp_path, 2)
    result = on_slurm(tmp_path, slurm_env, "all")
    assert result.returncode == 0, result.stderr[-4000:]
    jobs = jobs_in(tmp_path)
    assert jobs and {job["state"] for job in jobs} == {"COMPLETED"}, jobs
    kinds = {job["comment"].split("_wildcards")[0] for job in jobs}
    assert "rule_block" in kinds and not kinds & {"rule_train", "rule_rollout"}, kinds
    ours = without_blocks(comparable_outputs(tmp_path))
    local = without_blocks(comparable_outputs(reduced_all))
    assert ours.keys() == local.keys()
    assert [name for name in ours if ours[name] != local[name]] == []


def test_a_failing_job_is_reported_and_snakemake_exits_non_zero(slurm_env, reduced_all, tmp_path):
    workdir = copy_run(reduced_all, tmp_path / "run")
    shutil.rmtree(workdir / "results/all")
    # A real fault: the toy transformer's weights cut in half, so every rollout fails to load
    # them (the encode job reads only the text encoders, which stay whole).
    weights = next((workdir / "results/toyworld/sd3/transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    started = time.monotonic()
    result = on_slurm(workdir, slurm_env, "all", kill_after=300)
    elapsed = time.monotonic() - started
    assert result.returncode not in (0, 124, 137), (result.returncode, result.stderr[-3000:])
    assert elapsed < 240, f"took {elapsed:.0f} s to give up"
    assert "Error in group sample" in result.stderr or "Error in rule rollout" in result.stderr
    states = {job["state"] for job in jobs_in(workdir)}
    assert "FAILED" in states, states
    assert not (workdir / "results/all/exact/seed-0/round-0000/rollout").exists()


def test_scancel_of_a_training_job_then_a_rerun_gives_the_uninterrupted_checkpoint(
    slurm_env, reduced_all, tmp_path
):
    workdir = copy_run(reduced_all, tmp_path / "run")
    checkpoint = "results/all/jagg/seed-0/round-0001/checkpoint"
    shutil.rmtree(workdir / checkpoint)
    proc = subprocess.Popen(
        slurm_command(workdir, checkpoint),
        cwd=workdir,
        env=slurm_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    running = None
    deadline = time.monotonic() + 300
    while running is None and time.monotonic() < deadline and proc.poll() is None:
        running = next(
            (
                job
                for job in jobs_in(workdir)
                if job["comment"].startswith("rule_train") and job["state"] == "RUNNING"
            ),
            None,
        )
        time.sleep(0.3)
    assert running is not None, "the training job never ran"
    time.sleep(2)  # into the job: importing, loading or training
    subprocess.run(["scancel", running["id"]], check=True, timeout=30)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode not in (0, 124, 137), stderr[-3000:]
    assert "CANCELLED" in stderr, stderr[-3000:]
    assert not (workdir / checkpoint).exists()  # nothing partial taken as complete

    resumed = on_slurm(workdir, slurm_env, checkpoint)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_checkpoint(workdir / checkpoint, reduced_all / checkpoint)


@pytest.mark.timeout(5400)  # the images' first build on a new machine comes first
def test_reduced_all_on_slurm_in_the_images_equals_the_local_venv_run(
    slurm_env, images, reduced_all, tmp_path
):
    # From the toy world: its build in the images is test_containers' (from scratch), and on
    # SLURM the first test's here; what this adds is every round's job on SLURM in its image.
    with_toy_world_of(reduced_all, tmp_path)
    write_config(tmp_path, containers_config(images))
    env = {**slurm_env, "PATH": images["PATH"]}
    result = on_slurm(tmp_path, env, "all", "comparison", "--sdm", "apptainer")
    assert result.returncode == 0, result.stderr[-4000:]
    jobs = jobs_in(tmp_path)
    assert jobs and {job["state"] for job in jobs} == {"COMPLETED"}, jobs
    ours, local = comparable_outputs(tmp_path), comparable_outputs(reduced_all)
    assert ours.keys() == local.keys()
    assert [name for name in ours if ours[name] != local[name]] == []
