"""The benchmark's torchrun worker: FSDP2 reduce-scatters per optimizer step in each mode.

``torchrun --nproc_per_node N -m jagg_pipeline.bench.worker BACKBONE DIR W BATCH STEPS OUT``:
every rank loads the benchmark backbone saved in DIR and shards it, then accumulates one
optimizer step of each headline case (exact, jagg and jagg + reuse under both endpoint
backwards, no_interp at W, jagg_frac 1) with FSDP2's gradient sync on the last backward call
only, as training does, counting reduce-scatters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from jagg_pipeline.bench.config import BenchConfig
from jagg_pipeline.bench.measure import Bench, cases_for, load_saved_backbone
from jagg_pipeline.stages import distributed


def main(argv: list[str]) -> None:
    """Run the count; rank 0 writes ``{world_size, groups, per_step}`` to OUT.json."""
    name, directory, window, batch, steps, out = argv
    settings = BenchConfig(
        backbones=[name],
        sweep_backbone="",
        window=int(window),
        batch=int(batch),
        num_steps=int(steps),
    )
    torch.set_num_threads(1)
    counter = distributed.count_reduce_scatters()
    with distributed.distributed("cpu") as ctx:
        backbone = load_saved_backbone(name, directory, "cpu")
        groups = len(backbone.fsdp_units()) + 1  # the units and the root
        distributed.shard_backbone(backbone, ctx)
        bench = Bench(backbone, settings)
        bench.set_sync = lambda on: distributed.set_gradient_sync(backbone.transformer, on)
        per_step = {}
        for case in cases_for(name, settings):
            before = counter["calls"]
            bench.run(case)
            per_step[case.name] = counter["calls"] - before
        if ctx.is_main:
            report = {"world_size": ctx.world_size, "groups": groups, "per_step": per_step}
            Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
