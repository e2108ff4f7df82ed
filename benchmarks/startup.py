"""Start-up of the commands: what every Snakemake job pays before its real work.

Measures this source tree and, with ``--baseline TREE``, another one side by side (e.g. the
last commit: ``git archive HEAD | tar -x -C /tmp/base``), alternating between them so that
both see the same machine load; every number is the median of ``--repeat`` fresh processes:

- ``python -m jagg_pipeline <command> --help`` for every command;
- each stage's start-up: import (seconds from the process start until the modules its handler
  imports are in, config read) and load (what the stage loads before its work: the rollout's
  and evaluation's base policy, the score stage's rollout and rewards, the train stage's
  rollout, score table and policy), run the same way in either tree, after the tree's own
  command set-up (``jagg_pipeline.support.startup.start_command``, where it has one);
- each stage as its real command on the toy world (``--world``; the default experiment, 8
  evaluation prompts): the job's wall seconds, and the import / load / work seconds that the
  job records in its metrics line (:mod:`jagg_pipeline.support.startup`, trees that have it);
- given a finished workflow run (``--results``), each stage's median job wall time from
  Snakemake's benchmark files beside the medians its metrics lines recorded.

    python benchmarks/startup.py --world results/toyworld --baseline /tmp/base

A tree's package is imported from its own folder (the working directory); with an editable
install, a module the tree lacks comes from the installed one. Linux only (the process start
comes from /proc). Timings are noisy on a shared machine: the ratios of the two trees,
measured side by side, are the claim.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from jagg_pipeline.io.artifacts import ROUND_PREFIX
from jagg_pipeline.io.tables import markdown_table

COMMANDS = ("config", "gradcheck", "toyworld", "rollout", "score", "train", "evaluate", "summarize")
STAGES = ("rollout", "score", "train", "evaluate")
PARTS = ("import", "load", "work")  # a job's recorded seconds: time.<part>
# A stage's start-up, run in the tree under test (argv: config file, rollout dir, score dir).
PRELUDE = """
import json, os, sys, time
from pathlib import Path

import jagg_pipeline

# The tree's command set-up, where it has one (an editable install would find the installed
# tree's module for a tree without).
if (Path(jagg_pipeline.__file__).parent / "startup.py").is_file():
    from jagg_pipeline.support.startup import start_command

    start_command()


