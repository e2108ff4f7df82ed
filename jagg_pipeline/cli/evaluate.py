"""``evaluate``: fixed prompts and seeds, ODE sampling, every configured metric, an image grid."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from jagg_pipeline.cli.common import (
    add_conditioning_argument,
    add_config_arguments,
    add_policy_argument,
    load_stage_config,
    stage_errors,
)

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "evaluate a policy: fixed seeds, ODE sampling, metrics.json and an image grid"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``evaluate`` subcommand."""
    p = sub.add_parser(
        "evaluate",
        help=HELP,
        description=textwrap.dedent(
            """\
            Sample eval.samples_per_prompt images for each of the first eval.max_prompts
            prompts of eval.prompts with fixed seeds (from eval.seed) and eval.num_steps ODE
            steps, and score them with every reward named in eval.metrics (settings from the
            rewards section). The same checkpoint and config give the same metrics."""
        ),
        epilog=textwrap.dedent(
            """\
            output directory:
              metrics.json    per metric {mean, std}; per_prompt means; what was evaluated
              samples.jsonl   one row per image: image, prompt_id, prompt, sample, seed, scores
              images/         PPPP_SS.png (prompt, sample)
              grid.png        one row per prompt, its text and mean scores beside it
              metrics.jsonl   one flat line (stage, round = rounds trained, metric means/stds,
                              time: import, load, work)
              config.yaml     the resolved config
              manifest.json   stage, version, config digests, seeds, input digests"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p)
    add_policy_argument(p)
    add_conditioning_argument(p, "eval.prompts (eval.column)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.stages.evaluate import run_evaluate

    config = load_stage_config(args.config, args.overrides)
    with stage_errors():
        report = run_evaluate(config, args.policy, args.out, conditioning=args.conditioning)
    if report is not None:  # rank 0 (under torchrun the others return None)
        print(json.dumps(report["metrics"]))
        print(f"evaluation written to {args.out}")
    return 0
