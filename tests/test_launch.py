"""What a job over the training ranks becomes (workflow.launch) and how its ranks die with it.

- one process: the plain interpreter; several on one node: torchrun --standalone; several
  nodes: srun with one launch per node, each a torchrun agent of a c10d rendezvous whose
  endpoint comes from the job's node list;
- every thread-count knob is pinned to one thread in every case;
- a rank of a launch asks the kernel to kill it with its agent, and refuses to start when the
  agent is already gone; anywhere else nothing changes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jagg_pipeline.support.lifetime import LAUNCHER_PID, RANK_THREADS_ENV
from jagg_pipeline.workflow.launch import (
    THREAD_VARIABLES,
    LaunchError,
    World,
    launch,
    rendezvous_endpoint,
)

STAGE = ["train", "--config", "run/config.yaml", "--out", "ckpt"]
PINS = {
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    RANK_THREADS_ENV,
}


def _never_run(*args, **kwargs):
    raise AssertionError(f"nothing should run here: {args}")


def test_one_process_is_the_stage_on_the_plain_interpreter():
    became = launch(World(1, 1), "py", STAGE, {}, launcher_pid=42, run=_never_run)
    assert became.argv == ("py", "-m", "jagg_pipeline", *STAGE)
    assert {key for key, value in became.env.items() if value == "1"} >= PINS
    assert became.env[LAUNCHER_PID] == "42"


def test_several_processes_on_one_node_are_a_standalone_torchrun():
    became = launch(World(1, 3), "py", STAGE, {}, launcher_pid=42, run=_never_run)
    torchrun = ("py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3")
    assert became.argv == (*torchrun, "-m", "jagg_pipeline", *STAGE)
    assert set(THREAD_VARIABLES) <= became.env.keys()


def _slurm(calls: list[list[str]]):
    def run(command, **kwargs):
        calls.append(command)
        stdout = {"squeue": "gpu[07-08]\n", "scontrol": "gpu07\ngpu08\n"}[command[0]]
        return subprocess.CompletedProcess(command, 0, stdout=stdout, stderr="")

    return run


def test_several_nodes_start_one_launch_per_node_with_the_rendezvous_of_the_first():
    calls: list[list[str]] = []
    environ = {"SLURM_JOB_ID": "123456"}
    outer = launch(World(2, 4), "py", STAGE, environ, launcher_pid=42, run=_slurm(calls))
    assert calls == [
        ["squeue", "--noheader", "--jobs=123456", "--format=%N"],
        ["scontrol", "show", "hostnames", "gpu[07-08]"],
    ]
    srun = ("srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=4")
    per_node = ("py", "-m", "jagg_pipeline", "launch", "--rendezvous=gpu07:32956")
    assert outer.argv == (*srun, "--kill-on-bad-exit=1", *per_node, *STAGE)

    inner = launch(World(2, 4), "py", STAGE, environ, 43, rendezvous="gpu07:32956")
    assert inner.argv == (
        *("py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4"),
        *("--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:32956", "--rdzv-id=123456"),
        *("-m", "jagg_pipeline", *STAGE),
    )
    assert inner.env[LAUNCHER_PID] == "43"


def test_the_node_list_slurm_gives_is_used_without_asking_squeue():
    calls: list[list[str]] = []
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    assert rendezvous_endpoint(environ, _slurm(calls)) == "gpu07:29507"
    assert [command[0] for command in calls] == ["scontrol"]


@pytest.mark.parametrize("environ", [{}, {"SLURM_JOB_ID": "abc"}])
def test_several_nodes_outside_a_slurm_job_are_refused_naming_the_fix(environ):
    with pytest.raises(LaunchError, match=r"SLURM_JOB_ID is not set.*--profile"):
        launch(World(2, 1), "py", STAGE, environ, launcher_pid=42, run=_never_run)


def test_a_node_list_scontrol_cannot_expand_is_refused():
    def failing(command, **kwargs):
        raise subprocess.CalledProcessError(1, command)

    with pytest.raises(LaunchError, match="scontrol show hostnames"):
        rendezvous_endpoint({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "x"}, failing)


# A child that reports its parent-death signal (prctl PR_GET_PDEATHSIG) after the check.
_REPORT_DEATH_SIGNAL = """
import ctypes, os
from jagg_pipeline.support.lifetime import LAUNCHER_PID, die_with_launcher
die_with_launcher()
signal = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0)
print(signal.value, LAUNCHER_PID in os.environ)
"""


def _child(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _REPORT_DEATH_SIGNAL],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_rank_of_a_launch_is_killed_with_its_agent():
    ran = _child(**{LAUNCHER_PID: str(os.getpid()), "LOCAL_RANK": "0"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["9", "False"]  # SIGKILL; its own children are not tied


@pytest.mark.parametrize(
    "env",
    [{}, {"LOCAL_RANK": "0"}, {LAUNCHER_PID: "1"}],
    ids=["no-launch", "torchrun-of-its-own", "not-a-rank"],
)
def test_outside_a_launch_rank_nothing_changes(env):
    ran = _child(**env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[0] == "0"


def test_a_rank_whose_agent_is_gone_does_not_start():
    ran = _child(**{LAUNCHER_PID: "1", "LOCAL_RANK": "0"})  # its parent is this test, not 1
    assert ran.returncode == 1
    assert "the torchrun agent (pid 1) is gone" in ran.stderr