def age():
    # Seconds since this process started, as jagg_pipeline.support.startup measures them.
    with open("/proc/self/stat", "rb") as handle:
        ticks = int(handle.read().rsplit(b")", 1)[1].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


config_file, rollouts, scores = sys.argv[1:4]
from jagg_pipeline.cli import build_parser
from jagg_pipeline.cli.common import read_run_config

build_parser("{stage}")
config = read_run_config(Path(config_file))
{imports}
imported = age()
start = time.perf_counter()
{load}
print(json.dumps({{"import": imported, "load": time.perf_counter() - start}}))
"""
# What each stage's handler imports, then what the stage loads before its work.
STAGE_CODE = {
    "rollout": (
        "from jagg_pipeline.stages.rollout import run_rollout",
        "from jagg_pipeline.stages.distributed import distributed\n"
        "from jagg_pipeline.stages.policy import load_policy\n"
        "from jagg_pipeline.io.prompts import resolve_prompts\n"
        "resolve_prompts(config.sampler.prompts, config.sampler.prompt_column)\n"
        "load_policy(config, 'base')",
    ),
    "score": (
        "from jagg_pipeline.stages.scoring import run_score",
        "from jagg_pipeline.io.manifest import CHECKED_SECTIONS, check_input\n"
        "from jagg_pipeline.rewards import MultiReward\n"
        "from jagg_pipeline.io.trajectories import load_rollout\n"
        "check_input(rollouts, stage='rollout', config=config, "
        "sections=CHECKED_SECTIONS['rollout'])\n"
        "load_rollout(rollouts)\n"
        "MultiReward.from_spec(config.rewards, 'cpu')",
    ),
    "train": (
        "from jagg_pipeline.stages.train import train_round",
        "from jagg_pipeline.stages.policy import load_policy\n"
        "from jagg_pipeline.stages.train import load_round_data\n"
        "load_round_data(config, 'base', rollouts, scores)\n"
        "load_policy(config, 'base', for_training=True)",
    ),
    "evaluate": (
        "from jagg_pipeline.stages.evaluate import run_evaluate",
        "from jagg_pipeline.stages.distributed import local_device\n"
        "from jagg_pipeline.stages.policy import load_policy\n"
        "from jagg_pipeline.rewards import load_reward\n"
        "load_policy(config, 'base')\n"
        "[load_reward(name, config.rewards.spec(name), 'cpu') for name in config.eval.metrics]",
    ),
}
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# Each stage's output folder under a repeat's work folder.
FOLDERS = {"rollout": "rollout", "score": "scores", "train": "ckpt", "evaluate": "eval"}


def run(tree: Path, argv: list[str]) -> tuple[float, str]:
    """Wall seconds and stdout of ``python ARGV`` started in ``tree`` (it must succeed).

    ``tree`` is the working directory, so ``python -m`` / ``-c`` import its jagg_pipeline.
    """
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, *argv], cwd=tree, env=ENV, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{tree}: python {' '.join(argv)} failed:\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def job_argv(stage: str, config: Path, work: Path) -> list[str]:
    """The command line of ``stage`` on the experiment ``config``, its folders under ``work``."""
    folder = {name: str(work / sub) for name, sub in FOLDERS.items()}
    rollouts = ["--rollouts", folder["rollout"]]
    inputs = {
        "rollout": ["--policy", "base"],
        "score": rollouts,
        "train": ["--policy", "base", *rollouts, "--scores", folder["score"]],
        "evaluate": ["--policy", "base"],
    }
    out = ["--config", str(config), "--out", folder[stage]]
    return ["-m", "jagg_pipeline", stage, *out, *inputs[stage]]


def recorded(folder: Path) -> dict[str, float]:
    """The ``time.*`` seconds of a stage folder's first metrics line (none: not recorded)."""
    line = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    return {part: line[f"time.{part}"] for part in PARTS if f"time.{part}" in line}


def measure_tree(tree: Path, config: Path, work: Path) -> dict[str, Any]:
    """One repeat in ``tree``: --help per command, and per stage its job and its prelude."""
    out: dict[str, Any] = {"help": {}, "job": {}, "recorded": {}, "prelude": {}}
    for command in COMMANDS:
        out["help"][command] = run(tree, ["-m", "jagg_pipeline", command, "--help"])[0]
    for stage in STAGES:
        out["job"][stage] = run(tree, job_argv(stage, config, work))[0]
        out["recorded"][stage] = recorded(work / FOLDERS[stage])
    for stage, (imports, load) in STAGE_CODE.items():
        code = PRELUDE.format(stage=stage, imports=imports, load=load)
        inputs = [str(work / FOLDERS["rollout"]), str(work / FOLDERS["score"])]
        argv = ["-c", code, str(config), *inputs]
        out["prelude"][stage] = json.loads(run(tree, argv)[1].splitlines()[-1])
    return out


def median_of(repeats: list[dict[str, Any]], *keys: str) -> float:
    """The median over ``repeats`` of the value at ``keys`` (NaN where none has it)."""
    values = []
    for value in repeats:
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            values.append(value)
    return statistics.median(values) if values else float("nan")


def side_by_side(values: list[float]) -> list[str]:
    """The trees' values, then (two trees) the second over the first as ``0.85x``."""
    cells = [f"{v:.2f}" for v in values]
    return cells + ([f"{values[1] / values[0]:.2f}x"] if len(values) == 2 else [])


def job_seconds(results: Path, stage: str) -> float | None:
    """Median wall seconds of a stage's jobs in a finished workflow run (benchmark files)."""
    name = "eval" if stage == "evaluate" else stage
    pattern = (
        "*/*/seed-*/eval/*.tsv" if stage == "evaluate" else f"*/*/seed-*/{ROUND_PREFIX}*/{name}.tsv"
    )
    values = []
    for path in (results / "benchmarks").glob(pattern):
        with path.open() as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        values += [float(row["s"]) for row in rows]
    return statistics.median(values) if values else None


def workflow_table(results: Path) -> str:
    """Per stage of a finished workflow run: Snakemake's job wall beside the recorded split."""
    from jagg_pipeline.reports.summary import read_run, stage_seconds

    runs = [
        read_run(folder, folder.parent.name, int(folder.name.removeprefix("seed-")))
        for folder in sorted(results.glob("*/*/seed-*"))
        if folder.is_dir()
    ]
    stages = stage_seconds(runs)
    rows = []
    for stage in STAGES:
        values = [job_seconds(results, stage), *(stages.get(stage, {}).get(p) for p in PARTS)]
        rows.append([stage, *("-" if v is None else f"{v:.2f}" for v in values)])
    return markdown_table(["stage", "median job s", "import s", "load s", "work s"], rows)


def main() -> None:
    """Print the --help, start-up and job tables (and the workflow run's, with --results)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=Path, default=Path("results/toyworld"))
    parser.add_argument("--baseline", type=Path, help="another source tree to compare with")
    parser.add_argument("--results", type=Path, help="a finished workflow run's results/")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = ({"base": args.baseline.resolve()} if args.baseline else {}) | {"this": here}
    names = list(trees)
    repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="startup-") as scratch:
        from jagg_pipeline.toyworld.config import experiment_sections

        config = Path(scratch) / "experiment.yaml"
        data = experiment_sections(args.world.resolve()) | {"eval": {"max_prompts": 8}}
        config.write_text(yaml.safe_dump(data))
        for index in range(args.repeat):
            # A B, then B A: a drift in the machine's load weighs on both trees alike.
            for name in names if index % 2 == 0 else names[::-1]:
                work = Path(scratch) / f"{name}-{index}"
                repeats[name].append(measure_tree(trees[name], config, work))
    ratio = ["ratio"] if len(names) == 2 else []

    def heads(quantity: str) -> list[str]:
        return [f"{quantity} {name}" for name in names]

    def row(*keys: str) -> list[float]:
        return [median_of(repeats[name], *keys) for name in names]

    print(
        markdown_table(
            ["command", *heads("--help s"), *ratio],
            [[command, *side_by_side(row("help", command))] for command in COMMANDS],
        )
    )
    print("\nStage start-up in a fresh process (import: process start to the stage's modules;")
    print("load: what the stage loads before its work):\n")
    rows = []
    for stage in STAGES:
        imports, loads = row("prelude", stage, "import"), row("prelude", stage, "load")
        totals = [i + lo for i, lo in zip(imports, loads, strict=True)]
        rows.append([stage, *[f"{v:.2f}" for v in imports + loads], *side_by_side(totals)])
    head = ["stage", *heads("import s"), *heads("load s"), *heads("start-up s"), *ratio]
    print(markdown_table(head, rows))
    print("\nStage jobs on the toy world: wall s, and what the job records in the this tree")
    print("(other: writing outputs and the process's exit):\n")
    rows = []
    for stage in STAGES:
        split = [median_of(repeats["this"], "recorded", stage, part) for part in PARTS]
        wall = row("job", stage)
        other = wall[-1] - sum(split)
        share = (split[0] + split[1]) / sum(split)
        cells = [f"{s:.2f}" for s in (*split, other)]
        rows.append([stage, *side_by_side(wall), *cells, f"{share:.0%}"])
    head = ["stage", *heads("job s"), *ratio, "import s", "load s", "work s", "other s"]
    print(markdown_table([*head, "overhead share"], rows))
    bare = statistics.median(run(here, ["-c", "pass"])[0] for _ in range(args.repeat))
    print(f"\n(bare interpreter start: {bare:.2f} s)")
    if args.results:
        print(f"\nWorkflow run {args.results}:\n")
        print(workflow_table(args.results))


if __name__ == "__main__":
    main()
