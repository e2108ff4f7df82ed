"""The torchrun worker of tests/test_distributed.py's FSDP2 gradient check.

``torchrun ... fsdp_update_worker.py CHECKPOINT OUT.json`` counts FSDP2 reduce-scatters per
backward unit and checks that the ranks' gradients are summed, not averaged; rank 0 writes
the report to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch


def main(checkpoint: Path, out: Path) -> None:
    from jagg_pipeline.backbones import BackboneConfig, load_backbone
    from jagg_pipeline.core import jagg
    from jagg_pipeline.core.objective import GRPOStepLoss, recompute_log_probs
    from jagg_pipeline.core.options import EngineOptions
    from jagg_pipeline.core.sde import StepCoefficients
    from jagg_pipeline.stages import distributed

    torch.set_num_threads(1)
    counter = distributed.count_reduce_scatters()
    spec = BackboneConfig(
        family="sd3",
        path=str(checkpoint),
        height=32,
        width=32,
        dtype="float64",
        training="full",
        max_sequence_length=16,
    )
    with distributed.distributed("cpu") as ctx:
        reference = load_backbone(spec)  # unsharded, sees all the data
        sharded = load_backbone(dataclasses.replace(spec, load_text_encoders=False))
        # FSDP2 renames the classes it shards, so count the units (+ the root) first.
        groups = len(sharded.fsdp_units()) + 1
        distributed.shard_backbone(sharded, ctx)

        # 4 samples, 5 steps; rank r holds samples 2r, 2r + 1.
        gen = torch.Generator().manual_seed(0)
        batch, steps = 4, [0, 1, 2, 3]
        sigmas = reference.sigmas(5).double()
        latents = torch.randn(batch, 6, *reference.latent_shape, generator=gen, dtype=torch.float64)
        cond = reference.encode_prompts(["a red circle on the left, white background"] * batch)
        coeffs = StepCoefficients("flow_grpo", 0.7)
        old = torch.zeros(batch, 5, dtype=torch.float64)
        old[:, steps] = recompute_log_probs(
            reference.velocity, latents, sigmas, cond, steps, coeffs
        )
        advantages = torch.randn(batch, generator=gen, dtype=torch.float64)

        def part(index: list[int]) -> jagg.MicroBatch:
            sub_cond = {k: v[index] for k, v in cond.items()}
            objective = GRPOStepLoss(
                latents[index],
                sigmas,
                old[index],
                advantages[index],
                steps,
                coeffs,
                1e-4,
                normalizer=float(batch * len(steps)),
                cond=sub_cond,
            )
            return jagg.MicroBatch(latents[index], sigmas, sub_cond, objective)

        report: dict[str, Any] = {"groups": groups, "world_size": ctx.world_size}
        params = sharded.trainable_parameters()
        mine = part([2 * ctx.rank, 2 * ctx.rank + 1])
        distributed.set_gradient_sync(sharded.transformer, True)
        # (name, mode, endpoint backward): the joint one stacks both endpoints in one call.
        for name, mode, backward in (
            ("jagg", "jagg", "joint"),
            ("sequential_jagg", "jagg", "sequential"),
            ("exact", "exact", "joint"),
        ):
            before = counter["calls"]
            jagg.window_gradient(
                sharded.velocity, mine, steps, mode, EngineOptions(endpoint_backward=backward)
            )
            report[f"{name}_window_reduce_scatters"] = counter["calls"] - before
            for p in params:
                p.grad = None

        # One optimizer step's accumulation: 2 micro-batches x 2 windows (jagg + exact).
        before = counter["calls"]
        parts = [part([2 * ctx.rank]), part([2 * ctx.rank + 1])]
        jagg.accumulate_gradient(
            sharded.velocity,
            parts,
            [[0, 1], [2, 3]],
            [True, False],
            "jagg",
            set_sync=lambda on: distributed.set_gradient_sync(sharded.transformer, on),
        )
        report["step_reduce_scatters"] = counter["calls"] - before

        # The summed sharded gradient against one process's gradient over all 4 samples.
        got = [distributed.full_tensor(p.grad) for p in params]
        everything = part(list(range(batch)))
        jagg.trajectory_gradient(
            reference.velocity, everything, steps, window=2, mode="jagg", routing=[True, False]
        )
        expected = [p.grad for p in reference.trainable_parameters()]
        report["max_grad_difference"] = max(
            float((g - e).abs().max()) for g, e in zip(got, expected, strict=True)
        )
        report["max_grad"] = max(float(e.abs().max()) for e in expected)
        if ctx.is_main:
            out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
