"""The speed benchmark's settings and choices, torch-free so that ``bench --help`` is fast.

:mod:`jagg_pipeline.bench.measure` runs the benchmark and refuses a backbone these choices do
not name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# toy-*: the toy world's transformers (width 64, random weights: speed does not depend on
# them); wide-flux: the toy Flux at width 256 (4 heads x 64), where the network dominates.
BENCH_BACKBONES: tuple[str, ...] = ("wide-flux", "toy-flux", "toy-sd3", "toy-qwenimage")


@dataclass
class BenchConfig:
    """What the benchmark measures (defaults: the CPU table of docs/performance.md)."""

    backbones: list[str] = field(default_factory=lambda: list(BENCH_BACKBONES))
    # The W x jagg_frac sweep runs on this backbone; the others get the headline cell only.
    sweep_backbone: str = "wide-flux"
    windows: list[int] = field(default_factory=lambda: [2, 3, 4, 6, 8])
    fracs: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.6, 1.0])
    # The headline cell: W = window at jagg_frac = 1, on every backbone.
    window: int = 4
    batch: int = 8
    # Denoising steps of the trajectories; every step but the last is trained: 12 at 13, three
    # windows of W = 4, so jagg_frac 0.6 routes 2 of 3 (with 2 windows it could only route 1).
    num_steps: int = 13
    # The headline cases again on the sweep backbone over 16 trained steps (0: skip): where
    # shared anchors save more (6 rows against 8 separate and 16 exact at W = 4).
    long_steps: int = 17
    repeats: int = 5
    warmup: int = 1
    threads: int = 1
    device: str = "cpu"
    seed: int = 0
    # Also time a whole round (rollout + score + update) per backbone at the headline cell.
    whole_round: bool = True
    # Count FSDP2 reduce-scatters per optimizer step on 2 ranks (gloo), headline cell.
    ranks: int = 2
