"""Shared pieces of the workflow tests: the reduced experiment and a Snakemake runner.

REDUCED mirrors config.yaml's `all` (two of its variants, a tiny toy world, two rounds); the
session fixture ``reduced_all`` (conftest.py) runs it once locally, the reference that the
local and SLURM workflow tests start from or compare with.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEFILE = ["--snakefile", str(ROOT / "Snakefile")]
SNAKEMAKE = [sys.executable, "-m", "snakemake", *SNAKEFILE]
REDUCED = {
    "sampler": {"prompts_per_round": 2, "group_size": 4, "batch_size": 8},
    "eval": {"max_prompts": 4, "samples_per_prompt": 1, "num_steps": 6, "every": 2},
    "tracking": {"backend": "none"},
    "workflow": {
        "toyworld": {"steps": 30, "batch": 4, "clip_steps": 10},
        "experiments": {
            "all": {
                "seeds": [0],
                "overrides": {"train": {"rounds": 2}, "jagg": {"probe_every": 1}},
                "variants": {
                    "exact": {"jagg": {"mode": "exact"}},
                    "jagg": {"jagg": {"mode": "jagg"}},
                },
            }
        },
    },
}


def containers_config(images: dict[str, str]) -> dict:
    """REDUCED with the workflow's images set to conftest.py's ``images``."""
    workflow = {
        **REDUCED["workflow"],
        "containers": {"pipeline": images["pipeline"], "summary": images["summary"]},
    }
    return {**REDUCED, "workflow": workflow}


def snakemake(
    workdir: Path, *args: str, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the repository's Snakefile in ``workdir`` (no hub access; ``env`` added)."""
    return subprocess.run(
        [*SNAKEMAKE, "--directory", str(workdir), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=timeout,
    )


def _snakemake_in_this_process(argv: list[str], output: str) -> tuple[int, float]:
    """`snakemake ARGV` as ``python -m snakemake`` runs it, stdout and stderr to the file
    ``output``: the exit status and the seconds it ran."""
    import snakemake.cli

    with open(output, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    start = time.perf_counter()
    try:
        snakemake.cli.main(argv)
        status = 0
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else int(done.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    return status, time.perf_counter() - start


def snakemake_forked(
    calls: dict[str, list[str]], processes: int, timeout: float = 300
) -> dict[str, tuple[int, str, float]]:
    """Run the repository's Snakefile once per ``calls`` entry (name -> [workdir, *args]),
    ``processes`` at a time, each in a fresh process forked from one that imported Snakemake
    already (a second of each call otherwise): name -> (exit status, stdout and stderr, s).

    For calls that start no jobs (dry runs): a forked process has the environment this process
    had when the first call started the fork server.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["snakemake.cli", "workflow_helpers"])
    with tempfile.TemporaryDirectory() as folder:
        outputs = {name: Path(folder, f"{n}.txt") for n, name in enumerate(calls)}
        with ProcessPoolExecutor(processes, mp_context=context, max_tasks_per_child=1) as pool:
            futures = {
                name: pool.submit(
                    _snakemake_in_this_process,
                    [*SNAKEFILE, "--directory", workdir, *args],
                    str(outputs[name]),
                )
                for name, (workdir, *args) in calls.items()
            }
            done = {name: future.result(timeout=timeout) for name, future in futures.items()}
        return {
            name: (status, outputs[name].read_text(), seconds)
            for name, (status, seconds) in done.items()
        }


def copy_run(reference: Path, workdir: Path) -> Path:
    """A copy of a finished workdir, with Snakemake's metadata and the files' mtimes: Snakemake
    sees the finished run there, and reruns only what a test then changes."""
    shutil.copytree(reference, workdir, symlinks=True, dirs_exist_ok=True)
    return workdir


def write_config(workdir: Path, data: dict) -> Path:
    """``workdir``/config.yaml holding ``data``."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# Files whose content includes wall-clock timings, so differ between any two runs (a round's
# kept metric lines, round-<r>/metrics/<stage>.jsonl, too).
TIMED_FILES = (
    "metrics.jsonl",
    "rollout.jsonl",
    "score.jsonl",
    "train.jsonl",
    "table.md",
    "index.html",
    "speed.png",
)


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def comparable_outputs(workdir: Path) -> dict[str, Any]:
    """Every output below ``workdir``/results (logs and benchmarks aside): relative path ->
    bytes, or parsed JSON without its ``*seconds*`` keys; files of timings left out."""
    results = workdir / "results"
    outputs = {}
    for path in sorted(results.rglob("*")):
        relative = path.relative_to(results).as_posix()
        if not path.is_file() or relative.split("/")[0] in ("logs", "benchmarks"):
            continue
        if path.name in TIMED_FILES:
            continue
        if path.suffix == ".json":
            outputs[relative] = _without_timings(json.loads(path.read_text()))
        else:
            outputs[relative] = path.read_bytes()
    return outputs


def synthetic_run(
    folder: Path, mode: str, rounds: int = 2, tracking: dict | None = None, shift: float = 0.0
) -> Path:
    """A finished training run's kept files, written directly (no model, no job): the
    resolved config.yaml (``rounds`` rounds, evaluated every 2 and at the end), each round's
    rollout, score and train records, each evaluation's metrics and grid; values move with
    the round and ``shift``. For the tests of what reads runs back (summary, track, compare).
    """
    from jagg_pipeline.config.fields import from_dict, to_dict
    from jagg_pipeline.config.run import RunConfig
    from jagg_pipeline.io.artifacts import evaluated_rounds

    config = to_dict(RunConfig())
    config["train"]["rounds"], config["eval"]["every"] = rounds, 2
    config["jagg"]["mode"] = mode
    if tracking is not None:
        config["tracking"] = tracking
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def lines(path: Path, *records: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(record) + "\n" for record in records))

    for r in range(rounds):
        records = folder / f"round-{r:04d}/metrics"
        head = {"round": r, "step": 0}
        lines(records / "rollout.jsonl", {"stage": "rollout", **head, "reward.mean": 0.3 + r})
        lines(records / "score.jsonl", {"stage": "score", **head, "total_mean": 0.3 + r + shift})
        times = {"time.forward": 1.0 + shift, "time.backward": 0.5, "time.optimizer": 0.1}
        lines(records / "train.jsonl", {"stage": "train", **head, "loss": 0.1 * r, **times})
    resolved = from_dict(RunConfig, config)
    for n in evaluated_rounds(resolved.train.rounds, resolved.eval.every):
        evaluation = folder / f"eval/trained-{n:04d}"
        value = 0.4 + 0.01 * n + shift
        line = {"stage": "evaluate", "round": n, "step": 0, "toy": value}
        lines(evaluation / "metrics.jsonl", line)
        (evaluation / "metrics.json").write_text(json.dumps({"metrics": {"toy": {"mean": value}}}))
        (evaluation / "grid.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return folder


def with_toy_world_of(reference: Path, workdir: Path) -> Path:
    """``workdir`` holding the toy world and prompt pools of ``reference`` (a finished reduced
    `all`), mtimes kept: a run of REDUCED's toy world there starts at its first round."""
    for folder in ("toyworld", "conditioning"):
        shutil.copytree(reference / "results" / folder, workdir / "results" / folder)
    return workdir


def blocks_workdir(reference: Path, workdir: Path, rounds_per_job: int) -> Path:
    """The reduced `all` at ``workflow.rounds_per_job``, in ``workdir``, starting from the
    toy world and prompt pools of ``reference`` (a finished reduced `all`)."""
    with_toy_world_of(reference, workdir)
    data = copy.deepcopy(REDUCED)
    data["workflow"]["rounds_per_job"] = rounds_per_job
    write_config(workdir, data)
    return workdir


def without_blocks(outputs: dict[str, Any]) -> dict[str, Any]:
    """:func:`comparable_outputs` as blocks and single rounds share them: no block records
    and none of the timestamps Snakemake leaves in the folders its rules declare (a block
    declares only its record and last checkpoint), no comparison page (it shows timings)."""
    skipped = ("block.json", "-transient.json", ".snakemake_timestamp")
    return {
        k: v
        for k, v in outputs.items()
        if not k.endswith(skipped) and not k.startswith("comparison/")
    }


def job_counts(output: str) -> dict[str, int]:
    """Snakemake's job stats table (``job  count`` lines) as rule -> jobs."""
    counts = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and not parts[0].endswith(":"):
            counts[parts[0]] = int(parts[1])
    return counts
