"""``config``: print the resolved experiment config, a commented template, or the schemas."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "print the resolved experiment config (YAML) or its JSON Schema"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``config`` subcommand."""
    p = sub.add_parser(
        "config",
        help=HELP,
        description=(
            "'show' prints the experiment config with every default filled, after reading "
            "--config (if given) and applying --set overrides; unknown keys and wrong types "
            "fail naming the file and the key. 'template' prints the same as YAML with every "
            "key's help as a comment. 'schema' prints the JSON Schema (draft 2020-12) derived "
            "from the same dataclasses; with --workflow, the schema of the workflow's "
            "config.yaml (these sections plus the workflow section), which Snakemake "
            "validates against."
        ),
    )
    p.add_argument("what", choices=("show", "template", "schema"), help="what to print")
    p.add_argument("--workflow", action="store_true", help="schema: of the workflow's config.yaml")
    p.add_argument("--config", type=Path, help="experiment YAML (default: built-in defaults)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one key (value parsed as YAML); repeatable",
    )
    p.add_argument("--out", type=Path, help="write to this file (atomically) instead of stdout")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from jagg_pipeline.artifacts import atomic_write_text
    from jagg_pipeline.config import ExperimentConfig, from_mapping, load_config, schema
    from jagg_pipeline.configtools import ConfigError, apply_overrides, commented_yaml, to_dict
    from jagg_pipeline.experiments import workflow_schema

    try:
        if args.what == "schema":
            text = json.dumps(workflow_schema() if args.workflow else schema(), indent=2) + "\n"
        else:
            if args.config is not None:
                config = load_config(args.config, args.set)
            elif args.set:
                config = from_mapping(apply_overrides({}, args.set))
            else:
                config = ExperimentConfig()
            data = to_dict(config)
            if args.what == "template":
                text = commented_yaml(schema(), data)
            else:
                text = yaml.safe_dump(data, sort_keys=False)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        atomic_write_text(args.out, text)
    else:
        sys.stdout.write(text)
    return 0
