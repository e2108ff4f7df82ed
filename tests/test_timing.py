"""support/timing.py on the CPU: forward seconds by the host clock, marks between points."""

import time

import torch

from jagg_pipeline.support.timing import ForwardClock


def test_forward_clock_counts_only_the_wrapped_calls_and_the_marks_between_points():
    clock = ForwardClock(torch.device("cpu"))

    def slow(x):
        time.sleep(0.02)
        return x

    forward = clock.wrap(slow)
    clock.mark("start")
    forward(torch.ones(1))
    time.sleep(0.05)  # outside the forward: not forward time
    clock.mark("engine")
    forward(torch.ones(1))
    clock.mark("optimizer")
    seconds = clock.sync()
    assert set(seconds) == {"engine", "optimizer"}
    assert 0.04 <= clock.seconds < seconds["engine"] + seconds["optimizer"]
    assert seconds["engine"] >= 0.07
    assert clock.syncs == 0  # nothing to wait for on the CPU
    assert clock.sync() == {}  # marks are cleared by a sync
