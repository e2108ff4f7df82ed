"""``train``: one JAGG-accelerated GRPO round on a scored rollout, under FSDP2."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from jagg_pipeline.cli.common import (
    add_config_arguments,
    add_policy_argument,
    load_stage_config,
    renamed_option,
    stage_errors,
)

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "train one GRPO round (exact / jagg / no_interp gradients) into a checkpoint"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand."""
    p = sub.add_parser(
        "train",
        help=HELP,
        description=textwrap.dedent(
            """\
            Train one round on a scored rollout: the rollout's micro-batches are shuffled and
            dealt into train.minibatches optimizer steps; each step's trained denoising steps
            are split into windows of jagg.window steps whose gradients come from jagg.mode
            (exact, jagg or no_interp), routed by jagg.jagg_frac (a fraction of the windows
            from high noise, or 'auto': windows whose probed cos-sim with the exact gradient
            reaches jagg.auto_threshold). AdamW with train.lr, train.lr_schedule and
            train.grad_clip; grpo.kl_beta > 0 adds the KL to the base policy. A step with a
            non-finite loss or gradient is skipped and counted.

            Run it as one process, or under `torchrun --nproc_per_node N` (FSDP2: gloo on
            CPU, NCCL on GPU); the update does not depend on N. The checkpoint is written
            atomically: a killed run leaves nothing under --out, and rerunning the command
            recomputes the round."""
        ),
        epilog=textwrap.dedent(
            """\
            output directory (the next round's --policy; `export` writes its policy in a
            hub format):
              policy/                       the trainable weights (LoRA adapters or the
                                            transformer), sharded: .metadata and one file
                                            per writing rank (torch.distributed.checkpoint)
              trainer/state.json            round, optimizer steps, skipped steps, scheduler,
                                            routing and probed per-window cos-sims
              trainer/optimizer/            AdamW state, sharded like the weights
              trainer/ema/                  EMA of the trainable weights, sharded
                                            (train.ema_decay set)
              trainer/rng.safetensors       the trainer's generator (minibatch shuffles)
              metrics.jsonl                 one line per optimizer step: loss, clipfrac,
                                            approx_kl, grad_norm, lr, reward stats, backward
                                            calls, windows, time (forward, backward,
                                            optimizer; the job's import, load, work on
                                            the first step), probe (when probed)
              config.yaml, manifest.json    resolved config; manifest written last"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    add_policy_argument(p, "'base' (round 0) or the previous round's checkpoint directory")
    p.add_argument(
        "--rollouts",
        type=Path,
        required=True,
        metavar="DIR",
        help="rollout directory sampled from --policy for this round (from `rollout`)",
    )
    p.add_argument(
        "--scores",
        type=Path,
        required=True,
        metavar="DIR",
        help="score folder of --rollouts (from `score --rollouts`)",
    )
    p.add_argument("--rewards", action=renamed_option("--scores"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="checkpoint directory")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.stages.checkpoint import NonFiniteError
    from jagg_pipeline.stages.train import train_round

    config = load_stage_config(args.config, args.overrides)
    with stage_errors():
        try:
            result = train_round(config, args.policy, args.rollouts, args.scores, args.out)
        except NonFiniteError as err:
            raise SystemExit(f"error: {err}") from None
    print(f"round {result.round} checkpoint written to {args.out}")
    return 0
