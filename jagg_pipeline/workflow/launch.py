"""How a job over the training ranks starts: the command and environment of each process.

Train, rollout, block and evaluate run the FSDP2-sharded policy on every rank of
``train.nodes`` x ``train.nproc`` processes. The workflow's rules start them through
``python -m jagg_pipeline launch STAGE ...``, which reads the world size from the run config
at run time instead of the rule spelling it: the world size does not change what a job
computes (a checkpoint resumes on any number of processes), so it stays out of the rules'
params, which Snakemake compares to decide reruns. The launch replaces itself (``exec``) by

- the stage on the plain interpreter, for one process on one node;
- ``torch.distributed.run --standalone`` over ``train.nproc`` processes on one node;
- for ``train.nodes`` > 1 (a SLURM job): srun starting one launch per node, each of which
  becomes a torchrun agent joined to the others by a c10d rendezvous on the job's first node.

Every process computes on one thread (:data:`RANK_THREADS`): each knob that sets a thread
count is pinned in its environment (:func:`pinned_environment`), whatever Snakemake derived
from ``--cores``, since a reduction split over another number of threads sums in another
order and the checkpoint's bytes would depend on the machine's core count. The processes a
torchrun agent starts die with it (:mod:`jagg_pipeline.support.lifetime`): their launcher's
pid travels in :data:`~jagg_pipeline.support.lifetime.LAUNCHER_PID`.

Pure functions of the world size, the environment and the stage's arguments (torch-free).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from jagg_pipeline.support.lifetime import LAUNCHER_PID, RANK_THREADS_ENV

# Threads of each rank's computation (the rules ask for one core per process).
RANK_THREADS = 1
# Every variable that sets a thread count of a library torch or numpy may use: OpenMP,
# MKL, OpenBLAS/GotoBLAS, Accelerate, numexpr (Snakemake sets them to the job's threads), and
# ours, read by the stage for torch's intra- and inter-op pools.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    RANK_THREADS_ENV,
)
# torchrun's default rendezvous port; a multi-node job adds its job id modulo 10000, so that
# two jobs sharing a first node do not collide.
RENDEZVOUS_PORT = 29500


@dataclass(frozen=True)
class World:
    """The processes of a job over the training ranks: ``nodes`` x ``nproc``."""

    nodes: int
    nproc: int


@dataclass(frozen=True)
class Launch:
    """A process to become: its arguments and the variables set on top of the environment."""

    argv: tuple[str, ...]
    env: Mapping[str, str]

    def describe(self) -> str:
        """The launch as one shell line (``K=V ... command``)."""
        assigned = [f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items())]
        return " ".join([*assigned, *map(shlex.quote, self.argv)])


def pinned_environment(launcher_pid: int) -> dict[str, str]:
    """The variables every rank runs under: each thread count, and who launched it."""
    return {
        **dict.fromkeys(THREAD_VARIABLES, str(RANK_THREADS)),
        LAUNCHER_PID: str(launcher_pid),
    }


def launch(
    world: World,
    python: str,
    stage_argv: Sequence[str],
    environ: Mapping[str, str],
    launcher_pid: int,
    rendezvous: str | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> Launch:
    """What the launch of ``stage_argv`` (``STAGE --config ...``) becomes on this node.

    ``rendezvous`` is the endpoint a multi-node job's outer launch chose (None: this is the
    outer launch, or a one-node job); ``run`` runs squeue and scontrol for it.
    """
    env = pinned_environment(launcher_pid)
    stage = ["-m", "jagg_pipeline", *stage_argv]
    if world.nodes > 1 and rendezvous is None:
        endpoint = rendezvous_endpoint(environ, run)
        return Launch(
            (
                "srun",
                f"--nodes={world.nodes}",
                f"--ntasks={world.nodes}",
                "--ntasks-per-node=1",
                f"--cpus-per-task={world.nproc}",
                "--kill-on-bad-exit=1",
                python,
                "-m",
                "jagg_pipeline",
                "launch",
                f"--rendezvous={endpoint}",
                *stage_argv,
            ),
            env,
        )
    torchrun = (python, "-m", "torch.distributed.run")
    if world.nodes > 1:
        agent = (
            f"--nnodes={world.nodes}",
            f"--nproc-per-node={world.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous}",
            f"--rdzv-id={_job_id(environ)}",
        )
        return Launch((*torchrun, *agent, *stage), env)
    if world.nproc > 1:
        return Launch((*torchrun, "--standalone", f"--nproc-per-node={world.nproc}", *stage), env)
    return Launch((python, *stage), env)


def rendezvous_endpoint(
    environ: Mapping[str, str], run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> str:
    """``HOST:PORT`` of a multi-node job's rendezvous: its first node, a port from its id.

    The node list is SLURM_JOB_NODELIST, else squeue's for SLURM_JOB_ID (the executor
    plugin's job step passes the job id alone of SLURM's variables).
    """
    job = _job_id(environ)
    nodes = environ.get("SLURM_JOB_NODELIST") or _output(
        run, ["squeue", "--noheader", f"--jobs={job}", "--format=%N"]
    )
    hosts = _output(run, ["scontrol", "show", "hostnames", nodes]).split()
    if not hosts:
        raise LaunchError(f"SLURM job {job}: scontrol lists no node for {nodes!r}")
    return f"{hosts[0]}:{RENDEZVOUS_PORT + int(job) % 10000}"


class LaunchError(RuntimeError):
    """A multi-node job's SLURM surroundings are missing: no job id, no node list."""


def _job_id(environ: Mapping[str, str]) -> str:
    job = environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise LaunchError(
            "train.nodes > 1 runs inside a SLURM job (SLURM_JOB_ID is not set): use "
            "--profile workflow/profiles/slurm, or train.nodes: 1"
        )
    return job


def _output(run: Callable[..., subprocess.CompletedProcess], command: list[str]) -> str:
    try:
        done = run(command, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        raise LaunchError(f"{shlex.join(command)}: {err}") from None
    return done.stdout.strip()
