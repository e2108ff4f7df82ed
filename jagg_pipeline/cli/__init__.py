"""``python -m jagg_pipeline <command>``: the only layer that knows about paths and arguments.

One module per command; each exposes ``HELP`` (its one-line summary), ``register(subparsers)``
and sets ``handler``. Only the command being run is registered in full: a command's
arguments may need heavy imports for their defaults and choices (torch, diffusers), and every
Snakemake job pays start-up once per stage per round.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jagg_pipeline import __version__
from jagg_pipeline.cli import (
    bench,
    block,
    compare,
    config,
    encode,
    evaluate,
    export,
    gradcheck,
    launch,
    rewards,
    rollout,
    score,
    score_images,
    summarize,
    toyworld,
    track,
    train,
    verify,
)

COMMANDS = (
    config,
    gradcheck,
    bench,
    toyworld,
    rewards,
    encode,
    rollout,
    score,
    train,
    block,
    evaluate,
    launch,
    export,
    verify,
    summarize,
    track,
    compare,
    score_images,
)


def _name(command: object) -> str:
    """The command's name: its ``NAME`` if it has one (``score-images``), else its module's."""
    return getattr(command, "NAME", command.__name__.rsplit(".", 1)[-1])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; ``command`` (None: every one) is registered with its arguments.

    The others are listed with their summary only, so that ``--help`` imports nothing heavy;
    ``""`` (no command or an unknown one) registers none in full.
    """
    parser = argparse.ArgumentParser(
        prog="python -m jagg_pipeline",
        description="GRPO for text-to-image diffusion transformers with JAGG.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        if command is None or _name(module) == command:
            module.register(sub)
        else:
            sub.add_parser(_name(module), help=module.HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit status."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    names = {_name(module) for module in COMMANDS}
    from jagg_pipeline.support.startup import command_word

    chosen = command_word(argv)
    parser = build_parser(chosen if chosen in names else "")
    args = parser.parse_args(argv)
    return args.handler(args)
