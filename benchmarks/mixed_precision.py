"""The on-policy step under bf16 mixed precision: the rollout's precision before and after.

Training computes under FSDP2's bf16 ``MixedPrecisionPolicy`` over float32 weights. Before,
the rollout sampled in float32 (its velocities and log-probs), so the first optimizer step
of a round was off-policy by the precision gap; now ``backbone.mixed_precision`` makes the
rollout compute in bf16 exactly as training does (``Backbone.compute_in_bf16``). For each
case this prints, on the same weights and trajectories seed:

- max |ratio - 1| of the first step (PPO clips at ``--clip``) and the clip fraction;
- the cosine between the first AdamW update with the rollout's interior velocities reused
  and with them recomputed, and the share of parameters that move the other way;
- the on-policy check: the deviation of the recomputed endpoint velocities from the stored
  ones (relative RMS) and whether it refused the stored interiors (then recomputed, which is
  why the update agrees even before; the ratio does not: the stored log-probs are float32's).

    python benchmarks/mixed_precision.py [--backbone toy-sd3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse

import torch

from jagg_pipeline.bench.config import BENCH_BACKBONES
from jagg_pipeline.bench.gradcheck import build_problem
from jagg_pipeline.bench.gradcheck_config import GradcheckConfig
from jagg_pipeline.bench.measure import load_bench_backbone
from jagg_pipeline.core import jagg
from jagg_pipeline.core.objective import GRPOStepLoss
from jagg_pipeline.stages import distributed


def adam_first_update(grad: torch.Tensor) -> torch.Tensor:
    """AdamW's bias-corrected first step direction: g / (|g| + eps)."""
    return grad / (grad.abs() + 1e-8)


def measure(args: argparse.Namespace, rollout_in_bf16: bool) -> dict[str, float]:
    """One case: sample with float32 or bf16 compute, train under FSDP2 bf16."""
    sampler = load_bench_backbone(args.backbone, args.device, seed=args.seed)
    if rollout_in_bf16:
        sampler.compute_in_bf16()
    settings = GradcheckConfig(
        trajectory="sde", dtype="float32", num_steps=args.steps, batch=args.batch, window=4
    )
    problem = build_problem(settings, sampler)
    trainer = load_bench_backbone(args.backbone, args.device, seed=args.seed)
    result: dict[str, float] = {}
    with distributed.distributed(args.device) as ctx:
        distributed.shard_backbone(trainer, ctx, mixed_precision=True)
        params = trainer.trainable_parameters()
        grads, stats = {}, {}
        for reuse in (False, True):
            objective = GRPOStepLoss(
                problem.latents,
                problem.sigmas,
                problem.old_log_probs,
                problem.advantages,
                problem.steps,
                problem.coeffs,
                args.clip,
            )

            def run(objective: GRPOStepLoss = objective, reuse: bool = reuse) -> None:
                batch = jagg.MicroBatch(
                    problem.latents,
                    problem.sigmas,
                    problem.cond,
                    objective,
                    problem.velocities if reuse else None,
                )
                stats[reuse] = jagg.trajectory_gradient(
                    trainer.velocity, batch, problem.steps, window=4, mode="jagg"
                )

            grads[reuse] = jagg.collect_gradient(params, run)
            if not reuse:
                result.update(objective.diagnostics())
    a, b = adam_first_update(grads[True]), adam_first_update(grads[False])
    result["update_cosine"] = float(a @ b / (a.norm() * b.norm()))
    result["opposite_share"] = float(((a * b) < 0).double().mean())
    result["reuse_error"] = max(w.reuse_error or 0.0 for w in stats[True].windows)
    result["rejected"] = any(w.reuse_rejected for w in stats[True].windows)
    return result


def main() -> None:
    """Print the before/after table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="toy-sd3", choices=BENCH_BACKBONES)
    parser.add_argument("--steps", type=int, default=13, help="denoising steps (12 trained)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--clip", type=float, default=1e-4, help="PPO clip range")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"{args.backbone} on {args.device}, float32 weights, training under FSDP2 bf16 mixed "
        "precision"
    )
    print(
        f"{'rollout computes in':<20} {'max|ratio-1|':>12} {'clipfrac':>9} "
        f"{'update cos':>10} {'opposite':>9} {'check dev':>10} {'stored interiors':>17}"
    )
    for name, in_bf16 in (("float32 (before)", False), ("bf16 (now)", True)):
        r = measure(args, in_bf16)
        print(
            f"{name:<20} {r['max_ratio_dev']:>12.3g} {r['clipfrac']:>9.3f} "
            f"{r['update_cosine']:>10.4f} {r['opposite_share']:>9.3%} {r['reuse_error']:>10.3g} "
            f"{'refused' if r['rejected'] else 'reused':>17}"
        )


if __name__ == "__main__":
    main()
