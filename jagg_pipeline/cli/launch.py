"""``launch``: start a stage over the run config's training ranks (the workflow's rules)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from jagg_pipeline.cli.common import add_config_arguments, load_stage_config

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "run a stage (train, rollout, block, evaluate) on train.nodes x train.nproc processes"
STAGES = ("train", "rollout", "block", "evaluate")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``launch`` subcommand."""
    p = sub.add_parser(
        "launch",
        help=HELP,
        description=textwrap.dedent(
            """\
            Run STAGE with its arguments on the processes its run config asks for
            (train.nodes x train.nproc, read from the stage's --config and --set): the
            plain interpreter for one; torchrun --standalone on one node; srun starting
            one torchrun agent per node inside a SLURM job, joined by a c10d rendezvous on
            the job's first node. Every process runs on one thread (OpenMP, MKL, OpenBLAS,
            numexpr, torch's pools all pinned), so that the bytes a job writes do not
            depend on the cores it was given, and dies with its torchrun agent. The
            launch replaces itself by that command."""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("stage", choices=STAGES, metavar="STAGE", help=", ".join(STAGES))
    p.add_argument(
        "stage_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="the stage's own arguments (its --config and --set give the world size)",
    )
    p.add_argument(
        "--rendezvous",
        metavar="HOST:PORT",
        help="set by a multi-node launch for the launches srun starts on each node",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command (with the variables it sets) instead of running it",
    )
    p.set_defaults(handler=run)


def _stage_config_arguments(stage_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jagg_pipeline launch STAGE", add_help=False)
    add_config_arguments(parser)
    known, _ = parser.parse_known_args(stage_args)
    return known


def run(args: argparse.Namespace) -> int:
    """Become the stage's launch (or print it with ``--dry-run``)."""
    from jagg_pipeline.workflow.launch import LaunchError, World, launch

    stage_argv = [args.stage, *args.stage_args]
    known = _stage_config_arguments(args.stage_args)
    train = load_stage_config(known.config, known.overrides).train
    try:
        becomes = launch(
            World(nodes=train.nodes, nproc=train.nproc),
            sys.executable,
            stage_argv,
            os.environ,
            launcher_pid=os.getpid(),
            rendezvous=args.rendezvous,
        )
    except LaunchError as err:
        raise SystemExit(f"error: {err}") from None
    if args.dry_run:
        print(becomes.describe())
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(becomes.argv[0], list(becomes.argv), {**os.environ, **becomes.env})
