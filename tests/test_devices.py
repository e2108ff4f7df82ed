"""Every model-running stage runs on the configured device, and asks for the GPUs it uses.

- the reward models follow ``rewards.device``, else ``backbone.device``: in the score stage (the
  CLI's default, an explicit ``--device`` overriding it) and in evaluate's metrics;
- the workflow's rollout, score, train and evaluate jobs pass their device on the command line,
  ask for a GPU exactly when it is CUDA (train: one per process) and for a core per thread;
- a local run shares out the machine's GPUs and refuses a job that needs more, where Snakemake
  alone would quietly shrink the request.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from workflow_helpers import REDUCED, ROOT, snakemake, write_config

from jagg_pipeline.cli import main
from jagg_pipeline.config.run import from_mapping
from jagg_pipeline.stages import evaluate as evaluate_module
from jagg_pipeline.stages import scoring

MODEL_RULES = ("rollout", "score", "train", "evaluate")
SLURM_PROFILE = str(ROOT / "workflow/profiles/slurm")
LOCAL_PROFILE = str(ROOT / "workflow/profiles/local")


@pytest.mark.parametrize(("rewards", "expected"), [({}, "cuda:1"), ({"device": "cpu"}, "cpu")])
def test_reward_device_defaults_to_the_backbones(rewards, expected):
    config = from_mapping({"backbone": {"device": "cuda:1"}, "rewards": rewards})
    assert config.rewards.resolve_device(config.backbone.device) == expected


class Loaded(Exception):
    """Raised by the stand-in reward loader: the test has seen what it needed."""


def test_score_loads_the_reward_models_on_the_configured_device(tmp_path, monkeypatch):
    loaded = []

    def from_spec(spec, device, **options):
        loaded.append(device)
        raise Loaded

    monkeypatch.setattr(scoring, "check_input", lambda *args, **kwargs: {})
    monkeypatch.setattr(scoring, "RolloutReader", lambda folder: None)
    monkeypatch.setattr(scoring.MultiReward, "from_spec", from_spec)
    config = tmp_path / "config.yaml"
    config.write_text("backbone: {device: 'cuda:1'}\n")
    score = ["score", "--config", str(config), "--rollouts", str(tmp_path)]
    out = ["--out", str(tmp_path / "scores")]
    for extra in ([], ["--set", "rewards.device=cpu"], ["--device", "cuda:3"]):
        with pytest.raises(Loaded):
            main([*score, *extra, *out])
    # The backbone's device by default, the rewards section's, an explicit flag over both.
    assert loaded == ["cuda:1", "cpu", "cuda:3"]


def test_evaluate_scores_its_metrics_on_the_reward_device(monkeypatch):
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    batch = SimpleNamespace(images=images, sample_ids=torch.arange(2), seeds=torch.arange(2))
    monkeypatch.setattr(evaluate_module, "sample_batches", lambda *args, **kwargs: batch)
    loaded = []

    def load_reward(name, spec, device):
        loaded.append(str(device))
        return lambda floats, prompts: torch.zeros(len(prompts))

    monkeypatch.setattr(evaluate_module, "load_reward", load_reward)
    backbone = SimpleNamespace(device=torch.device("cpu"))
    for rewards in ({}, {"device": "cuda:2"}):
        config = from_mapping(
            {
                "eval": {"max_prompts": 2, "samples_per_prompt": 1, "metrics": ["toy_attributes"]},
                "rewards": {"weights": {"toy_attributes": 1.0}, **rewards},
            }
        )
        evaluate_module.evaluate(config, backbone, progress=False)
    # The policy's own device by default (cuda:LOCAL_RANK under torchrun), else rewards.device.
    assert loaded == ["cpu", "cuda:2"]


def cuda_config(tmp_path):
    """The reduced `all` on CUDA: variant jagg trains on two processes, exact scores on the CPU."""
    data = json.loads(json.dumps(REDUCED))
    data["backbone"] = {"device": "cuda"}
    variants = data["workflow"]["experiments"]["all"]["variants"]
    # Two ranks need two rollout micro-batches (a config check): batches of one group.
    variants["jagg"] |= {"train": {"nproc": 2}, "sampler": {"batch_size": 4}}
    variants["exact"] |= {"rewards": {"device": "cpu"}}
    write_config(tmp_path, data)


def planned_jobs(output: str) -> list[dict]:
    """The jobs of a dry run's output: rule, wildcards, threads, resources, shell command
    (the jobs of a group job are indented)."""
    jobs = []
    for line in map(str.strip, output.splitlines()):
        if match := re.match(r"(?:local)?rule (\w+):$", line):
            jobs.append({"rule": match[1], "threads": 1, "resources": {}, "wildcards": {}})
        elif jobs and (match := re.match(r"(wildcards|resources): (.*)$", line)):
            pairs = (item.split("=", 1) for item in match[2].split(", "))
            jobs[-1][match[1]] = dict(pairs)
        elif jobs and (match := re.match(r"threads: (\d+)$", line)):
            jobs[-1]["threads"] = int(match[1])
        elif jobs and line.startswith("Shell command: "):
            jobs[-1]["shell"] = line
    return [job for job in jobs if job["rule"] in MODEL_RULES]


def dry_run(workdir, *args, env=None) -> list[dict]:
    result = snakemake(workdir, "all", "--dry-run", "--printshellcmds", *args, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    jobs = planned_jobs(result.stdout)
    assert {job["rule"] for job in jobs} == set(MODEL_RULES)
    return jobs


def test_every_model_running_job_passes_its_device(tmp_path):
    cuda_config(tmp_path)
    for job in dry_run(tmp_path, env={"JAGG_GPUS": "2"}):
        variant = job["wildcards"]["variant"]
        if job["rule"] == "score":
            device = "cpu" if variant == "exact" else "cuda"
            assert f" --device {device} " in job["shell"], job
        else:
            assert " --set backbone.device=cuda " in job["shell"], job


def test_on_slurm_every_cuda_job_asks_for_its_gpus_and_a_core_per_thread(tmp_path):
    cuda_config(tmp_path)
    # A dry run caps threads at --cores (1 unless given); a cluster run does not.
    for job in dry_run(tmp_path, "--profile", SLURM_PROFILE, "--cores", "4"):
        resources, variant = job["resources"], job["wildcards"]["variant"]
        # rollout and evaluate run over the training ranks, as train does.
        ranks = job["rule"] in ("train", "rollout", "evaluate")
        nproc = 2 if variant == "jagg" and ranks else 1
        scored_on_cpu = job["rule"] == "score" and variant == "exact"
        assert int(resources["gpu"]) == (0 if scored_on_cpu else nproc), job
        assert job["threads"] == nproc, job
        assert int(resources["cpus_per_task"]) == job["threads"], job


def test_a_local_run_shares_out_the_machines_gpus(tmp_path):
    cuda_config(tmp_path)
    jobs = dry_run(tmp_path, "--profile", LOCAL_PROFILE, env={"JAGG_GPUS": "2"})
    trains = {
        job["wildcards"]["variant"]: job["resources"]["gpu"]
        for job in jobs
        if job["rule"] == "train"
    }
    assert trains == {"exact": "1", "jagg": "2"}


@pytest.mark.parametrize(
    ("env", "source"),
    [({"JAGG_GPUS": "1"}, "JAGG_GPUS"), ({"CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES")],
)
def test_a_local_job_needing_more_gpus_than_the_machine_has_is_refused(
    tmp_path, monkeypatch, env, source
):
    monkeypatch.delenv("JAGG_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda_config(tmp_path)
    result = snakemake(tmp_path, "all", "--dry-run", "--profile", LOCAL_PROFILE, env=env)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "needs 2 GPU(s)" in said and "train.nproc 2" in said, said[-3000:]
    assert f"offers 1 ({source})" in said, said[-3000:]
