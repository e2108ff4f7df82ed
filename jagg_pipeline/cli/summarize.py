"""``summarize``: one experiment's runs compared: a metrics table, curves and a markdown table."""

from __future__ import annotations

import argparse
from pathlib import Path

from jagg_pipeline.cli.common import add_run_argument, parse_runs, stage_errors

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "compare an experiment's runs: metrics.jsonl of every run, table.md, curves.png"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``summarize`` subcommand."""
    p = sub.add_parser(
        "summarize",
        help=HELP,
        description=(
            "Reads the finished outputs of each run (round-*/metrics/{rollout,score,train}"
            ".jsonl, eval/trained-*) and writes into OUT: metrics.jsonl (every "
            "metric line of every run, tagged with run, variant and seed), summary.json, "
            "table.md (per variant, mean +- std over seeds: held-out metrics base -> final "
            "and their rise, rollout reward, update-stage seconds per round; then per stage the "
            "median import, load and work seconds of a job) and curves.png. A round or an "
            "evaluation that a run's config.yaml calls for and its folder lacks is an error "
            "naming it: no run is summarised with a point missing."
        ),
    )
    add_run_argument(p, "a run folder and its variant and seed; repeat for every run")
    p.add_argument("--title", default="", help="heading of the table and the plot")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from jagg_pipeline.reports.summary import write_summary
    from jagg_pipeline.workflow.layout import variant_seed

    runs = {
        variant_seed(variant, seed): (directory, variant, seed)
        for variant, seed, directory in parse_runs(args)
    }
    with stage_errors():
        write_summary(runs, args.out, args.title)
    print((args.out / "table.md").read_text())
    print(f"summary written to {args.out}")
    return 0
