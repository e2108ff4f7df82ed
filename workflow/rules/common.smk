# Named helpers of the rules: the resolved runs, their paths, inputs and params.
#
# Every job parses this file again, so it imports only the torch-free part of the package
# (jagg_pipeline.experiments and jagg_pipeline.config).
import re
import sys
from pathlib import Path

import yaml

from jagg_pipeline.configtools import digest, read_yaml, to_dict
from jagg_pipeline.experiments import (
    evaluated_rounds,
    resolve_runs,
    split,
    stage_digest,
)

# Snakemake's YAML reader lets a repeated key silently win; the strict one names it.
for _configfile in workflow.configfiles:
    read_yaml(_configfile)
RUNS = resolve_runs(config)
WORKFLOW = split(config)[1]
RESULTS = WORKFLOW.results
TOYWORLD = WORKFLOW.toyworld.root
LOGS = f"{RESULTS}/logs"
BENCHMARKS = f"{RESULTS}/benchmarks"
# Without --sdm the interpreter running Snakemake runs the stages too (the project's virtual
# environment); with conda or apptainer, the environment's own python does.
PYTHON = "python" if workflow.deployment_settings.deployment_method else sys.executable
CONTAINERS = WORKFLOW.containers
RUN = f"{RESULTS}/{{experiment}}/{{variant}}/seed-{{seed}}"
JOB = "{experiment}/{variant}/seed-{seed}"
TOY_FAMILIES = ("flux", "qwenimage", "sd3")
# On a cluster a round's rollout and score share one allocation. Train stays out: it feeds the
# next round's rollout, and Snakemake merges connected jobs of a group, so every round of a run
# would become one job.
SAMPLE_GROUP = "sample"


def _alternatives(values):
    return "|".join(re.escape(str(v)) for v in sorted(set(values))) or "^$"


wildcard_constraints:
    experiment=_alternatives(run.experiment for run in RUNS.values()),
    variant=_alternatives(run.variant for run in RUNS.values()),
    seed=r"\d+",
    round=r"\d{4}",
    trained=r"\d{4}",
    family="|".join(TOY_FAMILIES),


def _write_if_changed(path, text):
    """Write a resolved config only when it changed, so its mtime means something."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    staging.replace(path)


# Each run's resolved config, read by all of its jobs (params carry the section digests), and
# the overrides that made it (a tag of its tracked run).
for _run in RUNS.values():
    _write_if_changed(
        f"{_run.directory}/config.yaml",
        yaml.safe_dump(to_dict(_run.config), sort_keys=False),
    )
    _write_if_changed(
        f"{_run.directory}/overrides.yaml",
        yaml.safe_dump(_run.overrides, sort_keys=True),
    )


def parent_folder(wildcards, output):
    """The folder holding a rule's first output (the toy world's root)."""
    return Path(output[0]).parent


def run_of(wildcards):
    """The run a job belongs to."""
    return RUNS[f"{wildcards.experiment}/{wildcards.variant}/seed-{wildcards.seed}"]


def run_config_file(wildcards):
    """The resolved config file of the job's run."""
    return f"{run_of(wildcards).directory}/config.yaml"


def _digest_param(stage):
    def digest(wildcards):
        return stage_digest(run_of(wildcards).config, stage)

    digest.__name__ = f"{stage}_digest"
    return digest


rollout_digest = _digest_param("rollout")
score_digest = _digest_param("score")
train_digest = _digest_param("train")
evaluate_digest = _digest_param("evaluate")


def _toyworld_inputs(config):
    """The toy-world builds a run's config points at (none for real checkpoints)."""
    inputs = {}
    backbone = Path(config.backbone.path)
    if backbone.parent == Path(TOYWORLD) and backbone.name == config.backbone.family:
        inputs["toy_backbone"] = str(backbone)
    used = {*config.rewards.weights, *config.eval.metrics}
    if "toy_clipscore" in used and Path(config.rewards.toy_clipscore.model) == Path(
        TOYWORLD, "clip"
    ):
        inputs["toy_clip"] = f"{TOYWORLD}/clip"
    return inputs


def checkpoint_dir(run, round_index):
    """The checkpoint written by training round ``round_index`` of ``run``."""
    return f"{run.directory}/round-{round_index:04d}/checkpoint"


def _policy(run, trained):
    """``base`` before any training, else the checkpoint after ``trained`` rounds."""
    return "base" if trained == 0 else checkpoint_dir(run, trained - 1)


