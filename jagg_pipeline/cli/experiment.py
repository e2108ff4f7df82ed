"""``experiment``: the default toy experiment end to end, one process per stage.

Until the Snakemake workflow drives the stages, this command chains them the way its rules
will: for each gradient mode, ``rounds`` x (``rollout`` -> ``score`` -> ``train``), then
``evaluate`` of the base policy and of every mode's last checkpoint, each stage a separate
``python -m jagg_pipeline ...`` process reading and writing files. A stage whose output already
has a manifest is skipped, so an interrupted experiment resumes where it stopped. Prints a
comparison table and where everything is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from jagg_pipeline.cli.rollout import add_config_arguments

MODES = ("exact", "jagg", "no_interp")


# The one-line summary in `python -m jagg_pipeline --help` (no import needed to show it).
HELP = "run rollout -> score -> train rounds per gradient mode, then evaluate (toy default)"


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``experiment`` subcommand."""
    p = sub.add_parser(
        "experiment",
        help=HELP,
        description=(
            "Runs the default experiment through the stage commands, one process each: for "
            "every --modes entry, --rounds rounds of rollout -> score -> train starting from "
            "the base policy (jagg.mode set per run), then evaluate on the base policy and "
            "each mode's final checkpoint. Outputs under OUT/<mode>/round-<r>/ and "
            "OUT/eval/<name>/; finished stages are skipped on a rerun. Without --config the "
            "built-in defaults (the toy world under results/toyworld) are used."
        ),
    )
    add_config_arguments(p, required=False)
    p.add_argument("--out", type=Path, default=Path("results/experiment"), help="output root")
    p.add_argument("--rounds", type=int, default=3, help="training rounds per mode")
    p.add_argument(
        "--modes", nargs="+", choices=MODES, default=["exact", "jagg"], help="gradient modes"
    )
    p.add_argument("--prompts", default="toy:train", help="training prompt source")
    p.set_defaults(handler=_run)


def _stage(argv: list[str], output: Path) -> None:
    """Run one stage command unless ``output`` already carries its manifest."""
    from jagg_pipeline.manifest import manifest_path

    if manifest_path(output).is_file():
        print(f"  done already: {output}")
        return
    print(f"  python -m jagg_pipeline {' '.join(argv)}", flush=True)
    subprocess.run([sys.executable, "-m", "jagg_pipeline", *argv], check=True)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from jagg_pipeline.cli.rollout import load_stage_config, stage_errors
    from jagg_pipeline.config import from_mapping
    from jagg_pipeline.configtools import apply_overrides, to_dict

    if args.rounds < 1:
        raise SystemExit(f"error: --rounds must be >= 1, got {args.rounds}")
    if args.config is not None:
        base = load_stage_config(args.config, args.overrides)
    else:
        with stage_errors():
            base = from_mapping(apply_overrides({}, args.overrides))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    evaluations = {"base": "base"}
    for mode in args.modes:
        data = to_dict(base)
        data["jagg"]["mode"] = mode
        # The train stage's LR schedule spans train.rounds: it must be the count run here.
        data["train"]["rounds"] = args.rounds
        config = out / mode / "config.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(yaml.safe_dump(data, sort_keys=False))
        common = ["--config", str(config)]
        policy = "base"
        print(f"mode {mode}: {args.rounds} rounds", flush=True)
        for r in range(args.rounds):
            directory = out / mode / f"round-{r:04d}"
            rollouts, scores, checkpoint = (
                directory / "rollout",
                directory / "scores.parquet",
                directory / "checkpoint",
            )
            _stage(
                [
                    "rollout",
                    *common,
                    "--policy",
                    policy,
                    "--prompts",
                    str(args.prompts),
                    "--round",
                    str(r),
                    "--out",
                    str(rollouts),
                ],
                rollouts,
            )
            _stage(["score", *common, "--rollouts", str(rollouts), "--out", str(scores)], scores)
            _stage(
                [
                    "train",
                    *common,
                    "--policy",
                    policy,
                    "--rollouts",
                    str(rollouts),
                    "--rewards",
                    str(scores),
                    "--out",
                    str(checkpoint),
                ],
                checkpoint,
            )
            policy = str(checkpoint)
        evaluations[mode] = policy

    first = out / args.modes[0] / "config.yaml"
    rows = []
    for name, policy in evaluations.items():
        target = out / "eval" / name
        _stage(
            ["evaluate", "--config", str(first), "--policy", policy, "--out", str(target)], target
        )
        metrics = json.loads((target / "metrics.json").read_text())["metrics"]
        rows.append((name, metrics))
    _print_table(rows, out)
    return 0


def _print_table(rows: list[tuple[str, dict]], out: Path) -> None:
    names = sorted({m for _, metrics in rows for m in metrics})
    print(f"\nheld-out evaluation ({out / 'eval'}):")
    print(f"{'policy':10}" + "".join(f"{n:>20}" for n in names))
    for policy, metrics in rows:
        cells = "".join(
            f"{metrics[n]['mean']:>13.4f} ±{metrics[n]['std']:<6.3f}"
            if n in metrics
            else f"{'':>20}"
            for n in names
        )
        print(f"{policy:10}{cells}")
    print(f"per-step training metrics: {out}/<mode>/round-*/checkpoint/metrics.jsonl")
