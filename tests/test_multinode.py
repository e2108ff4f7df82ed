"""Training on several nodes: ``train.nodes`` x ``train.nproc`` processes.

- two torchrun agents joined by a c10d rendezvous on loopback (what srun starts on two nodes)
  train the weights of one node with two processes, bit for bit;
- under the slurm profile a two-node training job asks for two nodes, one task per node and
  the node's GPUs, and its command starts the agents with srun and a c10d rendezvous on the
  job's first node (a dry run; a two-node SLURM cannot run here), and the sbatch call the
  plugin builds from those resources says so;
- its launch command, with SLURM_JOB_NODELIST hidden as the plugin's job step hides it,
  takes the first node from squeue and starts one agent per node through srun (srun,
  squeue and scontrol stubbed);
- locally, a multi-node job is refused before anything runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from train_helpers import (
    free_port,
    make_config,
    subprocess_env,
    write_config,
)
from workflow_helpers import REDUCED, ROOT, snakemake
from workflow_helpers import write_config as write_workflow_config

SLURM_PROFILE = str(ROOT / "workflow/profiles/slurm")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _train_args(config: Path, rollout: tuple[Path, Path], out: Path) -> list[str]:
    rollouts, scores = rollout
    return [
        "-m",
        "jagg_pipeline",
        "train",
        "--config",
        str(config),
        "--policy",
        "base",
        "--rollouts",
        str(rollouts),
        "--scores",
        str(scores),
        "--out",
        str(out),
    ]


def _weights(config, checkpoint: Path) -> dict[str, torch.Tensor]:
    from jagg_pipeline.stages.policy import load_policy

    return load_policy(config, checkpoint).transformer.state_dict()


def _lines_without_times(checkpoint: Path) -> list[dict]:
    lines = [json.loads(x) for x in (checkpoint / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith("time.")} for line in lines]


@pytest.mark.slow
def test_two_agents_on_loopback_train_what_one_node_of_two_processes_trains(
    tiny_sd3, base_rollout, tmp_path
):
    config = make_config(tiny_sd3, train={"nodes": 2, "nproc": 1})
    path = write_config(config, tmp_path / "config.yaml")
    env = subprocess_env()

    # Two nodes of one process each: one agent per "node", a c10d rendezvous on loopback.
    # The first hosts the rendezvous store (is_host); both would claim it on one machine.
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                endpoint,
                "--rdzv_id",
                "jagg-multinode-test",
                "--rdzv_conf",
                f"is_host={int(host)}",
                "--local_addr",
                "127.0.0.1",
                *_train_args(path, base_rollout, tmp_path / "two-nodes"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in (True, False)
    ]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-4000:]

    # One node of two processes: the workflow's single-node launch.
    one_node = [*TORCHRUN, "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*one_node, *_train_args(path, base_rollout, tmp_path / "one-node")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]

    two, one = _weights(config, tmp_path / "two-nodes"), _weights(config, tmp_path / "one-node")
    base = _weights(config, "base")
    assert two.keys() == one.keys() == base.keys()
    assert all(torch.equal(two[name], one[name]) for name in one)
    assert any(not torch.equal(one[name], base[name]) for name in one)  # it trained
    assert _lines_without_times(tmp_path / "two-nodes") == _lines_without_times(
        tmp_path / "one-node"
    )
    assert _lines_without_times(tmp_path / "one-node")[0]["micro_batches_per_rank"] == 1


def _two_node_config(workdir: Path) -> None:
    """The reduced `all` with variant jagg trained on 2 nodes x 2 CUDA processes."""
    data = json.loads(json.dumps(REDUCED))
    data["backbone"] = {"device": "cuda"}
    variants = data["workflow"]["experiments"]["all"]["variants"]
    # Four ranks need four micro-batches per optimizer step: four groups, one per batch.
    variants["jagg"] |= {
        "train": {"nodes": 2, "nproc": 2},
        "sampler": {"prompts_per_round": 4, "batch_size": 4},
    }
    write_workflow_config(workdir, data)


def _planned_trains(output: str) -> list[dict]:
    """The train jobs of a dry run's output: wildcards, threads, resources, shell command."""
    jobs: list[dict] = []
    for line in map(str.strip, output.splitlines()):
        if match := re.match(r"(?:local)?rule (\w+):$", line):
            jobs.append({"rule": match[1], "threads": 1, "resources": {}, "wildcards": {}})
        elif jobs and (match := re.match(r"(wildcards|resources): (.*)$", line)):
            jobs[-1][match[1]] = dict(item.split("=", 1) for item in match[2].split(", "))
        elif jobs and (match := re.match(r"threads: (\d+)$", line)):
            jobs[-1]["threads"] = int(match[1])
        elif jobs and line.startswith("Shell command: "):
            jobs[-1]["shell"] = line
    return [job for job in jobs if job["rule"].removesuffix("_transient") in RANKS_RULES]


# The rules whose jobs run over the training ranks (torchrun on every node).
RANKS_RULES = ("train", "rollout", "evaluate")


