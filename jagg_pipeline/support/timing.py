"""Where the update stage's time goes: seconds inside the network's forward calls, and marks.

Training and the benchmark wrap the velocity callable with :class:`ForwardClock`; the
engine's remaining time is the backward (and the small autograd work around it).

On CUDA, kernels run asynchronously: a host timer around a forward call would either measure
only the launch, or (with a synchronise after every call) stall the stream and FSDP2's
prefetch of the next unit's all-gather, and count still-queued backward kernels as forward
time. So on CUDA each call records a pair of CUDA events on the current stream, and
:meth:`ForwardClock.sync` (once per optimizer step) waits for the device and reads them all.
On the CPU every call is timed by the host clock as it returns.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch


class ForwardClock:
    """Seconds spent inside the wrapped velocity calls (forward passes), and step marks.

    :attr:`seconds` is complete after :meth:`sync`. :meth:`mark` records a named point of
    the step's timeline; :meth:`sync` returns the seconds between consecutive marks.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0
        self.syncs = 0  # device synchronisations, for tests and the benchmark
        self._pending: list[tuple[Any, Any]] = []
        self._marks: list[tuple[str, Any]] = []

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start: Any, end: Any) -> float:
        if self._cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start

    def mark(self, name: str) -> None:
        """Record the point ``name`` of the step (no synchronisation)."""
        self._marks.append((name, self._now()))

    def sync(self) -> dict[str, float]:
        """Wait for the device once; fold the forward calls into :attr:`seconds`.

        Returns the seconds between consecutive marks, keyed by the later mark's name.
        """
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self.syncs += 1
        for start, end in self._pending:
            self.seconds += self._elapsed(start, end)
        self._pending.clear()
        intervals = {
            name: self._elapsed(previous, point)
            for (_, previous), (name, point) in zip(self._marks, self._marks[1:], strict=False)
        }
        self._marks.clear()
        return intervals

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn`` timed into :attr:`seconds`."""

        @functools.wraps(fn)
        def timed(*args: Any) -> torch.Tensor:
            start = self._now()
            out = fn(*args)
            end = self._now()
            if self._cuda:
                self._pending.append((start, end))
            else:
                self.seconds += end - start
            return out

        return timed
