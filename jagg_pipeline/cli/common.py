"""What the stage commands share on the command line.

``--config`` / ``--set`` (one meaning everywhere: ``--set KEY.PATH=VALUE`` overrides one key
of the run config), ``--policy``, ``--run VARIANT SEED DIR`` (the commands that compare
runs), and turning bad input into a one-line ``error: <message>`` exit.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def renamed_option(new: str) -> type[argparse.Action]:
    """An argparse action for a flag that was renamed: using it exits naming ``new``."""

    class Renamed(argparse.Action):
        def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
            super().__init__(option_strings, dest, nargs="?", **kwargs)

        def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
            parser.error(f"{'/'.join(self.option_strings)} is now {new}")

    return Renamed


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--config FILE`` and repeatable ``--set KEY.PATH=VALUE`` overrides."""
    parser.add_argument(
        "--config",
        type=Path,
        required=required,
        metavar="FILE",
        help="run config (YAML), or the workflow's config.yaml (its base sections are "
        "used); unknown keys are errors; the resolved config is written next to the outputs",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config key (value parsed as YAML), e.g. sampler.group_size=4; "
        "repeatable",
    )


def add_policy_argument(
    parser: argparse.ArgumentParser,
    help: str = "'base' (the checkpoint at backbone.path) or a training checkpoint directory",
) -> None:
    """``--policy base|CKPT``: the policy a stage samples from or trains."""
    parser.add_argument("--policy", required=True, metavar="base|CKPT", help=help)


def add_conditioning_argument(parser: argparse.ArgumentParser, pool: str) -> None:
    """``--conditioning DIR``: a sampling stage reads its prompts' conditioning from ``encode``."""
    parser.add_argument(
        "--conditioning",
        type=Path,
        metavar="DIR",
        help=f"the `encode` output of {pool}: its rows are the prompts' conditioning and no "
        "text encoder is loaded (checked: stage, file digests, the backbone's text keys); "
        "default: encode the prompts inline",
    )


def add_prompt_arguments(parser: argparse.ArgumentParser, column_default: str) -> None:
    """``--prompts POOL`` and ``--column NAME`` of the commands that read a prompt pool."""
    parser.add_argument(
        "--prompts",
        metavar="FILE|toy:train|toy:heldout",
        help="prompt pool: a prompt file (.txt, .json, .jsonl, .csv, .parquet) or a toy split "
        "(default: sampler.prompts)",
    )
    parser.add_argument(
        "--column",
        metavar="NAME",
        help=f"prompt column of a tabular prompt file (default: {column_default})",
    )


def add_run_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--run VARIANT SEED DIR`` (repeated): the runs a command compares or tracks."""
    parser.add_argument(
        "--run",
        nargs=3,
        action="append",
        required=True,
        metavar=("VARIANT", "SEED", "DIR"),
        help=help,
    )


def parse_runs(args: argparse.Namespace) -> list[tuple[str, int, Path]]:
    """The ``--run`` triples as (variant, integer seed, folder)."""
    runs = []
    for variant, seed, directory in args.run:
        if not seed.isdigit():
            raise SystemExit(f"error: --run {variant} {seed} {directory}: SEED must be an integer")
        runs.append((variant, int(seed), Path(directory)))
    return runs


def read_run_config(path: Path, overrides: Sequence[str] = ()) -> Any:
    """The run config in ``path`` after ``--set`` overrides; every command reads it here.

    ``path`` is a run config (the package's sections) or the workflow's config.yaml:
    a file with a top-level ``workflow`` section has that section checked (unknown keys and
    wrong types are errors, as everywhere) and then set aside, and the rest, the base
    experiment, is the config. ``--set`` overrides apply to the base experiment. Raises
    :class:`~jagg_pipeline.config.fields.ConfigError` naming the file (or the override) and the
    dotted key.
    """
    from jagg_pipeline.config.fields import ConfigError
    from jagg_pipeline.config.run import RunConfig
    from jagg_pipeline.config.yaml_io import load_data, read_yaml
    from jagg_pipeline.workflow.names import WORKFLOW_KEY
    from jagg_pipeline.workflow.sections import split

    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    if WORKFLOW_KEY in data:
        try:
            data, _ = split(data)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    return load_data(RunConfig, data, str(path), overrides)


def load_stage_config(path: Path, overrides: list[str]) -> Any:
    """The run config of a stage command (errors become ``error:`` exits).

    See :func:`read_run_config` (a workflow config.yaml gives its base experiment).
    """
    with stage_errors():
        return read_run_config(path, overrides)


@contextmanager
def stage_errors() -> Iterator[None]:
    """Exit with ``error: <message>`` on bad input (an ``InputError``).

    Config, manifest, table, prompt-file, policy and checkpoint errors name the key or the
    file; a missing input path is a FileNotFoundError; a full disk or an unwritable folder an
    OutputError naming the output. Anything else is a bug and keeps its traceback.
    """
    from jagg_pipeline.io.artifacts import OutputError
    from jagg_pipeline.support.errors import InputError

    try:
        yield
    except (InputError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    except OutputError as err:
        raise SystemExit(f"error: {err.strerror}") from None
