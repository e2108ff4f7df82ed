"""``score``: the pipeline's score stage: a rollout's images under the config's rewards."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from jagg_pipeline.cli.common import add_config_arguments

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "score a rollout with the config's rewards; group advantages for training"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``score`` subcommand."""
    p = sub.add_parser(
        "score",
        help=HELP,
        description=textwrap.dedent(
            """\
            Score a rollout directory's images against their prompts with the rewards of the
            config (rewards.weights, each reward's settings) and compute the GRPO advantages
            of the advantage section (std_mode, eps, clip) and rewards.normalize_separately.
            Rollouts sampled under another backbone or sampler section are refused, naming
            the file. To score a folder of images, see `score-images`."""
        ),
        epilog=textwrap.dedent(
            """\
            output directory:
              scores.parquet  one row per sample in rollout order: sample, prompt_id, group,
                              <reward>..., total, advantage, group_mean, group_std
              summary.json    reward means, zero-std groups
              metrics.jsonl   one flat line: stage, round, total mean/std, reward means,
                              time (import, load, work)
              config.yaml     the resolved config
              manifest.json   stage score, config digests, input rollouts (written last)"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    p.add_argument(
        "--rollouts",
        type=Path,
        required=True,
        metavar="DIR",
        help="a rollout directory (from `rollout`)",
    )
    p.add_argument(
        "--device",
        help="torch device of the reward models (default: the config's rewards.device, else "
        "backbone.device)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        metavar="N",
        help="images scored at once (each reward may chunk further; default: 32)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.cli.common import load_stage_config, stage_errors
    from jagg_pipeline.stages.scoring import run_score

    if args.batch_size < 1:
        raise SystemExit(f"error: --batch-size must be >= 1, got {args.batch_size}")
    config = load_stage_config(args.config, args.overrides)
    with stage_errors():
        scores = run_score(
            config, args.rollouts, args.out, device=args.device, chunk=args.batch_size
        )
    summary = scores.summary
    print(
        f"scored {summary['samples']} samples ({summary['groups']} groups, "
        f"{summary['zero_std_groups']} with zero std); written to {args.out}"
    )
    return 0
