"""Blocks of rounds (``workflow.rounds_per_job``): K rounds of a run in one job, resident.

- the heart of it: blocks of K = 2 and K = all rounds train the weights of single-round jobs
  byte for byte, and write the same metric lines (timings aside) and evaluations, for exact,
  jagg (separate and shared anchors, velocity reuse on), no_interp, full fine-tuning and LoRA,
  on a tiny Flux and QwenImage, in one process and on 2 gloo ranks; through the workflow on the
  toy world, every output the summary, tracking and comparison read is the single-round run's;
- faults: SIGKILL inside a block, then a rerun, ends byte-identical to an uninterrupted run,
  resuming from the block's input policy or from a checkpoint it kept;
- the workflow's blocks: which rounds form a block, what each block writes and evaluates, a
  deleted file of a finished block reruns that block;
- long runs: a 1000-round experiment's DAG builds at K = 25 and at K = 1.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from block_helpers import blocks, checkpoint_files, round_lines, single_rounds
from stage_helpers import tiny_checkpoint, write_experiment
from train_helpers import flip_byte, torchrun
from workflow_helpers import (
    REDUCED,
    blocks_workdir,
    comparable_outputs,
    copy_run,
    job_counts,
    snakemake,
    without_blocks,
    write_config,
)

from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.runs import blocks as block_ranges

ROUNDS = 3
# Six steps, a segment of four SDE steps trained in one window of 4: JAGG interpolates two
# interior steps, which velocity reuse takes from the rollout.
SAMPLER = {"num_steps": 6, "segment_steps": 4, "segment_start": [0, 1]}
VARIANTS = {
    "exact": {"jagg": {"mode": "exact", "window": 4}},
    "jagg-reuse": {"jagg": {"mode": "jagg", "window": 4, "reuse_velocities": True}},
    "jagg-shared": {"jagg": {"mode": "jagg", "window": 2, "anchors": "shared"}},
    "no_interp": {"jagg": {"mode": "jagg", "window": 4, "no_interp": "drop"}},
}
CASES = [
    ("flux", "full", "jagg-reuse"),
    ("flux", "lora", "jagg-shared"),
    ("flux", "full", "no_interp"),
    ("qwenimage", "full", "exact"),
    ("qwenimage", "lora", "jagg-reuse"),
]


def _config(tmp_path: Path, family: str, training: str, variant: str):
    checkpoint = tiny_checkpoint(family, tmp_path.parent)
    backbone = {"training": training}
    if training == "lora":
        backbone["lora"] = {"rank": 2}
    sections = {"train": {"rounds": ROUNDS}, "sampler": SAMPLER, "backbone": backbone}
    for name, values in VARIANTS[variant].items():
        sections[name] = values
    _, config = write_experiment(tmp_path / "config.yaml", family, checkpoint, **sections)
    return config


@pytest.mark.parametrize(("family", "training", "variant"), CASES)
def test_blocks_train_the_weights_of_single_rounds_byte_for_byte(
    tmp_path, family, training, variant
):
    config = _config(tmp_path, family, training, variant)
    single = single_rounds(config, tmp_path / "single")
    reference = checkpoint_files(single)
    assert reference, single
    lines = round_lines(tmp_path / "single", ROUNDS)
    for size in (2, ROUNDS):
        workdir = tmp_path / f"blocks-{size}"
        final = blocks(config, workdir, size)
        assert checkpoint_files(final) == reference, f"K={size}"
        assert round_lines(workdir, ROUNDS) == lines, f"K={size}"


def test_the_workflow_plans_blocks_their_evaluations_and_records():
    data = {
        "train": {"rounds": 10},
        "eval": {"every": 4},
        "workflow": {
            "rounds_per_job": 4,
            "keep_every": 3,
            "experiments": {"all": {"seeds": [0], "variants": {"jagg": {}}}},
        },
    }
    run = resolve_runs(data)["all/jagg/seed-0"]
    assert [list(b) for b in run.blocks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # Evaluated after 0, 4, 8 and 10 rounds: each by the block that trains up to it.
    assert [run.block_evaluations(b) for b in run.blocks] == [[0, 4], [8], [10]]
    assert block_ranges(5, 5) == [range(0, 5)]
    assert block_ranges(5, 100) == [range(0, 5)]
    single = resolve_runs({**data, "workflow": {**data["workflow"], "rounds_per_job": 1}})
    assert single["all/jagg/seed-0"].blocks == []


def test_an_evaluation_of_a_checkpoint_inside_a_block_waits_for_the_block(tmp_path):
    """A checkpoint a block writes before its last round is no rule's output: an evaluation
    naming it depends on the block's record."""
    data = copy.deepcopy(REDUCED)
    data["workflow"]["rounds_per_job"] = 2
    checkpoint = "results/all/jagg/seed-0/round-0000/checkpoint"
    data["workflow"]["evaluations"] = {
        "inside": {"policies": {"early": {"checkpoint": checkpoint}}, "prompts": {"heldout": {}}}
    }
    write_config(tmp_path, data)
    result = snakemake(tmp_path, "-n", "inside")
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout)
    assert counts["block"] == 1 and counts["evaluate"] == 1, counts
    assert "results/all/jagg/seed-0/round-0001/block.json" in result.stdout