def rollout_inputs(wildcards):
    """The policy being sampled (the previous round's checkpoint) and the toy world."""
    run = run_of(wildcards)
    inputs = _toyworld_inputs(run.config)
    if int(wildcards.round) > 0:
        inputs["policy"] = _policy(run, int(wildcards.round))
    return inputs


def rollout_policy(wildcards):
    """The --policy argument of a round's rollout and training."""
    return _policy(run_of(wildcards), int(wildcards.round))


def train_inputs(wildcards):
    """The round's rollout and scores, and the policy it continues from."""
    inputs = rollout_inputs(wildcards)
    directory = f"{run_of(wildcards).directory}/round-{wildcards.round}"
    inputs.update(rollouts=f"{directory}/rollout", scores=f"{directory}/scores")
    return inputs


def train_launcher(wildcards):
    """``torchrun`` over train.nproc processes, or the plain interpreter for one."""
    nproc = run_of(wildcards).config.train.nproc
    if nproc > 1:
        return (
            f"{PYTHON} -m torch.distributed.run --standalone --nproc_per_node {nproc}"
        )
    return PYTHON


def evaluate_inputs(wildcards):
    """The policy after ``trained`` rounds (nothing but the toy world for the base)."""
    run = run_of(wildcards)
    inputs = _toyworld_inputs(run.config)
    trained = int(wildcards.trained)
    if trained > 0:
        inputs["policy"] = _policy(run, trained)
    return inputs


def evaluate_policy(wildcards):
    """The --policy argument of an evaluation."""
    return _policy(run_of(wildcards), int(wildcards.trained))


def gpus(wildcards):
    """GPUs a job of the run asks for: one per training process on CUDA, none on CPU."""
    config = run_of(wildcards).config
    return config.train.nproc if config.backbone.device.startswith("cuda") else 0


def train_gpus(wildcards):
    """GPUs of a training job (one per process under torchrun)."""
    return gpus(wildcards)


def stage_gpus(wildcards):
    """GPUs of a sampling or scoring job: one at most."""
    return min(1, gpus(wildcards))


def run_outputs(run):
    """What a finished run leaves: every evaluation (its last checkpoint is their input)."""
    last = run.config.train.rounds - 1
    return [
        checkpoint_dir(run, last),
        *(
            f"{run.directory}/eval/trained-{n:04d}"
            for n in evaluated_rounds(run.config)
        ),
    ]


def _runs(experiment):
    runs = [run for run in RUNS.values() if run.experiment == experiment]
    if not runs:
        known = sorted({run.experiment for run in RUNS.values()})
        raise ValueError(
            f"workflow.experiments.{experiment} is not in the config; experiments: "
            f"{', '.join(known)}"
        )
    return runs


def experiment_target(experiment):
    """Input function of a target rule: the experiment tracked (after its summary, which
    needs every run)."""

    def inputs(wildcards):
        _runs(experiment)
        return f"{RESULTS}/{experiment}/tracking/tracked.json"

    inputs.__name__ = f"{experiment}_target"
    return inputs


def summary_inputs(wildcards):
    """Every finished run of the experiment being summarised."""
    return [path for run in _runs(wildcards.experiment) for path in run_outputs(run)]


def summary_arguments(wildcards):
    """``--run VARIANT SEED DIR`` for every run of the experiment."""
    return " ".join(
        f"--run {run.variant} {run.seed} {run.directory}"
        for run in _runs(wildcards.experiment)
    )


def summary_folder(wildcards):
    """Where an experiment's summary goes."""
    return f"{RESULTS}/{wildcards.experiment}/summary"


def tracking_digest(wildcards):
    """The digest of the tracking sections of an experiment's runs (where track pushes)."""
    return digest([to_dict(run.config.tracking) for run in _runs(wildcards.experiment)])


def report_inputs(wildcards):
    """The comparison pages of the experiments named in workflow.report."""
    return [
        f"{RESULTS}/report/{name}/index.html" for name in WORKFLOW.report if _runs(name)
    ]


def bench_device():
    """The benchmark measures on the base config's backbone.device (cpu, or cuda on a GPU node)."""
    return (config.get("backbone") or {}).get("device", "cpu")


def bench_gpus():
    """One GPU for a CUDA benchmark."""
    return 1 if bench_device().startswith("cuda") else 0