def _sbatch_call(resources: dict[str, str], threads: int) -> str:
    """The sbatch call snakemake-executor-plugin-slurm builds for a job of ``resources``."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__

    values = Resources(
        {key: int(value) if value.isdigit() else value for key, value in resources.items()}
    )
    job = SimpleNamespace(resources=values, threads=threads)
    params = {
        "run_uuid": "uuid",
        "slurm_logfile": "log",
        "comment_str": "rule_train",
        "account": "",
        "partition": "",
        "workdir": "/work",
    }
    return get_submit_command(job, params) + set_gres_string(job)


@pytest.fixture(scope="module")
def two_node_plan(tmp_path_factory) -> list[dict]:
    """The jobs over the training ranks (train, rollout, evaluate) of a dry run of the
    two-node config under the slurm profile."""
    workdir = tmp_path_factory.mktemp("two-nodes")
    _two_node_config(workdir)
    # A dry run caps threads at --cores (1 unless given); a cluster run does not.
    result = snakemake(
        workdir, "all", "-n", "-p", "--profile", SLURM_PROFILE, "--cores", "4", timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return _planned_trains(result.stdout)


def test_on_slurm_a_two_node_training_asks_for_the_nodes_and_runs_srun_with_c10d(two_node_plan):
    """Train, rollout and evaluate of a two-node run all start over the two nodes' ranks."""
    jobs = two_node_plan
    assert {job["wildcards"]["variant"] for job in jobs} == {"exact", "jagg"}
    assert {job["rule"].removesuffix("_transient") for job in jobs} == set(RANKS_RULES)
    for job in jobs:
        resources, shell = job["resources"], job["shell"]
        rule = job["rule"].removesuffix("_transient")
        if job["wildcards"]["variant"] == "exact":  # one node, one process: as before
            assert resources["nodes"] == "1" and resources["gpu"] == "1", job
            assert not {"tasks", "mpi", "gres", "tasks_per_gpu"} & resources.keys(), job
            assert f"{sys.executable} -m jagg_pipeline launch {rule} --config" in shell, job
            continue
        # Two nodes, one task (torchrun agent) per node with the node's 2 GPUs and 2 cores.
        assert resources["nodes"] == "2" and resources["tasks"] == "2", job
        assert resources["gres"] == "gpu:2" and "gpu" not in resources, job
        assert resources["mpi"] == "srun" and resources["tasks_per_gpu"] == "0", job
        assert job["threads"] == 2 and resources["cpus_per_task"] == "2", job
        # The world size is read by the launch at run time (so it reruns nothing).
        assert f"{sys.executable} -m jagg_pipeline launch {rule} --config" in shell, job

        sbatch = _sbatch_call(resources, job["threads"]).split()
        assert {"--nodes=2", "--ntasks=2", "--cpus-per-task=2", "--gres=gpu:2"} <= set(sbatch)
        assert not [flag for flag in sbatch if flag.startswith(("--gpus", "--ntasks-per-gpu"))]


# A train command of the jagg variant of _two_node_config, as its run config would give it.
TWO_NODE_TRAIN = ["train", "--config", "config.yaml", "--set", "train.nodes=2"]
TWO_NODE_TRAIN += ["--set", "train.nproc=2", "--set", "sampler.prompts_per_round=4"]
TWO_NODE_TRAIN += ["--set", "sampler.batch_size=4", "--out", "ckpt"]


def test_the_launch_asks_squeue_for_the_nodes_when_slurm_hides_them(tmp_path):
    """The plugin's job step passes SLURM_JOB_ID alone of SLURM's variables: the launch of a
    two-node job runs srun with one launch per node, given the rendezvous endpoint (the
    first node of the job's node list from squeue, a port from the job id); each of those
    becomes a torchrun agent of 2 processes joined by c10d (srun, squeue, scontrol stubbed).
    """
    _two_node_config(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": 'printf "%s\\n" "$@"',
        "squeue": 'test "$*" = "--noheader --jobs=123456 --format=%N" && echo "gpu[07-08]"',
        "scontrol": 'test "$*" = "show hostnames gpu[07-08]" && printf "gpu07\\ngpu08\\n"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123456"}
    stage = TWO_NODE_TRAIN

    def launch(*args: str) -> list[str]:
        ran = subprocess.run(
            [sys.executable, "-m", "jagg_pipeline", "launch", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        return ran.stdout.splitlines()

    srun = launch(*stage)  # the stub srun prints its arguments
    per_node = [sys.executable, "-m", "jagg_pipeline", "launch", "--rendezvous=gpu07:32956"]
    # 32956 = 29500 + 123456 % 10000
    assert srun == [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=2",
        "--kill-on-bad-exit=1",
        *per_node,
        *stage,
    ]
    agent = launch("--dry-run", *per_node[4:], *stage)
    assert len(agent) == 1
    assert agent[0].endswith(
        f"{sys.executable} -m torch.distributed.run --nnodes=2 --nproc-per-node=2"
        " --rdzv-backend=c10d --rdzv-endpoint=gpu07:32956 --rdzv-id=123456"
        f" -m jagg_pipeline {' '.join(stage)}"
    )
    assert "MKL_NUM_THREADS=1 " in agent[0] and "OMP_NUM_THREADS=1 " in agent[0]


def test_a_multi_node_launch_outside_slurm_says_what_to_use(tmp_path):
    _two_node_config(tmp_path)
    ran = subprocess.run(
        [sys.executable, "-m", "jagg_pipeline", "launch", *TWO_NODE_TRAIN],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 1
    assert "SLURM_JOB_ID is not set" in ran.stderr and "--profile" in ran.stderr


def test_a_multi_node_training_is_refused_without_a_cluster(tmp_path):
    _two_node_config(tmp_path)
    result = snakemake(tmp_path, "all", "--dry-run", env={"JAGG_GPUS": "4"}, timeout=300)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "train.nodes 2 needs a SLURM cluster" in said, said[-3000:]
    assert "--profile workflow/profiles/slurm" in said, said[-3000:]
