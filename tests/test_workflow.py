"""The Snakemake workflow: targets parse, a reduced `all` runs end to end and reruns exactly
what an edit touches, a killed run resumes to the same bytes, bad configs stop before any job.

The reduced config mirrors config.yaml's `all` (two of its variants, a tiny toy world, two
rounds) and runs in a temporary directory with the repository's Snakefile.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from train_helpers import assert_same_checkpoint
from workflow_helpers import REDUCED, ROOT, SNAKEMAKE, copy_run, job_counts, snakemake, write_config

from jagg_pipeline.io.manifest import stage_digest
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.sections import workflow_schema

TARGETS = (
    "all",
    "compare_modes",
    "compare_anchors",
    "ablation_no_interp",
    "sweep_jagg_frac",
    "sweep_window",
    "sweep_backbone",
    "comparison",
    "bench",
)


def test_committed_schema_is_the_packages():
    committed = json.loads((ROOT / "workflow/schemas/config.schema.json").read_text())
    assert committed == workflow_schema(), (
        "regenerate: python -m jagg_pipeline config schema --workflow "
        "--out workflow/schemas/config.schema.json"
    )


def test_config_yaml_sets_every_key_with_a_comment():
    """config.yaml spells out every key of the base sections, each with a comment above it."""
    from jagg_pipeline.config.fields import to_dict
    from jagg_pipeline.config.run import RunConfig

    text = (ROOT / "config.yaml").read_text()
    data = yaml.safe_load(text)
    base = {k: v for k, v in data.items() if k != "workflow"}

    def keys(tree: dict, prefix: str = "") -> set[str]:
        found = set()
        for key, value in tree.items():
            found.add(prefix + key)
            if isinstance(value, dict) and not key.endswith("weights"):
                found |= keys(value, f"{prefix}{key}.")
        return found

    assert keys(base) == keys(to_dict(RunConfig()))
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("workflow:"))
    for i, line in enumerate(lines[:start]):
        if line.strip() and not line.lstrip().startswith("#"):
            assert lines[i - 1].lstrip().startswith("#"), f"config.yaml:{i + 1} {line!r}"
    assert set(resolve_runs(data)) >= {"all/exact/seed-0", "compare_modes/no_interp/seed-2"}


def test_every_named_target_dry_runs(tmp_path):
    shutil.copy(ROOT / "config.yaml", tmp_path / "config.yaml")
    for target in TARGETS:
        result = snakemake(tmp_path, target, "--dry-run", "--quiet", "rules", timeout=120)
        assert result.returncode == 0, (target, result.stderr[-2000:])
    sweep = snakemake(tmp_path, "--dry-run", "sweep_jagg_frac", timeout=120).stdout
    for value in ("0.0", "0.5", "1.0"):
        assert f"results/sweep_jagg_frac/jagg_frac-{value}/seed-0/round-0009/checkpoint" in sweep


def test_an_experiment_target_ends_with_its_comparison_page(tmp_path):
    """`snakemake NAME` of the user's own experiment makes results/comparison/NAME/."""
    data = copy.deepcopy(REDUCED)
    data["workflow"]["experiments"] = {"mine": data["workflow"]["experiments"].pop("all")}
    data["workflow"]["comparison"] = ["mine"]
    write_config(tmp_path, data)
    plan = snakemake(tmp_path, "mine", "--dry-run", timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "results/comparison/mine/index.html" in plan.stdout
    assert {"track": 1, "compare": 1}.items() <= job_counts(plan.stdout).items()


def test_without_an_all_experiment_the_default_target_is_the_first_experiment(tmp_path):
    """Plain `snakemake` runs the config's first experiment, never the benchmark."""
    data = copy.deepcopy(REDUCED)
    experiment = data["workflow"]["experiments"].pop("all")
    data["workflow"]["experiments"] = {"mine": experiment, "other": copy.deepcopy(experiment)}
    data["workflow"]["comparison"] = ["mine"]
    write_config(tmp_path, data)
    plan = snakemake(tmp_path, "--dry-run", timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    counts = job_counts(plan.stdout)
    assert counts.get("mine") == 1 and "bench" not in counts and "other" not in counts, counts


STAGES = ("rollout", "score", "train", "evaluate")


def _changed_stages(edit: dict, base: dict | None = None, round_index: int = 0) -> set[str]:
    """The stages of REDUCED's jagg run whose rerun digest an edit of its config changes
    (of its base sections; ``train.rounds`` is the experiment's override)."""

    def config(sections: dict):
        data = copy.deepcopy({**REDUCED, **sections})
        rounds = data.get("train", {}).pop("rounds", 2)
        data["workflow"]["experiments"]["all"]["overrides"]["train"]["rounds"] = rounds
        return resolve_runs(data)["all/jagg/seed-0"].config

    before, after = config(base or {}), config({**(base or {}), **edit})
    return {
        stage
        for stage in STAGES
        if stage_digest(before, stage, round_index) != stage_digest(after, stage, round_index)
    }


def test_stage_digests_cover_exactly_what_each_stage_reads():
    eval_steps = {"eval": {**REDUCED["eval"], "num_steps": 8}}
    # jagg_frac decides which windows are approximated, hence which velocities a rollout stores.
    assert _changed_stages({"jagg": {"jagg_frac": 0.5}, **eval_steps}) == {
        "rollout",
        "train",
        "evaluate",
    }
    # The objective's settings reach training only.
    assert _changed_stages({"grpo": {"clip_range": 1e-3}}) == {"train"}
    # A reward model that neither rewards.weights nor eval.metrics names is read by nobody...
    unused = {"pickscore": {"model": "elsewhere/pickscore"}, "clipscore": {"batch_size": 3}}
    assert _changed_stages({"rewards": {"weights": {"toy_attributes": 1.0}, **unused}}) == set()
    # ... one that eval.metrics names by evaluation only, one that rewards.weights names by the
    # score and train stages.
    metric = {"eval": {**REDUCED["eval"], "metrics": ["toy_attributes", "clipscore"]}}
    assert _changed_stages({"rewards": unused}, base=metric) == {"evaluate"}
    weighted = {"rewards": {"weights": {"toy_attributes": 1.0, "clipscore": 0.5}}}
    assert _changed_stages({"rewards": {**weighted["rewards"], **unused}}, weighted) == {
        "score",
        "train",
    }
    # Where and how often nothing changes what a job computes.
    two_batches = {"sampler": {**REDUCED["sampler"], "batch_size": 4}}
    assert _changed_stages({"train": {"nproc": 2}}, two_batches) == set()
    assert _changed_stages({"eval": {**REDUCED["eval"], "every": 1}}) == set()


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_rounds_training_digest_reads_its_own_learning_rates(schedule):
    """More rounds leave a round's training digest alone unless they move its learning rates
    (a decaying schedule spreads over all rounds: every round's rates move)."""
    base = {
        "sampler": {**REDUCED["sampler"], "batch_size": 4},
        "train": {"rounds": 2, "lr_schedule": schedule, "minibatches": 2},
    }
    longer = {"train": {**base["train"], "rounds": 3}}
    moved = {r for r in (0, 1) if "train" in _changed_stages(longer, base, round_index=r)}
    assert moved == (set() if schedule == "constant" else {0, 1})
    assert _changed_stages(longer, base, round_index=1) <= {"train"}
    assert "train" in _changed_stages({"train": {**base["train"], "lr": 1e-3}}, base)


def _commands(plan: str, stage: str) -> list[str]:
    # Stages over the training ranks start through the launch command.
    starts = (f" -m jagg_pipeline {stage} ", f" -m jagg_pipeline launch {stage} ")
    return [line for line in plan.splitlines() if any(start in line for start in starts)]


def _conditioning_of(command: str) -> str | None:
    words = command.split()
    return words[words.index("--conditioning") + 1] if "--conditioning" in words else None


def test_a_pool_is_named_by_its_prompts_and_the_text_keys_only():
    from jagg_pipeline.config.fields import ConfigError
    from jagg_pipeline.config.run import RunConfig
    from jagg_pipeline.workflow.names import check_target_name
    from jagg_pipeline.workflow.pools import pool_key

    config = RunConfig()
    key = pool_key(config, "toy:train", None)
    assert len(key) == 12 and key == pool_key(RunConfig(), "toy:train", None)
    assert key != pool_key(config, "toy:heldout", None) != pool_key(config, "toy:train", "x")
    backbone = config.backbone
    for unread in ({"device": "cuda"}, {"training": "lora"}, {"mixed_precision": "bf16"}):
        other = dataclasses.replace(config, backbone=dataclasses.replace(backbone, **unread))
        assert pool_key(other, "toy:train", None) == key, unread
    for read in ({"negative_prompt": "dark"}, {"cfg_scale": 2.0}, {"revision": "main"}):
        other = dataclasses.replace(config, backbone=dataclasses.replace(backbone, **read))
        assert pool_key(other, "toy:train", None) != key, read
    with pytest.raises(ConfigError, match="conditioning"):
        check_target_name("experiments", "conditioning")  # the pools' folder


def test_each_prompt_pool_is_encoded_once_for_every_run_and_round_that_share_it(tmp_path):
    data = json.loads(json.dumps(REDUCED))
    # The token cap is a text key: this variant's pools are its own.
    data["workflow"]["experiments"]["all"]["variants"]["short"] = {
        "jagg": {"mode": "jagg"},
        "backbone": {"max_sequence_length": 8},
    }
    write_config(tmp_path, data)
    plan = snakemake(tmp_path, "all", "--dry-run", "--printshellcmds", timeout=120).stdout
    encodes = _commands(plan, "encode")
    folders = [command.split("--out ")[1].split()[0] for command in encodes]
    assert len(folders) == len(set(folders)) == 4, encodes  # (train, heldout) x (16, 8 tokens)
    assert all(f.startswith("results/conditioning/") for f in folders)
    assert sum("--prompts toy:train" in c for c in encodes) == 2
    assert sum("backbone.max_sequence_length=8" in c for c in encodes) == 2
    rollouts, evaluations = _commands(plan, "rollout"), _commands(plan, "evaluate")
    assert len(rollouts) == 3 * 2 and len(evaluations) == 3 * 2  # 2 rounds, 2 evaluations
    pools: dict[tuple[str, bool], set[str | None]] = {}
    for stage, commands in (("rollout", rollouts), ("evaluate", evaluations)):
        for command in commands:
            pools.setdefault((stage, "/short/" in command), set()).add(_conditioning_of(command))
    # One pool per stage for exact and jagg (every round), another one for short.
    assert all(len(found) == 1 for found in pools.values()), pools
    assert {next(iter(found)) for found in pools.values()} == set(folders)

    data["workflow"]["encode_prompts"] = False
    write_config(tmp_path, data)
    plan = snakemake(tmp_path, "all", "--dry-run", "--printshellcmds", timeout=120).stdout
    assert not _commands(plan, "encode") and _commands(plan, "rollout")
    assert "--conditioning" not in plan and "results/conditioning" not in plan


def test_train_rule_leaves_the_world_size_to_the_launch_command(tmp_path):
    """Every train job starts through `launch`, which reads train.nproc at run time: the
    plan spells no world size, so changing it changes no job (tests/test_world_size.py)."""
    data = json.loads(json.dumps(REDUCED))
    variant = data["workflow"]["experiments"]["all"]["variants"]["jagg"]
    # Two ranks need two rollout micro-batches (a config check): batches of one group.
    variant |= {"train": {"nproc": 2}, "sampler": {"batch_size": 4}}
    write_config(tmp_path, data)
    plan = snakemake(tmp_path, "all", "--dry-run", "--printshellcmds", timeout=120).stdout
    trains = [line for line in plan.splitlines() if " -m jagg_pipeline launch train" in line]
    assert len(trains) == 4
    assert {"/jagg/" in t for t in trains} == {True, False}
    assert all(f"{sys.executable} -m jagg_pipeline launch train --config " in t for t in trains)
    assert not [t for t in trains if "nproc" in t or "torch.distributed" in t]


BAD_CONFIGS = {
    "sampler.group_size": {"sampler": {"group_size": "eight"}},
    "sampler.nope": {"sampler": {"nope": 1}},
    "workflow.experiments.all.sweep": {
        "workflow": {"experiments": {"all": {"sweep": {"values": [1]}}}}
    },
    "jagg.jagg_frac": {
        "workflow": {"experiments": {"all": {"variants": {"x": {"jagg": {"jagg_frac": 1.5}}}}}}
    },
    "jagg.window": {"jagg": {"window": 1}},
    "sweep.values": {
        "workflow": {"experiments": {"all": {"sweep": {"key": "jagg.window", "values": []}}}}
    },
    "jagg.typo": {"workflow": {"experiments": {"all": {"variants": {"x": {"jagg": {"typo": 1}}}}}}},
}


@pytest.mark.parametrize("key", BAD_CONFIGS)
def test_bad_configs_stop_before_any_job_naming_the_key(tmp_path, key):
    write_config(tmp_path, BAD_CONFIGS[key])
    result = snakemake(tmp_path, "--cores", "1", "all", timeout=120)
    assert result.returncode != 0
    leaf = key.rsplit(".", 1)[-1]
    assert leaf in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "results").exists()  # nothing ran, nothing was written


def test_a_key_given_twice_in_config_yaml_stops_the_workflow(tmp_path):
    """Snakemake's own YAML reader keeps the last of two equal keys; the workflow refuses."""
    config = write_config(tmp_path, REDUCED)
    config.write_text(config.read_text() + "sampler: {group_size: 2}\n")
    result = snakemake(tmp_path, "--cores", "1", "all", "--dry-run", timeout=120)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "duplicate key 'sampler'" in said and "config.yaml" in said, said[-2000:]


def _mtimes(folder: Path) -> dict[str, float]:
    return {p.as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_reduced_all_runs_reruns_only_what_an_edit_touches_and_resumes_after_a_kill(
    tmp_path, reduced_all
):
    copy_run(reduced_all, tmp_path)
    results = tmp_path / "results" / "all"
    for variant in ("exact", "jagg"):
        run = results / variant / "seed-0"
        assert (run / "config.yaml").is_file()
        for n in ("0000", "0002"):
            assert (run / f"eval/trained-{n}/metrics.json").is_file()
        assert (run / "round-0001/checkpoint/manifest.json").is_file()
    table = (results / "summary/table.md").read_text()
    assert "| exact | 1 |" in table and "| jagg | 1 |" in table
    assert (results / "summary/curves.png").stat().st_size > 0
    reference = tmp_path / "reference"
    shutil.copytree(results / "exact/seed-0/round-0001/checkpoint", reference)

    # A second run has nothing to do.
    again = snakemake(tmp_path, "--cores", "2", "all")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr

    # Kill snakemake and its jobs while the last training round of `exact` runs, then resume.
    # (Snakemake regenerates a missing intermediate only for a target that is out of date.)
    shutil.rmtree(results / "exact/seed-0/round-0001")
    for downstream in ("summary", "tracking"):
        shutil.rmtree(results / downstream)
    log = tmp_path / "results/logs/all/exact/seed-0/round-0001/train.log"
    log.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [*SNAKEMAKE, "--directory", str(tmp_path), "--cores", "2", "all"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + 300
    while not log.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert log.is_file(), "the training job never started"
    time.sleep(3)  # into the job: importing, loading, or training
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert snakemake(tmp_path, "--unlock").returncode == 0
    resumed = snakemake(tmp_path, "--cores", "2", "--rerun-incomplete", "all")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_checkpoint(results / "exact/seed-0/round-0001/checkpoint", reference)

    # Editing one variant's jagg_frac reruns that variant's rollouts (the velocities they store
    # depend on it) and training, and what follows them.
    before = {v: _mtimes(results / v / "seed-0") for v in ("exact", "jagg")}
    edited = json.loads(json.dumps(REDUCED))
    edited["workflow"]["experiments"]["all"]["variants"]["jagg"]["jagg"]["jagg_frac"] = 0.5
    write_config(tmp_path, edited)
    rerun = snakemake(tmp_path, "--cores", "2", "all")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _mtimes(results / "exact/seed-0") == before["exact"]
    after = _mtimes(results / "jagg/seed-0")
    changed = {
        Path(p).relative_to(results / "jagg/seed-0").parts[0:2]
        for p in after
        if after[p] != before["jagg"].get(p)
    }
    assert {("round-0000", "checkpoint"), ("round-0000", "rollout")} <= changed
    assert ("eval", "trained-0000") not in changed  # the base policy is the same
