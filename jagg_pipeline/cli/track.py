"""``track``: push finished runs of one workflow experiment to the tracker (MLflow or none)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jagg_pipeline.cli.common import add_run_argument, parse_runs, renamed_option, stage_errors

HELP = "push finished runs (stage folders) to MLflow: params, metrics per round, grids"
# Beside --out: every run pushed so far, by store and experiment (jagg_pipeline.reports.tracking).
LEDGER_NAME = "pushed.json"


def add_experiment_runs_arguments(p: argparse.ArgumentParser) -> None:
    """``--run VARIANT SEED DIR`` (repeated) and ``--experiment``: the runs of one experiment."""
    add_run_argument(
        p, "a run folder (with its resolved config.yaml) and its variant and seed; repeat"
    )
    p.add_argument(
        "--experiment", required=True, help="the workflow experiment (a target) the runs belong to"
    )
    p.add_argument("--target", action=renamed_option("--experiment"), help=argparse.SUPPRESS)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``track`` subcommand."""
    p = sub.add_parser(
        "track",
        help=HELP,
        description=(
            "Reads each run's folders (config.yaml, round-*/metrics/{rollout,score,train}"
            ".jsonl, eval/trained-*) and pushes them as one MLflow run per variant and "
            "seed under a parent run per experiment, into tracking.mlflow_experiment at "
            "MLFLOW_TRACKING_URI or tracking.uri. Idempotent: a second push adds only what is "
            "new; a run whose files changed since (a rerun) replaces its MLflow run. A run "
            "with a missing round, a server that cannot be reached (within 30 s) or a store "
            "that cannot be read is one error line naming it. With tracking.backend: none, "
            "nothing is pushed and mlflow is not imported."
        ),
    )
    add_experiment_runs_arguments(p)
    p.add_argument(
        "--parent-file",
        action="append",
        default=[],
        type=Path,
        help="a file attached to the experiment's parent run (e.g. the summary's curves.png)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help=f"write {{run key: MLflow run id}} here (JSON); beside it, {LEDGER_NAME} keeps "
        "every run pushed so far, and a store that lost them is refused, not filled anew",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.io.artifacts import atomic_write_text
    from jagg_pipeline.reports.tracking import track_runs

    ledger = args.out.with_name(LEDGER_NAME) if args.out else None
    with stage_errors():
        pushed = track_runs(parse_runs(args), args.experiment, args.parent_file, ledger=ledger)
        if args.out:
            atomic_write_text(args.out, json.dumps(pushed, indent=1, sort_keys=True) + "\n")
    for key, run_id in pushed.items():
        print(f"{key}: {run_id or 'not tracked (tracking.backend: none)'}")
    return 0
