"""What a job asks the scheduler for: GPUs, SLURM's nodes and tasks, threads and time.

Every model-running rule passes its device on the command line and asks for a GPU exactly when
that device is CUDA: the rollout, train, block and evaluate jobs one per process of the
training ranks (``train.nproc``), score and encode one for their models. On one machine the
GPUs that jobs share are counted once (:func:`machine_gpus`) and a job that needs more is
refused before it starts (:func:`checked_gpus`): Snakemake would quietly cap its request. A
multi-node job (``train.nodes`` > 1) asks SLURM for its nodes, one task per node and the GPUs
per node (:func:`ranks_slurm`, snakemake-executor-plugin-slurm's resource names).

Pure functions of a run's config and of the environment (torch-free).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from jagg_pipeline.config.run import RunConfig

GPU_ENV = "JAGG_GPUS"


def _list_gpus() -> subprocess.CompletedProcess:
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)


def machine_gpus(
    environ: Mapping[str, str],
    list_gpus: Callable[[], subprocess.CompletedProcess] = _list_gpus,
) -> tuple[int, str]:
    """The usable GPUs of the machine of ``environ``, and where the count came from.

    ``$JAGG_GPUS``, else the ``CUDA_VISIBLE_DEVICES`` list (CUDA stops at its first empty or
    negative entry), else the lines of ``nvidia-smi -L`` (``list_gpus``); 0 without it.
    """
    if GPU_ENV in environ:
        value = environ[GPU_ENV].strip()
        if not value.isdigit():
            raise ValueError(
                f"{GPU_ENV}={value!r}: give the number of GPUs this machine may use, "
                f"e.g. {GPU_ENV}=1"
            )
        return int(value), GPU_ENV
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break
            count += 1
        return count, "CUDA_VISIBLE_DEVICES"
    try:
        listing = list_gpus()
    except (OSError, subprocess.TimeoutExpired):
        return 0, "no nvidia-smi"
    if listing.returncode != 0:
        return 0, "nvidia-smi -L failed"
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines()), "nvidia-smi -L"


def on_cuda(device: str) -> bool:
    """Whether ``device`` (``cuda``, ``cuda:1``, ``cpu``, ...) is a CUDA device."""
    return device.split(":")[0] == "cuda"


def checked_gpus(job: str, count: int, why: str, limit: tuple[int, str] | None) -> int:
    """``count`` GPUs for ``job``, refused when ``limit`` (count, source) offers fewer.

    ``limit`` None: the cluster scheduler grants each job's GPUs (or they were granted
    already, inside a job).
    """
    if limit is not None and count > limit[0]:
        offered, source = limit
        raise ValueError(
            f"{job} needs {count} GPU(s) ({why}) but this machine offers {offered} ({source}); "
            f"if it has more, set {GPU_ENV}=N (or --resources gpu=N), else use a cpu device, "
            "fewer train.nproc, or a cluster (--profile workflow/profiles/slurm)"
        )
    return count


def score_gpus(config: RunConfig) -> tuple[int, str]:
    """One GPU when the reward models run on CUDA (the score job is one process), and why."""
    device = config.rewards.resolve_device(config.backbone.device)
    why = f"reward models (rewards.device, else backbone.device) on {device}"
    return int(on_cuda(device)), why


def ranks_gpus(config: RunConfig) -> tuple[int, str] | None:
    """One GPU per process of the training ranks when the policy runs on CUDA, and why.

    None for a multi-node job, whose GPUs per node are its ``gres`` (:func:`ranks_slurm`).
    """
    if config.train.nodes > 1:
        return None
    count = config.train.nproc if on_cuda(config.backbone.device) else 0
    return count, f"backbone.device {config.backbone.device}, train.nproc {config.train.nproc}"


def evaluate_gpus(config: RunConfig) -> tuple[int, str] | None:
    """The ranks' GPUs; one when only the reward models (rank 0 scores) run on CUDA."""
    ranks = ranks_gpus(config)
    if (
        ranks is not None
        and ranks[0] == 0
        and on_cuda(config.rewards.resolve_device(config.backbone.device))
    ):
        return score_gpus(config)
    return ranks


def ranks_slurm(
    run_id: str, config: RunConfig, *, runs_here: bool, in_apptainer: bool
) -> dict[str, Any]:
    """The SLURM resources of a job over the training ranks: train, rollout, block, evaluate.

    snakemake-executor-plugin-slurm's names; None leaves a resource out. One node: ``nodes``
    1 and nothing else (GPUs: :func:`ranks_gpus`). Several: ``nodes`` N, ``tasks`` N (sbatch
    --ntasks, one torchrun agent per node), ``mpi`` (the plugin's job step then runs the
    command as it is, without wrapping it in `srun -n1`: the command's own srun starts the
    agents), ``gres`` gpu:<train.nproc> per node when the policy runs on CUDA, and
    ``tasks_per_gpu`` 0, which keeps the plugin from deriving --ntasks-per-gpu from ``tasks``.
    ``runs_here``: the jobs run on this machine (no cluster executor), where srun cannot start
    a multi-node job; ``in_apptainer``: the command runs in an image, which has no srun.
    """
    train = config.train
    if train.nodes == 1:
        return dict(nodes=1, tasks=None, mpi=None, gres=None, tasks_per_gpu=None)
    if runs_here:
        raise ValueError(
            f"{run_id}: train.nodes {train.nodes} needs a SLURM cluster (srun starts a "
            "torchrun agent on each node); run with --profile workflow/profiles/slurm, or "
            "set train.nodes: 1"
        )
    if in_apptainer:
        raise ValueError(
            f"{run_id}: train.nodes {train.nodes} starts its agents with srun on the "
            "host, which the apptainer image lacks; run it without --sdm apptainer (the venv "
            "or --sdm conda), or set train.nodes: 1"
        )
    cuda = on_cuda(config.backbone.device)
    return dict(
        nodes=train.nodes,
        tasks=train.nodes,
        mpi="srun",
        gres=f"gpu:{train.nproc}" if cuda else None,
        tasks_per_gpu=0 if cuda else None,
    )


def block_runtime(rounds: int) -> int:
    """A block job's time limit in minutes: an hour, and half an hour per round."""
    return 60 + 30 * rounds
