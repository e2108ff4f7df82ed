"""A rank's process dies with the torchrun agent that started it.

torchrun starts each worker in a session of its own, so neither a SIGKILL of the job's
process group (Snakemake cancelling a job, SLURM ending one) nor the death of the agent
reaches the workers: they would train on, hold their GPUs while the rerun starts, and write
the output of a job that already failed. ``python -m jagg_pipeline launch`` records its own
pid (which its ``exec`` hands to the agent) in :data:`LAUNCHER_PID`; every command calls
:func:`die_with_launcher` first, and a worker of that agent asks the kernel for a SIGKILL
when its parent goes (Linux ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal

# The pid of the process that exec'd into the torchrun agent (set by the launch command).
LAUNCHER_PID = "JAGG_LAUNCHER_PID"
# Threads of each rank's torch intra- and inter-op pools (set by the launch command).
RANK_THREADS_ENV = "JAGG_RANK_THREADS"
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """Under a launch's torchrun agent: be killed when the agent dies, or exit if it has.

    A no-op elsewhere (no :data:`LAUNCHER_PID`, not a torchrun worker, or the launched
    process itself). The variable is removed from this process's environment, so that a
    process it starts does not tie itself to the wrong parent.
    """
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if launcher is None or "LOCAL_RANK" not in os.environ or int(launcher) == os.getpid():
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The agent may have died before the request: then this process has a new parent.
    if os.getppid() != int(launcher):
        raise SystemExit(f"error: the torchrun agent (pid {launcher}) is gone; not starting")
