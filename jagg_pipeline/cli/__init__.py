"""``python -m jagg_pipeline <command>``: the only layer that knows about paths and arguments.

One module per command; each exposes ``register(subparsers)`` and sets ``handler``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jagg_pipeline import __version__
from jagg_pipeline.cli import (
    config,
    evaluate,
    experiment,
    gradcheck,
    rollout,
    score,
    toyworld,
    train,
)

COMMANDS = (config, gradcheck, toyworld, rollout, score, train, evaluate, experiment)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per command module."""
    parser = argparse.ArgumentParser(
        prog="python -m jagg_pipeline",
        description="GRPO for text-to-image diffusion transformers with JAGG.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)
