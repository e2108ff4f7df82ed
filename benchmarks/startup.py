"""Start-up cost of the commands: what every Snakemake job pays before its real work.

Measures, each in a fresh interpreter (median of ``--repeat``):

- ``python -m jagg_pipeline <command> --help`` for every command;
- the fixed overhead of each stage job: the imports its handler makes plus loading the toy
  world's base policy (rollout, train, evaluate) or the rewards (score), i.e. everything a
  stage process does before it samples, scores or trains;
- and, given a finished workflow run (``--results``), each stage's median job wall time from
  Snakemake's benchmark files, so the fixed overhead's share of a job is printed beside it.

    python benchmarks/startup.py --world results/toyworld --results results
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = ("config", "gradcheck", "toyworld", "rollout", "score", "train", "evaluate", "summarize")
# What a stage process does before real work (the handler's imports, then its models).
PRELUDE = """
import sys
from jagg_pipeline.cli import build_parser
from jagg_pipeline.config import from_mapping
from jagg_pipeline.toyworld.settings import experiment_sections
config = from_mapping(experiment_sections(sys.argv[1]))
"""
STAGES = {
    "rollout": "from jagg_pipeline.rollout import run_rollout\n"
    "from jagg_pipeline.policy import load_policy\nload_policy(config, 'base')",
    "score": "from jagg_pipeline.scoring import run_score\n"
    "from jagg_pipeline.rewards import MultiReward\nMultiReward.from_spec(config.rewards, 'cpu')",
    "train": "from jagg_pipeline.train import train_round\n"
    "from jagg_pipeline.policy import load_policy\nload_policy(config, 'base')",
    "evaluate": "from jagg_pipeline.evaluate import run_evaluate\n"
    "from jagg_pipeline.policy import load_policy\nload_policy(config, 'base')",
}


def timed(argv: list[str], repeat: int) -> float:
    """Median wall seconds of running ``argv`` ``repeat`` times (it must succeed)."""
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def job_seconds(results: Path, stage: str) -> float | None:
    """Median wall seconds of a stage's jobs in a finished workflow run (benchmark files)."""
    name = "eval" if stage == "evaluate" else stage
    pattern = "*/*/seed-*/eval/*.tsv" if stage == "evaluate" else f"*/*/seed-*/round-*/{name}.tsv"
    values = []
    for path in (results / "benchmarks").glob(pattern):
        with path.open() as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        values += [float(row["s"]) for row in rows]
    return statistics.median(values) if values else None


def main() -> None:
    """Print the --help table and the stage overhead table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=Path, default=Path("results/toyworld"))
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    python = [sys.executable]
    print("| command | --help s |\n|---|---|")
    for command in COMMANDS:
        seconds = timed([*python, "-m", "jagg_pipeline", command, "--help"], args.repeat)
        print(f"| {command} | {seconds:.2f} |")
    bare = timed([*python, "-c", "pass"], args.repeat)
    print(f"\n(bare interpreter start: {bare:.2f} s)\n")
    print("| stage | fixed overhead s | median job s | overhead share |\n|---|---|---|---|")
    for stage, code in STAGES.items():
        overhead = timed([*python, "-c", PRELUDE + code, str(args.world)], args.repeat)
        job = job_seconds(args.results, stage)
        share = f"{overhead / job:.0%}" if job else "-"
        print(
            f"| {stage} | {overhead:.2f} | {job:.2f} | {share} |"
            if job
            else f"| {stage} | {overhead:.2f} | - | - |"
        )


if __name__ == "__main__":
    main()