# --------------------------------------------------------------------------------------------
# The workflow on the toy world
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blocks_run(reduced_all, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The reduced `all` in blocks of K = 2 (the whole run), finished: (workdir, its run)."""
    workdir = blocks_workdir(reduced_all, tmp_path_factory.mktemp("blocks"), 2)
    return workdir, snakemake(workdir, "--cores", "2", "all", timeout=1200)


@pytest.mark.slow
def test_the_toy_workflow_in_blocks_writes_what_single_rounds_write(reduced_all, blocks_run):
    """Every output of the reduced `all` (checkpoints, rollouts, scores, evaluations, the
    summary's table and curves) is the single-round run's, at K = 2 (the whole run)."""
    workdir, result = blocks_run
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rule block:" in result.stdout + result.stderr
    assert "rule train:" not in result.stdout + result.stderr
    ours = without_blocks(comparable_outputs(workdir))
    reference = without_blocks(comparable_outputs(reduced_all))
    assert ours.keys() == reference.keys()
    assert [name for name in ours if ours[name] != reference[name]] == []
    for variant in ("exact", "jagg"):
        run = f"results/all/{variant}/seed-0"
        assert round_lines(workdir / run, 2) == round_lines(reduced_all / run, 2)
    # Nothing to do once done.
    again = snakemake(workdir, "--cores", "2", "-n", "all")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_a_deleted_file_of_a_finished_block_reruns_the_block(blocks_run, tmp_path):
    finished, result = blocks_run
    assert result.returncode == 0, result.stderr[-4000:]
    workdir = tmp_path / "workdir"
    copy_run(finished, workdir)
    run = workdir / "results/all/jagg/seed-0"
    scores = run / "round-0000/scores"
    before = (scores / "scores.parquet").read_bytes()
    shutil.rmtree(scores)
    dry = snakemake(workdir, "--cores", "2", "-n", "all")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "rule block:" in dry.stdout
    result = snakemake(workdir, "--cores", "2", "all", timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (scores / "scores.parquet").read_bytes() == before


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _block_command(config_path: Path, workdir: Path, keep: list[int]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jagg_pipeline",
        "block",
        "--config",
        str(config_path),
        "--policy",
        "base",
        "--run-dir",
        str(workdir),
        "--rounds",
        "0",
        str(ROUNDS - 1),
        "--keep",
        *map(str, keep),
        "--conditioning",
        str(workdir / "conditioning"),
        "--checkpoint",
        str(workdir / f"round-{ROUNDS - 1:04d}/checkpoint"),
        "--record",
        str(workdir / "block.json"),
    ]


def _kill_when(command: list[str], marker: Path, log: Path) -> None:
    """Start ``command`` and SIGKILL it as soon as ``marker`` exists."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()


@pytest.mark.parametrize(
    ("keep", "marker", "resumed_at"),
    [
        ([], "round-0001/metrics/score.jsonl", 0),  # no checkpoint yet: from the input policy
        ([1], "round-0001/checkpoint/manifest.json", 2),  # from the kept round 1
    ],
)
def test_a_killed_block_reruns_to_the_bytes_of_an_uninterrupted_one(
    tmp_path, keep, marker, resumed_at
):
    from block_helpers import encode_pool

    config = _config(tmp_path, "flux", "full", "jagg-reuse")
    config_path = tmp_path / "config.yaml"
    reference = checkpoint_files(blocks(config, tmp_path / "reference", ROUNDS))
    workdir = tmp_path / "killed"
    encode_pool(config, workdir)
    command = _block_command(config_path, workdir, keep)
    _kill_when(command, workdir / marker, tmp_path / "killed.log")
    assert not (workdir / "block.json").exists()
    rerun = subprocess.run(command, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    record = json.loads((workdir / "block.json").read_text())
    assert record["resumed_at"] == resumed_at
    final = workdir / f"round-{ROUNDS - 1:04d}/checkpoint"
    assert checkpoint_files(final) == reference
    assert round_lines(workdir, ROUNDS) == round_lines(tmp_path / "reference", ROUNDS)
    # Nothing half-written: every kept folder is finished (its manifest written last).
    for r in keep:
        for stage in ("rollout", "checkpoint", "scores"):
            assert (workdir / f"round-{r:04d}" / stage / "manifest.json").is_file()


def test_a_block_refuses_a_corrupt_checkpoint_file_before_loading_a_model(tmp_path, monkeypatch):
    """The checkpoint a block continues from: its policy, optimizer or generator damaged is
    refused naming the file, before any model (building one is made to fail)."""
    from block_helpers import block_outputs, encode_pool

    from jagg_pipeline.io.manifest import ManifestError
    from jagg_pipeline.stages import policy as policy_module
    from jagg_pipeline.stages.block import run_block

    config = _config(tmp_path, "flux", "full", "jagg-reuse")
    workdir = tmp_path / "blocks"
    conditioning = encode_pool(config, workdir)
    options = {"prompts": config.sampler.prompts, "column": config.sampler.prompt_column}
    options.update(conditioning=conditioning, progress=False)
    first = block_outputs(workdir, 0, 0)
    run_block(config, "base", first, **options)
    checkpoint = first.rounds[0].checkpoint

    def build(*args, **kwargs):
        raise AssertionError("a model was loaded before the corrupt file was refused")

    monkeypatch.setattr(policy_module, "backbone_class", build)
    for name in (
        "policy/__0_0.distcp",
        "trainer/optimizer/__0_0.distcp",
        "trainer/rng.safetensors",
    ):
        damaged = checkpoint / name
        flip_byte(damaged)
        with pytest.raises(ManifestError, match=rf"^{damaged}: corrupt or changed"):
            run_block(config, str(checkpoint), block_outputs(workdir, 1, 1), **options)
        flip_byte(damaged)  # the same byte flipped back: the next file alone is damaged


# --------------------------------------------------------------------------------------------
# Long runs
# --------------------------------------------------------------------------------------------


def _long_run(workdir: Path, rounds_per_job: int) -> subprocess.CompletedProcess:
    """A dry run of 1000 rounds of one variant and seed, evaluated every 40 rounds."""
    data = copy.deepcopy(REDUCED)
    data["workflow"]["rounds_per_job"] = rounds_per_job
    data["workflow"]["keep_every"] = 50
    overrides = {"train": {"rounds": 1000}, "eval": {"every": 40}}
    data["workflow"]["experiments"] = {
        "all": {"seeds": [0], "overrides": overrides, "variants": {"jagg": {}}}
    }
    write_config(workdir, data)
    return snakemake(workdir, "-n", "--quiet", "rules", "all", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rounds_per_job", "rule", "jobs"), [(25, "block", 40), (1, "train", 1000)]
)
def test_a_thousand_round_run_builds_its_dag(tmp_path, rounds_per_job, rule, jobs):
    started = time.monotonic()
    result = _long_run(tmp_path, rounds_per_job)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = job_counts(result.stdout + result.stderr)
    assert counts.get(rule, 0) + counts.get(f"{rule}_transient", 0) == jobs, counts
    print(f"1000 rounds at K={rounds_per_job}: dry run {time.monotonic() - started:.1f} s")


# --------------------------------------------------------------------------------------------
# Two ranks
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_on_two_ranks_a_block_trains_the_weights_of_single_round_jobs(tmp_path):
    from block_helpers import encode_pool

    checkpoint = tiny_checkpoint("flux", tmp_path.parent)
    sections = {
        "train": {"rounds": 2, "nproc": 2},
        "sampler": {**SAMPLER, "prompts_per_round": 4},
        **VARIANTS["jagg-reuse"],
    }
    config_path, config = write_experiment(tmp_path / "config.yaml", "flux", checkpoint, **sections)
    common = ["--config", str(config_path)]
    single, block = tmp_path / "single", tmp_path / "block"
    for workdir in (single, block):
        encode_pool(config, workdir)
    policy = "base"
    for r in range(2):
        folder = single / f"round-{r:04d}"
        pool = ["--conditioning", str(single / "conditioning")]
        torchrun(
            "rollout",
            *common,
            "--policy",
            policy,
            "--round",
            str(r),
            *pool,
            "--out",
            str(folder / "rollout"),
        )
        score = [sys.executable, "-m", "jagg_pipeline", "score", *common]
        score += ["--rollouts", str(folder / "rollout"), "--out", str(folder / "scores")]
        assert subprocess.run(score, capture_output=True).returncode == 0
        torchrun(
            "train",
            *common,
            "--policy",
            policy,
            "--rollouts",
            str(folder / "rollout"),
            "--scores",
            str(folder / "scores"),
            "--out",
            str(folder / "checkpoint"),
        )
        policy = str(folder / "checkpoint")
    torchrun(
        "block",
        *common,
        "--policy",
        "base",
        "--run-dir",
        str(block),
        "--rounds",
        "0",
        "1",
        "--conditioning",
        str(block / "conditioning"),
        "--checkpoint",
        str(block / "round-0001/checkpoint"),
        "--record",
        str(block / "round-0001/block.json"),
    )
    assert checkpoint_files(block / "round-0001/checkpoint") == checkpoint_files(Path(policy))
    record = json.loads((block / "round-0001/block.json").read_text())
    assert record["world_size"] == 2
    for r in range(2):
        ours = (block / f"round-{r:04d}/metrics/train.jsonl").read_text().splitlines()
        theirs = (single / f"round-{r:04d}/checkpoint/metrics.jsonl").read_text().splitlines()
        untimed = [
            [
                {k: v for k, v in json.loads(line).items() if not k.startswith("time.")}
                for line in lines
            ]
            for lines in (ours, theirs)
        ]
        assert untimed[0] == untimed[1]
