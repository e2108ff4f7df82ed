"""``compare``: an experiment's runs read back from MLflow (or their folders) into HTML."""

from __future__ import annotations

import argparse
from pathlib import Path

from jagg_pipeline.cli.common import parse_runs, stage_errors
from jagg_pipeline.cli.track import add_experiment_runs_arguments

HELP = "compare a experiment's runs from MLflow: index.html, table.md, curves/speed/cos-sim PNGs"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``compare`` subcommand."""
    p = sub.add_parser(
        "compare",
        help=HELP,
        description=(
            "Reads the runs of TARGET back from MLflow (tracking.backend: mlflow; they must "
            "have been pushed with `track`) or, with tracking off, from their folders, and "
            "writes into OUT: index.html, table.md (mean +- std over seeds per variant), "
            "curves.png (held-out metrics and rollout reward vs round, seed bands), speed.png "
            "(update seconds per round, speed-up vs the exact variant with its spread over "
            "rounds and seeds) and cos_sim.png "
            "(per-window cos-sim vs round, when jagg_frac: auto or jagg.probe_every probed it)."
        ),
    )
    add_experiment_runs_arguments(p)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.reports.compare import write_comparison
    from jagg_pipeline.reports.summary import read_run
    from jagg_pipeline.reports.tracker import tracking_uri
    from jagg_pipeline.reports.tracking import (
        open_tracker,
        run_key,
        run_metrics,
        tracking_of,
    )
    from jagg_pipeline.support.errors import InputError

    runs = parse_runs(args)
    with stage_errors():
        tracking = tracking_of([directory for _, _, directory in runs])
        if tracking.backend == "none":
            metrics = [read_run(directory, variant, seed) for variant, seed, directory in runs]
            source = "the run folders (tracking.backend: none)"
        else:
            # Read only: a store or experiment that is not there is not created.
            tracker = open_tracker(tracking, create=False)
            tracked = {t.tags.get("jagg_run_key"): t for t in tracker.runs(args.experiment)}
            keys = [run_key(d, args.experiment, v, s) for v, s, d in runs]
            missing = [key for key in keys if key not in tracked]
            if missing:
                raise InputError(
                    f"not in MLflow experiment {tracking.mlflow_experiment!r} at "
                    f"{tracking_uri(tracking)}: {', '.join(missing)}; push them with `track`"
                )
            metrics = [run_metrics(tracked[key]) for key in keys]
            source = f"MLflow ({tracking_uri(tracking)}, experiment {tracking.mlflow_experiment})"
        write_comparison(metrics, args.out, args.experiment, source)
    print((args.out / "table.md").read_text())
    print(f"comparison written to {args.out}/index.html (runs from {source})")
    return 0
