"""A run's bytes and reruns do not depend on where it runs, and its ranks die with their job.

The reduced `all` with one variant trained on two processes (workflow_helpers.REDUCED):

- run at ``--cores 1`` (from scratch) and at ``--cores 2`` (from the reduced `all`'s toy
  world, built at ``--cores 2``), every output is byte-identical (the launch pins every
  thread count of every rank);
- finished at ``train.nproc`` 2, the same run asked at ``train.nproc`` 1 has nothing to do,
  and with a round more it runs that round alone (from the two-process checkpoint);
- a SIGKILL of Snakemake's process group, or of the torchrun agent alone, leaves no rank
  behind within seconds, and the killed job's output never appears.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import (
    make_config,
    subprocess_env,
)
from train_helpers import write_config as write_run_config
from workflow_helpers import (
    REDUCED,
    ROOT,
    SNAKEMAKE,
    comparable_outputs,
    copy_run,
    job_counts,
    snakemake,
    with_toy_world_of,
    write_config,
)

pytestmark = pytest.mark.slow

RUN = "results/all/jagg/seed-0"


def _two_process_config(nproc: int = 2, rounds: int = 2) -> dict:
    data = copy.deepcopy(REDUCED)
    experiment = data["workflow"]["experiments"]["all"]
    experiment["overrides"]["train"]["rounds"] = rounds
    # Two ranks need two rollout micro-batches: batches of one group.
    experiment["variants"] = {
        "jagg": {"jagg": {"mode": "jagg"}, "train": {"nproc": nproc}, "sampler": {"batch_size": 4}}
    }
    return data


@pytest.fixture(scope="module")
def runs_by_cores(tmp_path_factory, request) -> dict[int, Path]:
    """The two-process run at --cores 1 and at --cores 2 (its workdirs): at 1 from scratch, at
    2 from the toy world and prompt pools that the reduced `all` built at --cores 2 (the same
    toy world settings), so that every output of both core counts is still compared."""
    workdirs = {}
    for cores in (1, 2):
        workdir = tmp_path_factory.mktemp(f"cores-{cores}")
        if cores == 2:  # asked for only now: another worker may be building it meanwhile
            with_toy_world_of(request.getfixturevalue("reduced_all"), workdir)
        write_config(workdir, _two_process_config())
        done = snakemake(workdir, "--cores", str(cores), "all", timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        workdirs[cores] = workdir
    return workdirs


def test_every_output_is_the_same_bytes_at_one_and_two_cores(runs_by_cores):
    one, two = (comparable_outputs(runs_by_cores[cores]) for cores in (1, 2))
    assert one.keys() == two.keys()
    different = sorted(path for path in one if one[path] != two[path])
    assert not different, different
    shards = [path for path in one if path.endswith(".distcp")]
    assert shards and any("/eval/" in path for path in one), sorted(one)


def test_a_run_finished_on_two_processes_continues_on_one(runs_by_cores, tmp_path):
    workdir = tmp_path / "continued"
    copy_run(runs_by_cores[2], workdir)
    write_config(workdir, _two_process_config(nproc=1))
    same = snakemake(workdir, "--cores", "2", "all", "--dry-run", timeout=300)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "Nothing to be done" in same.stdout + same.stderr, same.stdout

    write_config(workdir, _two_process_config(nproc=1, rounds=3))
    plan = snakemake(workdir, "--cores", "2", "all", "--dry-run", timeout=300)
    counts = job_counts(plan.stdout)
    counts.pop("total", None)
    # Round 2's rollout, score and train, the evaluation after 3 rounds, the summary jobs.
    expected = {"rollout": 1, "score": 1, "train": 1, "evaluate": 1}
    assert counts == {**expected, "summary": 1, "compare": 1, "track": 1, "all": 1}, plan.stdout
    before = {
        path: (workdir / RUN / path).read_bytes()
        for path in ("round-0001/checkpoint/manifest.json", "eval/trained-0002/metrics.json")
    }
    done = snakemake(workdir, "--cores", "2", "all", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all((workdir / RUN / path).read_bytes() == data for path, data in before.items())
    trained = workdir / RUN / "round-0002/checkpoint"
    assert "micro_batches_per_rank" in (trained / "metrics.jsonl").read_text()


# --------------------------------------------------------------------------------------------
# Orphans
# --------------------------------------------------------------------------------------------


def _processes_naming(text: str) -> dict[int, bool]:
    """Live processes whose command line or working folder holds ``text`` (Snakemake's jobs
    name their files relative to the workdir): pid -> whether it is a torchrun rank
    (LOCAL_RANK in its environment). Zombies have no command line and are left out."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile
            continue
        if cmdline and (text.encode() in cmdline or text in cwd):
            found[int(entry.name)] = b"\0LOCAL_RANK=" in b"\0" + environ
    return found


def _wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _kill_and_check(kill, marker: str, output: Path) -> None:
    """Wait for two ranks naming ``marker``, ``kill()``, then: none left within 10 s, and
    ``output`` never written (checked again after the ranks would have finished)."""
    _wait_for(lambda: sum(_processes_naming(marker).values()) >= 2, "two ranks", 300)
    kill()
    try:
        _wait_for(lambda: not _processes_naming(marker), "no process left", 10)
    finally:  # orphans of a failure would train on beside the next tests
        for pid in _processes_naming(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    time.sleep(5)
    assert not output.exists()


def test_a_sigkill_of_snakemakes_process_group_leaves_no_rank(runs_by_cores, tmp_path):
    # From the toy world: the first job over the ranks starts at once.
    workdir = with_toy_world_of(runs_by_cores[2], tmp_path / "killed")
    write_config(workdir, _two_process_config())
    job = subprocess.Popen(
        [*SNAKEMAKE, "--directory", str(workdir), "--cores", "2", "all"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        start_new_session=True,
    )
    try:
        _kill_and_check(
            lambda: (os.killpg(job.pid, signal.SIGKILL), job.wait()),
            str(workdir),
            workdir / RUN / "round-0000/rollout",
        )
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_a_sigkill_of_the_torchrun_agent_leaves_no_rank(tiny_sd3, base_rollout, tmp_path):
    config = write_run_config(make_config(tiny_sd3, train={"nproc": 2}), tmp_path / "run.yaml")
    rollouts, scores = base_rollout
    out = tmp_path / "checkpoint"
    stage = ["train", "--config", str(config), "--policy", "base", "--rollouts", str(rollouts)]
    stage += ["--scores", str(scores), "--out", str(out)]
    agent = subprocess.Popen(
        [sys.executable, "-m", "jagg_pipeline", "launch", *stage],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # The launch exec'd into the agent: its pid is the agent's.
        _kill_and_check(lambda: (agent.kill(), agent.wait()), str(out), out)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
