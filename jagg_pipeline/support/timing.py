"""Where the update stage's time goes: seconds inside the network's forward calls.

Training and the benchmark wrap the velocity callable with :class:`ForwardClock`; the
engine's remaining time is the backward (and the small autograd work around it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch


class ForwardClock:
    """Seconds spent inside the wrapped velocity calls (forward passes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def sync(self) -> None:
        """Wait for the device (CUDA kernels are asynchronous)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn`` timed into :attr:`seconds`."""

        @functools.wraps(fn)
        def timed(*args: Any) -> torch.Tensor:
            start = time.perf_counter()
            out = fn(*args)
            self.sync()
            self.seconds += time.perf_counter() - start
            return out

        return timed
