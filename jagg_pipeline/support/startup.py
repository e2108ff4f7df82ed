"""A command process's start-up and exit, and where a stage job's seconds go.

``python -m jagg_pipeline`` runs one command per process (a Snakemake job); ``__main__`` calls
:func:`start_command` first and :func:`end_command` once the command succeeded. A job imports
torch, diffusers and transformers, millions of long-lived objects, which the collector's
default thresholds rescan over and over while they arrive (about a quarter of the imports'
time) and once more at exit (1-2 s): a command collects less often (cycles are still
collected) and leaves its heap to the exit uncollected. A stage command does not collect at all
while it imports: the collector is off from the process start until the stage function starts
(:meth:`StageClock.start`), and again inside :func:`importing` (the libraries a stage imports
while it loads). Each window ends by freezing what the imports made (no later collection
rescans it) before the collector is on again, so that reading weights and data, whose cycles
can hold tensors, is collected as before.

Every stage (rollout, score, train, evaluate) records ``time.import``, ``time.load`` and
``time.work`` in its metrics line (train: in its first optimizer step's line), which
:mod:`jagg_pipeline.reports.summary` sets side by side per stage:

- import: from the start of the command's process to the stage function starting:
  interpreter start-up, the imports made before the stage function runs, argument parsing,
  reading the config. The start is the kernel's process start time (``/proc/self/stat``, in
  10 ms ticks of the boot clock); where there is no ``/proc``, the moment ``__main__`` started
  (which misses the interpreter's start-up and the package import, some 0.1 s). Under
  ``torchrun`` it is the rank's own process; the launcher's start-up is not counted. Only the
  first stage of a command process records it: a stage run inside another program (tests,
  notebooks, :mod:`jagg_pipeline.stages.loop`) has no start-up of its own.
- load: inside the stage function, reading inputs and loading models and rewards, the
  libraries they import lazily (diffusers, transformers) included.
- work: sampling, scoring, the optimizer steps (and the probes of the routing).

Writing outputs and manifests is none of the three, nor is the process's exit, so import +
load + work is less than the job's wall time. Torch-free: ``__main__`` imports it first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Iterator, Sequence

# The parts of a stage job; its metrics line holds them as ``time.<part>``.
PARTS: tuple[str, ...] = ("import", "load", "work")
# Collector thresholds of a command: a young collection every 100k allocations instead of
# 700, the full one after 100 older ones instead of 10 (measured on the toy world: an SD3
# job's imports 7.2 -> 5.9 s; turning the collector off entirely gave 5.1 s).
COMMAND_GC_THRESHOLDS = (100_000, 50, 100)
# The commands that run a stage function, whose imports run with the collector off.
STAGE_COMMANDS: tuple[str, ...] = ("rollout", "score", "train", "block", "evaluate")

_main_started: float | None = None  # perf_counter() when __main__ began; None: not a command
_import_claimed = False
_importing = False  # a stage command's first imports are running (the collector is off)
_import_block_used = False  # importing() has acted in this process


def command_word(argv: Sequence[str]) -> str | None:
    """The command of a ``python -m jagg_pipeline`` argument list: its first non-option word.

    The top level has no options that take a value, so this is the word the parser dispatches on.
    """
    return next((word for word in argv if not word.startswith("-")), None)


def start_command(argv: Sequence[str] | None = None) -> None:
    """Set up this process for one ``python -m jagg_pipeline`` command (``__main__`` does).

    ``argv``: the command line after the program (default ``sys.argv[1:]``); a stage command
    starts with the collector off until its stage function starts.
    """
    global _main_started, _importing
    _main_started = time.perf_counter()
    gc.set_threshold(*COMMAND_GC_THRESHOLDS)
    if command_word(sys.argv[1:] if argv is None else argv) in STAGE_COMMANDS:
        _importing = True
        gc.disable()


def _imports_done() -> None:
    """End the collector-off window of a stage command's first imports (no-op elsewhere)."""
    global _importing
    if _importing:
        _importing = False
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """A block of a command process that only imports: no collection inside, frozen after.

    For the libraries a stage imports while it loads (diffusers' pipeline modules pull in
    transformers, peft and scipy): without it, the collector would rescan their objects as
    they arrive. The young generations are collected first, so that no garbage made since the
    last freeze (data read so far) is frozen with them. Nothing but imports belongs inside:
    cycles made in the block are never freed. Only the first block of a command process acts
    (later ones find their libraries imported); outside a command process (tests, notebooks,
    the in-process loop) and inside the start-up window it changes nothing.
    """
    global _import_block_used
    if _main_started is None or _importing or _import_block_used:
        yield
        return
    _import_block_used = True
    gc.collect(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def end_command() -> None:
    """The command succeeded and its outputs are written: exit without collecting the heap.

    Frozen objects are still freed as their references go; only cycles among them are left
    to the operating system.
    """
    gc.freeze()


def process_seconds() -> float | None:
    """Seconds since this process started, from the kernel (Linux); None elsewhere."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            stat = handle.read()
        # Field 22, starttime, counted after the command name, which may hold spaces.
        ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError, IndexError):
        return None


def _claim_import_seconds() -> float | None:
    """The import seconds of the first stage of a command process; None for any other."""
    global _import_claimed
    if _main_started is None or _import_claimed:
        return None
    _import_claimed = True
    age = process_seconds()
    return time.perf_counter() - _main_started if age is None else age


class StageClock:
    """The import, load and work seconds of one stage function.

    :meth:`start` it first thing in the stage function; each :meth:`lap` then adds the seconds
    since the previous lap (or the start) to a part. Time after the last lap (writing outputs)
    is in no part.
    """

    def __init__(self, import_seconds: float | None = None) -> None:
        self.import_seconds = import_seconds
        self.seconds = {"load": 0.0, "work": 0.0}
        self._last = time.perf_counter()

    @classmethod
    def start(cls) -> StageClock:
        """The clock of a stage function starting now, with its import seconds if measured.

        The stage's loading starts here: the command's collector-off window ends.
        """
        _imports_done()
        return cls(_claim_import_seconds())

    def lap(self, part: str) -> None:
        """Add the seconds since the previous lap to ``part`` ("load" or "work")."""
        now = time.perf_counter()
        self.seconds[part] += now - self._last
        self._last = now

    def record(self) -> dict[str, float]:
        """``{import, load, work}`` seconds (import only where measured): the ``time`` metrics."""
        imported = {} if self.import_seconds is None else {"import": self.import_seconds}
        return imported | self.seconds
