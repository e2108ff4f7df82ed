"""``rollout``: sample G images per prompt with the configured SDE into a rollout directory."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

from jagg_pipeline.cli.common import (
    add_conditioning_argument,
    add_config_arguments,
    add_policy_argument,
    add_prompt_arguments,
    load_stage_config,
    stage_errors,
)

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "sample G images per prompt with the configured SDE into a rollout directory"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``rollout`` subcommand."""
    p = sub.add_parser(
        "rollout",
        help=HELP,
        description=textwrap.dedent(
            """\
            Sample sampler.group_size images for each of sampler.prompts_per_round prompts
            drawn from --prompts (default: sampler.prompts) with the round's seed, with the
            configured SDE (a window of noisy steps, or the full trajectory with its
            trained-step selection). Each sample
            has its own seed, derived from (train.seed, --round, sample index). Work is split
            into micro-batches of whole prompt groups (sampler.batch_size samples); under
            `torchrun --nproc_per_node N` micro-batches are dealt to ranks round-robin and
            each rank writes its shard, and the shards load back as the one-process rollout."""
        ),
        epilog=textwrap.dedent(
            """\
            output directory:
              shard-<rank>.safetensors  latents [B, T+1, ...], log_probs [B, T], sigmas [T+1],
                                        sde_mask / train_mask [T], prompt_ids, group_ids,
                                        seeds, sample_ids [B], cond.* (prompt conditioning),
                                        images uint8 [B, 3, H, W]
              shard-<rank>.json         the round's prompts
              metrics.jsonl             one flat line: stage, round, samples, seconds,
                                        time (import, load, work)
              config.yaml               the resolved config
              manifest.json             stage, version, config digests, seeds, input digests,
                                        micro-batches, trained steps (written last)"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    add_policy_argument(p)
    add_prompt_arguments(p, "sampler.prompt_column")
    add_conditioning_argument(p, "the prompt pool")
    p.add_argument(
        "--round",
        type=int,
        default=0,
        metavar="R",
        help="training round: selects the prompts, seeds and window (default: 0)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.stages.rollout import run_rollout

    config = load_stage_config(args.config, args.overrides)
    with stage_errors():
        run_rollout(
            config,
            args.policy,
            args.prompts or config.sampler.prompts,
            args.out,
            round_index=args.round,
            column=args.column or config.sampler.prompt_column,
            conditioning=args.conditioning,
        )
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, say it once
        print(f"rollout written to {args.out}")
    return 0
