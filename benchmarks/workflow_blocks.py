"""The default toy experiment end to end as single rounds and as blocks: wall time and jobs.

Runs the Snakefile's default target (`all`: exact, jagg and no_interp, 4 rounds each,
evaluated after 0, 2 and 4) on two cores, once with ``workflow.rounds_per_job: 1`` (each
round its rollout, score and train jobs) and once with ``--rounds-per-job`` (default 4: each
run's 4 rounds one block job), in fresh work folders that share one toy world and its prompt
pools (built first, not timed), tracking off. Prints the wall seconds, the number of jobs
(Snakemake's job stats, targets and the toy world aside) and their ratio, and checks that the
two runs trained the same final checkpoints, byte for byte.

    python benchmarks/workflow_blocks.py [--rounds-per-job 4] [--workdir DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent.parent
# The tests' Snakemake runner and checkpoint comparison (tests/ holds the shared helpers).
sys.path.insert(0, str(HERE / "tests"))
from block_helpers import checkpoint_files  # noqa: E402
from workflow_helpers import job_counts  # noqa: E402
from workflow_helpers import snakemake as run_snakemake  # noqa: E402

# Jobs that are not rounds or evaluations: built once, or run on the submitting host.
NOT_COUNTED = {"all", "total", "toyworld_clip", "toyworld_pretrain", "toyworld_backbone"}


def write_config(workdir: Path, rounds_per_job: int) -> None:
    """config.yaml's default experiment at ``rounds_per_job``, tracking off."""
    data = yaml.safe_load((HERE / "config.yaml").read_text())
    data["tracking"] = {**data.get("tracking", {}), "backend": "none"}
    data.setdefault("workflow", {})["rounds_per_job"] = rounds_per_job
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """The repository's Snakefile in ``workdir`` on two cores; exits on a failure."""
    result = run_snakemake(workdir, "--cores", "2", *args, timeout=7200)
    if result.returncode:
        tail = result.stderr[-3000:]
        raise SystemExit(f"snakemake {' '.join(args)} failed in {workdir}:\n{tail}")
    return result


def final_checkpoints(workdir: Path) -> dict[str, bytes]:
    """Every run's last checkpoint (weights and trainer state), by path."""
    return {
        f"{checkpoint.relative_to(workdir)}/{name}": data
        for checkpoint in sorted((workdir / "results/all").glob("*/seed-0/round-0003/checkpoint"))
        for name, data in checkpoint_files(checkpoint).items()
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Build the shared toy world, run both modes, print and check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds-per-job", type=int, default=4)
    parser.add_argument("--workdir", type=Path, help="default: a temporary folder")
    parser.add_argument("--out", type=Path, help="JSON file of the figures")
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="workflow-blocks-"))
    shared = root / "shared"
    write_config(shared, 1)
    print(f"[{time.strftime('%H:%M:%S')}] building the toy world and prompt pools", flush=True)
    snakemake(shared, "all", "--until", "encode")
    rows = {}
    for k in (1, args.rounds_per_job):
        workdir = root / f"k{k}"
        write_config(workdir, k)
        for folder in ("toyworld", "conditioning"):
            shutil.copytree(shared / "results" / folder, workdir / "results" / folder)
        print(f"[{time.strftime('%H:%M:%S')}] rounds_per_job {k}", flush=True)
        start = time.perf_counter()
        result = snakemake(workdir, "all")
        wall = time.perf_counter() - start
        counts = job_counts(result.stdout + result.stderr)
        jobs = {rule: n for rule, n in counts.items() if rule not in NOT_COUNTED}
        rows[k] = {"wall": wall, "jobs": sum(jobs.values()), "by_rule": jobs}
    one, block = rows[1], rows[args.rounds_per_job]
    same = final_checkpoints(root / "k1") == final_checkpoints(root / f"k{args.rounds_per_job}")
    print("\n| rounds_per_job | wall (s) | jobs | jobs by rule |\n|---|---|---|---|")
    for k, row in rows.items():
        rules = ", ".join(f"{rule} {n}" for rule, n in sorted(row["by_rule"].items()))
        print(f"| {k} | {row['wall']:.0f} | {row['jobs']} | {rules} |")
    print(
        f"\nwall K=1 / K={args.rounds_per_job}: {one['wall'] / block['wall']:.2f}x; jobs "
        f"{one['jobs']} -> {block['jobs']}; final checkpoints byte-identical: {same}"
    )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "same_checkpoints": same}, indent=2))
    if not same:
        raise SystemExit("the two runs trained different checkpoints")


if __name__ == "__main__":
    main()
