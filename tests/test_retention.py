"""Retention (``workflow.keep_every``): a run keeps every K-th round's checkpoint and rollout,
its last round's and its evaluated rounds'; Snakemake deletes the others once no job needs
them, and the metrics of every round stay.

- which rounds are kept (:func:`jagg_pipeline.workflow.experiments.kept_rounds`), and the paths the
  workflow plans for kept and transient rounds;
- 8 rounds with K = 3 through the workflow train the weights of the in-process loop, which
  keeps every round, bit for bit; only the kept rounds' checkpoints and rollouts are left,
  every round's metric lines are (read by the summary), and a second `snakemake` of the
  finished target has nothing to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from stage_helpers import EVAL_PROMPTS, experiment, tiny_checkpoint, write_prompts
from workflow_helpers import snakemake, write_config

from jagg_pipeline.config.run import from_mapping
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.runs import kept_rounds

ROUNDS, KEEP_EVERY, EVAL_EVERY = 8, 3, 4
# (r + 1) % 3 == 0: rounds 2 and 5; evaluated after 4 and 8 rounds: the checkpoints of rounds
# 3 and 7 (7 is also the last). Rounds 0 and 1 are transient one after the other, 4 and 6
# each between kept rounds.
KEPT = [2, 3, 5, 7]
# The in-process loop in a fresh interpreter on one thread, as the workflow's jobs run.
LOOP = """
import sys
import torch
torch.set_num_threads(1)
from jagg_pipeline.config.run import load_config
from jagg_pipeline.stages.loop import run_rounds
run_rounds(load_config(sys.argv[1]), sys.argv[2], final_rollout=False)
"""


def _sections(tmp_path: Path) -> dict:
    """The tiny experiment: 8 rounds, evaluated every 4, on a tiny SD3 and the JPEG reward."""
    checkpoint = tiny_checkpoint("sd3", tmp_path)
    prompts = write_prompts(tmp_path / "eval_prompts.txt", EVAL_PROMPTS)
    return experiment(
        "sd3",
        checkpoint,
        prompts,
        train={"rounds": ROUNDS},
        eval={"every": EVAL_EVERY, "max_prompts": 1, "samples_per_prompt": 1, "num_steps": 2},
    )


def _workflow(sections: dict, keep_every: int | None) -> dict:
    return {
        **sections,
        "workflow": {
            "keep_every": keep_every,
            "experiments": {"all": {"seeds": [0], "variants": {"jagg": {}}}},
        },
    }


def test_kept_rounds_are_every_kth_the_last_and_the_evaluated():
    data = {"train": {"rounds": ROUNDS}, "eval": {"every": EVAL_EVERY}}
    config = from_mapping(data)
    assert kept_rounds(config, KEEP_EVERY) == KEPT
    assert kept_rounds(config, None) == list(range(ROUNDS))
    assert kept_rounds(config, 1) == list(range(ROUNDS))
    assert kept_rounds(config, 100) == [3, 7]  # evaluated only
    assert kept_rounds(from_mapping({"train": {"rounds": 5}, "eval": {"every": 10}}), 2) == [
        1,
        3,
        4,
    ]
    run = resolve_runs(_workflow(data, KEEP_EVERY))["all/jagg/seed-0"]
    assert run.kept_rounds == KEPT


def test_the_workflow_plans_transient_rounds_in_their_own_folder(tmp_path):
    run = "results/all/jagg/seed-0"
    data = _workflow({**_sections(tmp_path), "tracking": {"backend": "none"}}, KEEP_EVERY)
    # A checkpoint that an evaluation names is kept too.
    named = {"checkpoint": f"{run}/round-0001/checkpoint"}
    data["workflow"]["evaluations"] = {"check": {"policies": {"round1": named}}}
    write_config(tmp_path, data)
    plan = snakemake(tmp_path, "all", "--dry-run", "--quiet", "rules", timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    counts = dict(
        line.split() for line in plan.stdout.splitlines() if line.startswith(("rollout", "train"))
    )
    assert counts == {
        "rollout": "5",
        "rollout_transient": "3",
        "train": "5",
        "train_transient": "3",
    }
    shown = snakemake(tmp_path, "all", "--dry-run", "--printshellcmds", timeout=300).stdout
    assert f"--out {run}/round-0004/transient/checkpoint " in shown
    assert f"--policy {run}/round-0004/transient/checkpoint --round 0005" in shown
    assert f"--out {run}/round-0003/checkpoint " in shown  # evaluated after 4 rounds
    assert f"--out {run}/round-0001/checkpoint " in shown  # named by the evaluation
    assert f"Would remove temporary output {run}/round-0004/transient/rollout" in shown
    for kept in [1, *KEPT]:
        assert f"round-{kept:04d}/transient" not in shown, kept


def _weights(config, checkpoint: Path) -> dict[str, torch.Tensor]:
    from jagg_pipeline.stages.policy import load_policy

    return load_policy(config, checkpoint).transformer.state_dict()


def _without_times(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {k: v for k, v in line.items() if "time" not in k and "seconds" not in k} for line in lines
    ]


# 8 rounds of 3 jobs one after another: about 3 minutes on 2 free cores, twice that on a
# busy machine.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_keeping_every_third_round_trains_the_same_weights_and_reruns_nothing(tmp_path):
    from jagg_pipeline.reports.summary import read_run

    sections = {**_sections(tmp_path), "tracking": {"backend": "none"}}
    workdir = tmp_path / "workflow"
    write_config(workdir, _workflow(sections, KEEP_EVERY))
    # The reference keeps every round: the in-process loop, on the core the workflow's
    # sequential rounds leave free.
    (tmp_path / "loop.yaml").write_text(yaml.safe_dump(sections))
    loop = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(tmp_path / "loop.yaml"), str(tmp_path / "loop")],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    done = snakemake(workdir, "--cores", "2", "all", timeout=1500)
    _, loop_err = loop.communicate(timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert loop.returncode == 0, loop_err[-3000:]

    run = workdir / "results/all/jagg/seed-0"
    config = from_mapping(sections)
    for r in range(ROUNDS):
        folder = run / f"round-{r:04d}"
        kept = r in KEPT
        assert (folder / "checkpoint").is_dir() == kept, folder
        assert (folder / "rollout").is_dir() == kept, folder
        assert not (folder / "transient").exists(), folder
        assert (folder / "scores").is_dir()
        # Every round's metric lines stay, and equal the loop's (which keeps every round).
        for stage in ("rollout", "score", "train"):
            record = folder / "metrics" / f"{stage}.jsonl"
            assert _without_times(record) == _without_times(
                tmp_path / "loop" / folder.name / "metrics" / f"{stage}.jsonl"
            ), record
    for r in KEPT:
        name = f"round-{r:04d}/checkpoint"
        ours, reference = _weights(config, run / name), _weights(config, tmp_path / "loop" / name)
        assert ours.keys() == reference.keys()
        assert all(torch.equal(ours[k], reference[k]) for k in ours), name
    assert sorted(p.name for p in (run / "eval").iterdir()) == [
        "trained-0000",
        "trained-0004",
        "trained-0008",
    ]
    metrics = read_run(run, "jagg", 0)
    for stage in ("rollout", "score", "train"):
        assert {line["round"] for line in metrics.stage(stage)} == set(range(ROUNDS)), stage
    summary = [json.loads(x) for x in (workdir / "results/all/summary/metrics.jsonl").open()]
    assert {x["round"] for x in summary if x["stage"] == "train"} == set(range(ROUNDS))

    # The finished target again: the deleted rounds are not made again.
    again = snakemake(workdir, "--cores", "2", "all", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to be done" in again.stdout + again.stderr, again.stderr[-3000:]
    assert not any(run.glob("round-*/transient"))
