"""The workflow's logic as pure functions, without Snakemake: layout, retention, resources,
pools and the rule names that targets may not take.

The rules reach these through thin adapters in workflow/rules/common.smk; the workflow tests
(test_workflow, test_retention, test_block, test_devices, test_multinode) show the adapters
wire them as planned.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest

from jagg_pipeline.config.fields import ConfigError, from_dict
from jagg_pipeline.config.run import RunConfig
from jagg_pipeline.workflow import layout, resources
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.names import check_target_name, workflow_rules
from jagg_pipeline.workflow.pools import shared_pools
from jagg_pipeline.workflow.retention import Retention
from jagg_pipeline.workflow.runs import Run


def _run(rounds: int = 4, keep_every: int | None = None, rounds_per_job: int = 1, **sections):
    data = {"train": {"rounds": rounds}, "eval": {"every": 100}, **sections}
    config = from_dict(RunConfig, data)
    return Run("all", "jagg", 0, config, {}, "results/all/jagg/seed-0", None, keep_every,
               rounds_per_job)  # fmt: skip


def test_a_pattern_of_the_layout_formats_to_the_path_it_stands_for():
    run = layout.run_directory("out", "{experiment}", "{variant}", "{seed}")
    concrete = layout.run_directory("out", "all", "jagg", 3)
    assert concrete == "out/all/jagg/seed-3"
    assert run.format(experiment="all", variant="jagg", seed=3) == concrete
    assert layout.round_pattern(run).format(
        experiment="all", variant="jagg", seed=3, round="0007"
    ) == layout.round_folder(concrete, 7)
    assert layout.round_folder(concrete, 7) == "out/all/jagg/seed-3/round-0007"
    assert layout.stage_folder(concrete, 7, "rollout", kept=False) == (
        "out/all/jagg/seed-3/round-0007/transient/rollout"
    )
    assert layout.evaluation_folder(concrete, 2) == "out/all/jagg/seed-3/eval/trained-0002"
    assert layout.block_record(concrete, 5, kept=False).endswith("round-0005/block-transient.json")


def test_kept_rounds_keep_their_stage_folders_and_the_others_go_to_transient():
    run = _run(rounds=4, keep_every=2)
    retention = Retention(finished=lambda folder: False)
    assert [retention.kept(run, r) for r in range(4)] == [False, True, False, True]
    assert retention.checkpoint_dir(run, 0) == f"{run.directory}/round-0000/transient/checkpoint"
    assert retention.rollout_dir(run, 1) == f"{run.directory}/round-0001/rollout"
    assert retention.policy(run, 0) == "base"
    assert retention.policy(run, 2) == retention.checkpoint_dir(run, 1)

    files = retention.run_files(run)
    assert f"{run.directory}/round-0000/scores" in files
    assert f"{run.directory}/round-0000/metrics/score.jsonl" in files
    assert f"{run.directory}/round-0000/metrics/train.jsonl" not in files
    assert f"{run.directory}/round-0001/checkpoint" in files
    assert not any(layout.TRANSIENT in path for path in files)


def test_a_named_or_finished_checkpoint_keeps_its_round():
    run = _run(rounds=4, keep_every=4)
    named = f"{run.directory}/round-0000/checkpoint"
    finished = f"{run.directory}/round-0001/checkpoint"
    retention = Retention(frozenset({named}), finished=lambda folder: folder == finished)
    assert [retention.kept(run, r) for r in range(4)] == [True, True, False, True]

    evaluation = Run("ev", "base_heldout", 0, run.config, {}, "results/ev/x/seed-0", named)
    assert Retention.of([run, evaluation]).evaluated == {named}


def _finished_run(tmp_path: Path, rounds: int = 3) -> Run:
    run = _run(rounds=rounds, keep_every=rounds)
    run = Run(**{**run.__dict__, "directory": str(tmp_path / "run")})
    for r in range(rounds):
        for stage in ("rollout", "score", "train"):
            path = Path(layout.round_record(layout.round_folder(run.directory, r), stage))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}\n")
    return run


def test_a_lost_metric_line_of_a_transient_round_forces_that_rounds_stage_folder(tmp_path):
    run = _finished_run(tmp_path)
    retention = Retention(finished=lambda folder: False)
    assert retention.lost_records(run) == []
    records = Path(run.directory, "round-0001", "metrics")
    (records / "train.jsonl").unlink()
    (records / "rollout.jsonl").unlink()
    assert retention.lost_records(run) == [
        retention.rollout_dir(run, 1),
        retention.checkpoint_dir(run, 1),
    ]
    # A kept round's lines are asked for by name instead; a run still going writes its own.
    (Path(run.directory, "round-0002", "metrics") / "train.jsonl").unlink()
    assert retention.lost_records(run) == []


def test_a_finished_block_with_a_lost_file_is_forced_by_its_record(tmp_path):
    run = _finished_run(tmp_path, rounds=4)
    run = Run(**{**run.__dict__, "rounds_per_job": 2})
    retention = Retention(finished=lambda folder: False)
    for block in run.blocks:
        for path in retention.block_files(run, block):
            target = Path(path)
            if target.suffix == ".jsonl":
                continue
            target.mkdir(parents=True, exist_ok=True)
        Path(retention.block_record(run, block)).write_text("{}")
    assert retention.lost_blocks(run) == []
    Path(run.directory, "round-0002", "scores").rmdir()
    assert retention.lost_blocks(run) == [retention.block_record(run, run.blocks[1])]


class _Listing:
    def __init__(self, stdout: str = "", returncode: int = 0, error: Exception | None = None):
        self.result = subprocess.CompletedProcess([], returncode, stdout, "")
        self.error = error

    def __call__(self) -> subprocess.CompletedProcess:
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize(
    ("environ", "listing", "expected"),
    [
        ({"JAGG_GPUS": " 3 "}, _Listing("GPU 0: x"), (3, "JAGG_GPUS")),
        ({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}, _Listing(), (2, "CUDA_VISIBLE_DEVICES")),
        ({"CUDA_VISIBLE_DEVICES": ""}, _Listing(), (0, "CUDA_VISIBLE_DEVICES")),
        ({}, _Listing("GPU 0: A\nGPU 1: B\n  MIG 1g\n"), (2, "nvidia-smi -L")),
        ({}, _Listing(returncode=9), (0, "nvidia-smi -L failed")),
        ({}, _Listing(error=FileNotFoundError("nvidia-smi")), (0, "no nvidia-smi")),
        ({}, _Listing(error=subprocess.TimeoutExpired("nvidia-smi", 60)), (0, "no nvidia-smi")),
    ],
)
def test_the_machines_gpus_are_counted_from_the_first_source_that_says(environ, listing, expected):
    assert resources.machine_gpus(environ, listing) == expected


def test_a_gpu_count_that_is_no_number_and_a_request_over_the_machines_are_refused():
    with pytest.raises(ValueError, match=r"JAGG_GPUS='two'.*JAGG_GPUS=1"):
        resources.machine_gpus({"JAGG_GPUS": "two"})
    assert resources.checked_gpus("job", 2, "why", (2, "JAGG_GPUS")) == 2
    assert resources.checked_gpus("job", 8, "why", None) == 8
    with pytest.raises(ValueError, match=r"job needs 3 GPU\(s\) \(why\).*offers 2 \(JAGG_GPUS\)"):
        resources.checked_gpus("job", 3, "why", (2, "JAGG_GPUS"))


def test_jobs_ask_for_a_gpu_per_rank_on_cuda_and_one_for_cuda_reward_models():
    cpu = from_dict(RunConfig, {"train": {"nproc": 2}})
    cuda = from_dict(RunConfig, {"train": {"nproc": 2}, "backbone": {"device": "cuda"}})
    rewards_on_cuda = from_dict(RunConfig, {"rewards": {"device": "cuda:1"}})
    assert resources.ranks_gpus(cpu)[0] == 0 and resources.ranks_gpus(cuda)[0] == 2
    assert resources.score_gpus(cpu)[0] == 0 and resources.score_gpus(cuda)[0] == 1
    assert resources.evaluate_gpus(cuda)[0] == 2 and resources.evaluate_gpus(cpu)[0] == 0
    assert resources.evaluate_gpus(rewards_on_cuda)[0] == 1
    nodes = from_dict(RunConfig, {"train": {"nodes": 2}, "backbone": {"device": "cuda"}})
    assert resources.ranks_gpus(nodes) is None and resources.evaluate_gpus(nodes) is None


def test_a_multi_node_job_asks_slurm_for_a_task_and_the_gpus_of_each_node():
    one = from_dict(RunConfig, {})
    assert resources.ranks_slurm("r", one, runs_here=True, in_apptainer=True)["nodes"] == 1
    config = from_dict(
        RunConfig, {"train": {"nodes": 2, "nproc": 2}, "backbone": {"device": "cuda"}}
    )
    assert resources.ranks_slurm("r", config, runs_here=False, in_apptainer=False) == {
        "nodes": 2,
        "tasks": 2,
        "mpi": "srun",
        "gres": "gpu:2",
        "tasks_per_gpu": 0,
    }
    with pytest.raises(ValueError, match=r"r: train.nodes 2 needs a SLURM cluster"):
        resources.ranks_slurm("r", config, runs_here=True, in_apptainer=False)
    with pytest.raises(ValueError, match=r"r: train.nodes 2 starts its agents with srun"):
        resources.ranks_slurm("r", config, runs_here=False, in_apptainer=True)


def test_runs_that_read_the_same_prompts_share_one_pool():
    data = {
        "workflow": {
            "experiments": {
                "all": {"variants": {"a": {}, "b": {"jagg": {"mode": "exact"}}}, "seeds": [0, 1]}
            }
        }
    }
    runs = resolve_runs(data)
    by_run, pools = shared_pools(runs.values())
    assert len(by_run) == 4 and len(pools) == 2  # the train split and the heldout split
    assert len({keys["rollout"] for keys in by_run.values()}) == 1
    pool = pools[by_run["all/a/seed-0"]["rollout"]]
    assert pool.inputs("results/toyworld") == {"toy_backbone": "results/toyworld/sd3"}
    settings = pool.settings()
    assert settings[::2] == ["--set"] * (len(settings) // 2)
    assert settings[-1] == 'backbone.device="cpu"'

    other = copy.deepcopy(data)
    other["sampler"] = {"prompts": "prompts.txt"}
    pool = next(p for p in shared_pools(resolve_runs(other).values())[1].values()
                if p.source == "prompts.txt")  # fmt: skip
    assert pool.inputs("results/toyworld")["prompts"] == "prompts.txt"


def test_the_workflows_rule_names_are_read_from_its_rule_files(tmp_path):
    (tmp_path / "workflow/rules").mkdir(parents=True)
    (tmp_path / "Snakefile").write_text(
        "rule first:\n    input: 'x'\n\n    rule:\n        name: t\n"
    )
    (tmp_path / "workflow/rules/a.smk").write_text(
        "rule second:\n    output: 'y'\n\nuse rule second as second_twin with:\n    output: 'z'\n"
        "ruleorder: second > second_twin\n"
    )
    assert workflow_rules(tmp_path) == ("first", "second", "second_twin")
    assert workflow_rules(tmp_path / "elsewhere") == ()
    assert {"train", "train_transient", "block", "evaluate"} <= set(workflow_rules())
    with pytest.raises(ConfigError, match=r"workflow\.experiments\.train: .train. is a rule"):
        check_target_name("experiments", "train")
