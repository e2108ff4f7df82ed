"""``encode``: a prompt pool's conditioning, encoded once by the text encoders alone."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from jagg_pipeline.cli.common import (
    add_config_arguments,
    add_prompt_arguments,
    load_stage_config,
    stage_errors,
)

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "encode a prompt pool once with the text encoders alone (for rollout/evaluate)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``encode`` subcommand."""
    p = sub.add_parser(
        "encode",
        help=HELP,
        description=textwrap.dedent(
            """\
            Load only the text encoders and tokenizers of backbone.path (no transformer, no
            VAE), encode every distinct prompt of --prompts (default: sampler.prompts) in
            batches, and the negative prompt when backbone.cfg_scale > 1. rollout and
            evaluate given the folder (--conditioning DIR) read their prompts' rows from it
            and load no text encoder. The folder fits every config with the same
            backbone.family, path, revision, dtype, max_sequence_length, negative_prompt and
            cfg_scale (checked by its readers). Without --config the package's defaults are
            the config (the workflow's encode rule sets exactly those keys with --set)."""
        ),
        epilog=textwrap.dedent(
            """\
            output directory:
              conditioning.safetensors  per conditioning key [N, ...] (the N distinct prompts,
                                        token axes padded to the pool's longest);
                                        negative_<key> [1, ...] when cfg_scale > 1
              prompts.json              the N distinct prompts, in pool order
              metrics.jsonl             one flat line: prompts, bytes, seconds, time
              config.yaml               the resolved config
              manifest.json             stage, version, digests, the text keys (written last)"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(p, required=False)
    add_prompt_arguments(p, "sampler.prompt_column when --prompts is left out")
    p.add_argument(
        "--batch-size",
        type=_positive,
        default=None,
        metavar="N",
        help="prompts per text-encoder call (default: 32)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.stages.encode import BATCH_SIZE, run_encode

    if args.config is None:
        from jagg_pipeline.config.run import RunConfig
        from jagg_pipeline.config.yaml_io import load_data

        with stage_errors():
            config = load_data(RunConfig, {}, "the package defaults", args.overrides)
    else:
        config = load_stage_config(args.config, args.overrides)
    prompts, column = args.prompts, args.column
    if prompts is None:
        prompts, column = config.sampler.prompts, column or config.sampler.prompt_column
    with stage_errors():
        run_encode(
            config, prompts, args.out, column=column, batch_size=args.batch_size or BATCH_SIZE
        )
    print(f"conditioning written to {args.out}")
    return 0
