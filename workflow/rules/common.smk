# Named helpers of the rules: the resolved runs, their paths, inputs and params.
#
# Every job parses this file again, so it imports only the torch-free part of the package
# (jagg_pipeline.workflow.experiments, jagg_pipeline.config.run, the toy world's settings).
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from jagg_pipeline.io.artifacts import (
    EVALUATION_PREFIX,
    ROUND_PREFIX,
    ROUND_RECORDS,
    ROUND_STAGES,
    atomic_write_text,
    evaluation_name,
    round_name,
)
from jagg_pipeline.config.tools import (
    ConfigError,
    apply_overrides,
    digest,
    read_yaml,
    to_dict,
)
from jagg_pipeline.workflow.checks import check_runs
from jagg_pipeline.workflow.experiments import (
    dag_recursion_limit,
    merge,
    resolve_runs,
    split,
    toyworld_inputs,
)
from jagg_pipeline.io.manifest import MANIFEST_NAME, stage_digest, stage_values
from jagg_pipeline.toyworld.config import TOY_FAMILIES


def _own_config():
    """The config the workflow runs: the user's --configfile(s) INSTEAD of config.yaml when
    given (keys they leave out take the package's defaults), then --config values; layered
    by experiments.merge, so a file's rewards.weights, variants or eval metrics are the ones
    that run, never merged into config.yaml's. Snakemake would deep-merge them.

    Read with the strict YAML reader, which names a repeated key (Snakemake's lets it win)
    and bounds aliases. --config values are read again from the command line as YAML: Snakemake
    hands a mapping's values over as text (train='{rounds: 2}' gave rounds '2').
    """
    files = workflow.overwrite_configfiles or workflow.configfiles
    data = {}
    for path in files:
        data = merge(data, read_yaml(path) or {})
    for entry in workflow.config_settings.config_args or ():
        data = merge(data, apply_overrides({}, [entry]))
    return data


config.clear()
config.update(_own_config())
RUNS = resolve_runs(config)
# Snakemake builds the DAG recursively, a few frames per job of the longest chain of a run
# (every round's train job follows the previous one's): raise Python's limit to fit.
sys.setrecursionlimit(max(sys.getrecursionlimit(), dag_recursion_limit(RUNS.values())))
WORKFLOW = split(config)[1]
RESULTS = WORKFLOW.results
TOYWORLD = WORKFLOW.toyworld.root
# What the runs name (prompt files, checkpoints and their settings, reward model files,
# evaluated rounds), read now: a bad one is refused before any job starts, not minutes into one.
_PROBLEMS = check_runs(RUNS.values(), WORKFLOW)
if _PROBLEMS:
    raise ConfigError("\n".join(_PROBLEMS))
LOGS = f"{RESULTS}/logs"
BENCHMARKS = f"{RESULTS}/benchmarks"
# Without --sdm the interpreter running Snakemake runs the stages too (the project's virtual
# environment); with conda or apptainer, the environment's own python does.
PYTHON = "python" if workflow.deployment_settings.deployment_method else sys.executable
CONTAINERS = WORKFLOW.containers
RUN = f"{RESULTS}/{{experiment}}/{{variant}}/seed-{{seed}}"
JOB = "{experiment}/{variant}/seed-{seed}"
# A round's folder under a run, and its logs' and benchmarks' folder under a job.
RUN_ROUND = f"{RUN}/{ROUND_PREFIX}{{round}}"
JOB_ROUND = f"{JOB}/{ROUND_PREFIX}{{round}}"
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


def _run_files(run):
    """A run's files, read by all of its jobs: its resolved config (their params carry the
    section digests) and the overrides that made it (a tag of its tracked run)."""
    return {
        "config.yaml": yaml.safe_dump(to_dict(run.config), sort_keys=False),
        "overrides.yaml": yaml.safe_dump(run.overrides, sort_keys=True),
    }


def write_run_files(dag):
    """Write the files of every run of the targets about to run, where they changed.

    Called by `onstart`: never in a dry run, once the lock is held and before any job. (Not
    a rule: a config job upstream of every job would rerun on any edit, and Snakemake then
    skips its downstream jobs' own params checks, so an edit would rerun nothing or all.)
    """
    targets = {job.wildcards_dict.get("experiment") for job in dag.jobs}
    for run in RUNS.values():
        if run.experiment not in targets:
            continue
        for name, text in _run_files(run).items():
            path = Path(run.directory, name)
            if not path.is_file() or path.read_text() != text:
                atomic_write_text(path, text)


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
    # What the job reads of its run's config (io.manifest.stage_values), as a param: Snakemake
    # reruns a job whose params changed, so an edit reruns exactly the jobs that read it.
    def digest(wildcards):
        round_index = int(wildcards.round) if stage == "train" else None
        return stage_digest(run_of(wildcards).config, stage, round_index)

    digest.__name__ = f"{stage}_digest"
    return digest


rollout_digest = _digest_param("rollout")
score_digest = _digest_param("score")
train_digest = _digest_param("train")
evaluate_digest = _digest_param("evaluate")


def _toyworld_inputs(config):
    """The toy-world builds a run's config points at (none for real checkpoints)."""
    return toyworld_inputs(config, TOYWORLD)


# Retention (workflow.keep_every). A kept round's checkpoint and rollout live in round-<r>/
# and stay; the other rounds' live in round-<r>/transient/, outputs of the rules
# train_transient and rollout_transient (temp(): Snakemake deletes them once no job needs
# them). Two rules, because which rounds are kept depends on the run (its train.rounds and
# eval.every), and a wildcard constraint cannot depend on another wildcard. Every round keeps
# its metric lines in round-<r>/metrics/<stage>.jsonl (round_record), which summary and track
# read.
TRANSIENT = "transient"
# Checkpoints that evaluation runs name (workflow.evaluations.*.policies.*.checkpoint) are
# kept too, whatever their round.
EVALUATED_CHECKPOINTS = {
    os.path.normpath(run.policy)
    for run in RUNS.values()
    if run.policy is not None and run.policy != "base"
}


def round_record(stage):
    """The pattern of a round's kept metric lines of ``stage`` (rollout, score, train)."""
    return f"{RUN_ROUND}/{ROUND_RECORDS}/{stage}.jsonl"


def round_folder(run, round_index):
    """``round-<r>/`` of ``run``."""
    return f"{run.directory}/{round_name(round_index)}"


def kept_round(run, round_index):
    """Whether round ``round_index`` of ``run`` keeps its checkpoint and rollout: a kept
    round of the run (workflow.keep_every), one an evaluation names, or one that a shorter
    run kept (its last round), so that a longer run continues from it instead of retraining
    the rounds up to it."""
    if round_index in run.kept_rounds:
        return True
    named = os.path.normpath(f"{round_folder(run, round_index)}/checkpoint")
    return named in EVALUATED_CHECKPOINTS or _finished_checkpoint(named)


@functools.cache
def _finished_checkpoint(folder):
    # Asked once per invocation: the DAG is planned from what was there when it started.
    return Path(folder, MANIFEST_NAME).is_file()


def _stage_folder(run, round_index, stage):
    folder = round_folder(run, round_index)
    if kept_round(run, round_index):
        return f"{folder}/{stage}"
    return f"{folder}/{TRANSIENT}/{stage}"


def checkpoint_dir(run, round_index):
    """The checkpoint written by training round ``round_index`` of ``run`` (round-<r>/
    checkpoint when the round is kept, else round-<r>/transient/checkpoint)."""
    return _stage_folder(run, round_index, "checkpoint")


def rollout_dir(run, round_index):
    """The rollout sampled in round ``round_index`` of ``run`` (kept or transient, as its
    checkpoint)."""
    return _stage_folder(run, round_index, "rollout")


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


def score_inputs(wildcards):
    """The round's rollout (kept or transient)."""
    return {"rollouts": rollout_dir(run_of(wildcards), int(wildcards.round))}


def train_inputs(wildcards):
    """The round's rollout and scores, and the policy it continues from."""
    run, round_index = run_of(wildcards), int(wildcards.round)
    inputs = rollout_inputs(wildcards)
    inputs.update(
        rollouts=rollout_dir(run, round_index),
        scores=f"{round_folder(run, round_index)}/scores",
    )
    return inputs


def evaluate_inputs(wildcards):
    """The policy after ``trained`` rounds or an evaluation's checkpoint (nothing but the toy
    world for a base policy; the record of the block that wrote a checkpoint inside it).
    """
    inputs = _toyworld_inputs(run_of(wildcards).config)
    policy = evaluate_policy(wildcards)
    if policy != "base":
        inputs["policy"] = BLOCK_WRITTEN.get(os.path.normpath(policy), policy)
    return inputs


def evaluate_policy(wildcards):
    """The --policy of an evaluation: an evaluation run's, else the run's after ``trained``
    rounds."""
    run = run_of(wildcards)
    if run.policy is not None:
        return run.policy
    return _policy(run, int(wildcards.trained))


# Devices and GPUs. Every model-running rule passes its device on the command line (so a dry
# run shows it) and asks for a GPU exactly when that device is CUDA.
GPU_ENV = "JAGG_GPUS"


def _machine_gpus():
    """This machine's usable GPUs and where the count came from: $JAGG_GPUS, else the
    CUDA_VISIBLE_DEVICES list (CUDA stops at its first negative entry), else `nvidia-smi -L`.
    """
    if GPU_ENV in os.environ:
        value = os.environ[GPU_ENV].strip()
        if not value.isdigit():
            raise ValueError(
                f"{GPU_ENV}={value!r}: give the number of GPUs this machine may use, "
                f"e.g. {GPU_ENV}=1"
            )
        return int(value), GPU_ENV
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break
            count += 1
        return count, "CUDA_VISIBLE_DEVICES"
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0, "no nvidia-smi"
    if listing.returncode != 0:
        return 0, "nvidia-smi -L failed"
    return (
        sum(line.startswith("GPU ") for line in listing.stdout.splitlines()),
        "nvidia-smi -L",
    )


def _gpu_limit():
    """The GPUs that jobs share when Snakemake schedules them on this machine, else None.

    Snakemake quietly caps a job's request at the global `gpu` resource (gpu: 0 would start
    a GPU job with none), so the workflow sets that resource to the machine's count itself
    and refuses bigger requests (:func:`_gpus`). `--resources gpu=N` wins. With
    --jobs (a cluster executor such as the slurm profile) each job's GPUs come from the cluster
    scheduler; inside a job's own process they were granted already.
    """
    if not workflow.is_main_process:
        return None
    given = workflow.global_resources.get("gpu").value
    if given is not None:
        return given, "--resources gpu"
    if workflow.nodes is not None:
        return None
    count, source = _machine_gpus()
    workflow.register_resource("gpu", count)
    return count, source


GPU_LIMIT = _gpu_limit()


def _on_cuda(device):
    return device.split(":")[0] == "cuda"


def _gpus(job, count, why):
    """``count`` GPUs for ``job``, refused when the local machine has fewer."""
    if GPU_LIMIT is not None and count > GPU_LIMIT[0]:
        limit, source = GPU_LIMIT
        raise ValueError(
            f"{job} needs {count} GPU(s) ({why}) but this machine offers {limit} ({source}); "
            f"if it has more, set {GPU_ENV}=N (or --resources gpu=N), else use a cpu device, "
            "fewer train.nproc, or a cluster (--profile workflow/profiles/slurm)"
        )
    return count


def backbone_device(wildcards):
    """backbone.device of the job's run: the policy's device in rollout, train, evaluate."""
    return run_of(wildcards).config.backbone.device


def reward_device(wildcards):
    """The device of the run's reward models: rewards.device, else backbone.device."""
    config = run_of(wildcards).config
    return config.rewards.resolve_device(config.backbone.device)


def score_gpus(wildcards):
    """One GPU when the reward models run on CUDA (the score job is one process)."""
    device = reward_device(wildcards)
    why = f"reward models (rewards.device, else backbone.device) on {device}"
    return _gpus(run_of(wildcards).run_id, int(_on_cuda(device)), why)


def ranks_gpus(wildcards):
    """One GPU per process of the training ranks (train.nproc) when the policy runs on CUDA:
    train, rollout and evaluate run the sharded policy on every rank. None for a multi-node
    job, whose GPUs per node are its ``gres`` (:func:`ranks_slurm`)."""
    config = run_of(wildcards).config
    if config.train.nodes > 1:
        return None
    count = config.train.nproc if _on_cuda(config.backbone.device) else 0
    why = f"backbone.device {config.backbone.device}, train.nproc {config.train.nproc}"
    return _gpus(run_of(wildcards).run_id, count, why)


def evaluate_gpus(wildcards):
    """The ranks' GPUs; one when only the reward models (rank 0 scores) run on CUDA."""
    count = ranks_gpus(wildcards)
    if count == 0 and _on_cuda(reward_device(wildcards)):
        return score_gpus(wildcards)
    return count


def ranks_threads(wildcards):
    """One core per process of a node (train.nproc): a multi-node job asks for them per
    node, as the cpus of its one task per node."""
    return run_of(wildcards).config.train.nproc


# Without --jobs, Snakemake runs the jobs on this machine, where srun cannot start a
# multi-node job; under --sdm apptainer the command runs in the image, which has no srun.
RUNS_HERE = workflow.is_main_process and workflow.nodes is None
IN_APPTAINER = any(
    method.name == "APPTAINER"
    for method in workflow.deployment_settings.deployment_method
)


def ranks_slurm(run):
    """The SLURM resources of a job over the training ranks: train, rollout, evaluate
    (snakemake-executor-plugin-slurm's names; None leaves a resource out).

    One node: ``nodes`` 1 and nothing else (GPUs: :func:`ranks_gpus`). Several: ``nodes`` N,
    ``tasks`` N (sbatch --ntasks, one torchrun agent per node), ``mpi`` (the plugin's job step
    then runs the command as it is, without wrapping it in `srun -n1`: the command's own srun
    starts the agents), ``gres`` gpu:<train.nproc> per node when the policy runs on CUDA, and
    ``tasks_per_gpu`` 0, which keeps the plugin from deriving --ntasks-per-gpu from ``tasks``.
    """
    train = run.config.train
    if train.nodes == 1:
        return dict(nodes=1, tasks=None, mpi=None, gres=None, tasks_per_gpu=None)
    if RUNS_HERE:
        raise ValueError(
            f"{run.run_id}: train.nodes {train.nodes} needs a SLURM cluster (srun starts a "
            "torchrun agent on each node); run with --profile workflow/profiles/slurm, or "
            "set train.nodes: 1"
        )
    if IN_APPTAINER:
        raise ValueError(
            f"{run.run_id}: train.nodes {train.nodes} starts its agents with srun on the "
            "host, which the apptainer image lacks; run it without --sdm apptainer (the venv "
            "or --sdm conda), or set train.nodes: 1"
        )
    cuda = _on_cuda(run.config.backbone.device)
    return dict(
        nodes=train.nodes,
        tasks=train.nodes,
        mpi="srun",
        gres=f"gpu:{train.nproc}" if cuda else None,
        tasks_per_gpu=0 if cuda else None,
    )


def _ranks_resource(name):
    def resource(wildcards):
        return ranks_slurm(run_of(wildcards))[name]

    resource.__name__ = f"ranks_{name}"
    return resource


ranks_nodes = _ranks_resource("nodes")
ranks_tasks = _ranks_resource("tasks")
ranks_mpi = _ranks_resource("mpi")
ranks_gres = _ranks_resource("gres")
ranks_tasks_per_gpu = _ranks_resource("tasks_per_gpu")


def task_cpus(wildcards, threads):
    """A job's cpus_per_task (sbatch --cpus-per-task): its threads."""
    return threads


def run_files(run):
    """What a finished run keeps, each by the path that only one of the rules makes.

    That is every evaluation, every round's scores and metric lines, and the checkpoint and
    rollout of each kept round (workflow.keep_every). The summary reads them, and the
    targets ask for them too: Snakemake remakes a deleted file only for a job that asks for
    it (tested: a round's scores and an evaluation deleted after a finished run are rebuilt
    by the next run of the target).
    """
    if run.blocks:
        # Blocks of rounds: each block's record stands for what the block wrote, and its
        # last checkpoint when kept (a lost one is made again; the others: lost_blocks).
        files = [block_record(run, block) for block in run.blocks]
        return files + [
            checkpoint_dir(run, block[-1])
            for block in run.blocks
            if kept_round(run, block[-1])
        ]
    files = [f"{run.directory}/eval/{evaluation_name(n)}" for n in run.evaluated_rounds]
    if run.policy is not None:
        return files
    for round_index in range(run.config.train.rounds):
        records = f"{round_folder(run, round_index)}/{ROUND_RECORDS}"
        files += [f"{round_folder(run, round_index)}/scores", f"{records}/score.jsonl"]
        if kept_round(run, round_index):
            # The rules rollout and train write these records (ruleorder in summary.smk:
            # their transient twins could write them too).
            files += [rollout_dir(run, round_index), checkpoint_dir(run, round_index)]
            files += [f"{records}/rollout.jsonl", f"{records}/train.jsonl"]
    return files


def force_lost_records(run):
    """Rerun the jobs of a finished run (its last round trained) whose transient rounds lost
    their rollout or train metric lines (deleted by hand, or lost with a disk): the job that
    writes a transient stage folder writes its lines too, so that folder is forced
    (Snakemake's forcerun, as :func:`force_lost_blocks`). Its consumers rerun after it, and
    Snakemake deletes the folder once they are done. (The lines alone could come from either
    rule of a pair; a run still going writes them itself.)
    """
    dag = workflow.dag
    rounds = 0 if run.policy is not None or run.blocks else run.config.train.rounds
    if dag is None or not workflow.is_main_process or not rounds:
        return

    def records(round_index):
        return Path(round_folder(run, round_index), ROUND_RECORDS)

    if not (records(rounds - 1) / "train.jsonl").is_file():
        return
    for round_index in range(rounds):
        if kept_round(run, round_index):
            continue
        # Forced, not asked for by the target: Snakemake never deletes a temp() output that
        # a target rule asks for, so the rebuilt folder would stay on disk for good.
        if not (records(round_index) / "rollout.jsonl").is_file():
            dag.forcefiles.add(rollout_dir(run, round_index))
        if not (records(round_index) / "train.jsonl").is_file():
            dag.forcefiles.add(checkpoint_dir(run, round_index))


def _runs(experiment):
    runs = [run for run in RUNS.values() if run.experiment == experiment]
    if not runs:
        known = sorted({run.experiment for run in RUNS.values()})
        raise ValueError(
            f"workflow.experiments.{experiment} is not in the config; experiments: "
            f"{', '.join(known)}"
        )
    return runs


def target_files(experiment):
    """What a target that includes ``experiment`` asks for: its comparison page, the push to
    MLflow the page is read back from, and every file its runs keep (:func:`run_files`;
    lost lines and blocks are forced, :func:`force_lost_records`, :func:`force_lost_blocks`),
    so that a finished target notices a deleted one. Asking for
    tracked.json retries a failed push: it is gone after one (Snakemake removes a failed
    job's outputs), and Snakemake remakes a missing intermediate only when asked for it.
    """
    files = [
        f"{RESULTS}/{experiment}/tracking/tracked.json",
        f"{RESULTS}/comparison/{experiment}/index.html",
    ]
    for run in _runs(experiment):
        files += run_files(run)
        force_lost_records(run)
        force_lost_blocks(run)
    return files


def experiment_target(experiment):
    """Input function of a target rule: :func:`target_files` of its experiment."""

    def inputs(wildcards):
        return target_files(experiment)

    inputs.__name__ = f"{experiment}_target"
    return inputs


def summary_inputs(wildcards):
    """Every file the summary reads: what the experiment's runs keep (:func:`run_files`)."""
    return [path for run in _runs(wildcards.experiment) for path in run_files(run)]


def summary_arguments(wildcards):
    """``--run VARIANT SEED DIR`` for every run of the experiment, as a list of arguments
    (each one quoted in the shell command by ``{params.runs:q}``)."""
    return [
        argument
        for run in _runs(wildcards.experiment)
        for argument in ("--run", run.variant, str(run.seed), run.directory)
    ]


def summary_folder(wildcards):
    """Where an experiment's summary goes."""
    return f"{RESULTS}/{wildcards.experiment}/summary"


def tracking_digest(wildcards):
    """The digest of the tracking sections of an experiment's runs (where track pushes)."""
    return digest([to_dict(run.config.tracking) for run in _runs(wildcards.experiment)])


def comparison_inputs(wildcards):
    """The comparison pages of the experiments named in workflow.comparison, and what they are
    read from (:func:`target_files`: a page is out of date once a push failed)."""
    return [path for name in WORKFLOW.comparison for path in target_files(name)]


def bench_device():
    """The benchmark measures on the base config's backbone.device (cpu, or cuda on a GPU node)."""
    return (config.get("backbone") or {}).get("device", "cpu")


def bench_gpus(wildcards):
    """One GPU for a CUDA benchmark."""
    device = bench_device()
    return _gpus("bench", int(_on_cuda(device)), f"backbone.device {device}")


# Prompt pools encoded once (workflow.encode_prompts): the encode rule writes each pool's
# conditioning to <results>/conditioning/<pool>/, and the rollout and evaluate jobs read it
# (--conditioning) instead of loading the text encoders. A pool is a prompt source and column
# under the backbone keys the text encoders read (experiments.pool_key): every run and round
# that agree on those share one encode job.
import json as _json
from dataclasses import dataclass as _dataclass

from jagg_pipeline.workflow.experiments import pool_key

CONDITIONING = f"{RESULTS}/conditioning"


@_dataclass(frozen=True)
class Pool:
    """A prompt pool to encode: its source, its column and a run config that reads it
    (every run sharing the pool agrees on what the encode stage reads of it)."""

    source: str
    column: str | None
    config: object


def _run_pools(run):
    """Stage -> pool of a run: its rollout's sampler.prompts (a training run) and its
    evaluation's eval.prompts."""
    config = run.config
    sources = {"evaluate": (config.eval.prompts, config.eval.column)}
    if run.policy is None:
        sources["rollout"] = (config.sampler.prompts, config.sampler.prompt_column)
    return {
        stage: Pool(source, column, config)
        for stage, (source, column) in sources.items()
    }


# run id -> stage -> pool key, and pool key -> the pool (its first run's config).
RUN_POOLS = {}
POOLS = {}
if WORKFLOW.encode_prompts:
    for _run in RUNS.values():
        RUN_POOLS[_run.run_id] = {}
        for _stage, _pool in _run_pools(_run).items():
            _key = pool_key(_pool.config, _pool.source, _pool.column)
            RUN_POOLS[_run.run_id][_stage] = _key
            POOLS.setdefault(_key, _pool)


def _conditioning(stage, arguments):
    def helper(wildcards):
        key = RUN_POOLS.get(run_of(wildcards).run_id, {}).get(stage)
        if key is None:
            return []
        folder = f"{CONDITIONING}/{key}"
        return ["--conditioning", folder] if arguments else [folder]

    helper.__name__ = f"{stage}_conditioning{'_arguments' if arguments else ''}"
    return helper


# The pool folder a rollout or evaluate job reads (an input; none under
# workflow.encode_prompts: false) and its --conditioning argument (a list, quoted by :q).
rollout_conditioning = _conditioning("rollout", False)
rollout_conditioning_arguments = _conditioning("rollout", True)
evaluate_conditioning = _conditioning("evaluate", False)
evaluate_conditioning_arguments = _conditioning("evaluate", True)


def pool_of(wildcards):
    """The pool an encode job encodes."""
    return POOLS[wildcards.pool]


def encode_inputs(wildcards):
    """The pool's prompt file (a toy split is none) and the toy backbone it is encoded by."""
    pool = pool_of(wildcards)
    inputs = {}
    if not pool.source.startswith("toy:"):
        inputs["prompts"] = pool.source
    toy = _toyworld_inputs(pool.config)
    if "toy_backbone" in toy:
        inputs["toy_backbone"] = toy["toy_backbone"]
    return inputs


def encode_settings(wildcards):
    """``--set KEY=VALUE`` for every key the encode stage reads (values as JSON, which YAML
    reads back as they were: a negative prompt "yes" stays text) and the backbone device
    (of the pool's first run)."""
    config = pool_of(wildcards).config
    device = {"backbone.device": config.backbone.device}
    values = {**stage_values(config, "encode"), **device}
    return [
        argument
        for key, value in values.items()
        for argument in ("--set", f"{key}={_json.dumps(value)}")
    ]


def encode_source(wildcards):
    """The --prompts argument of an encode job (a prompt file or a toy split)."""
    return pool_of(wildcards).source


def encode_column(wildcards):
    """The --column argument of an encode job, as a list (none: the file's own)."""
    column = pool_of(wildcards).column
    return [] if column is None else ["--column", column]


def encode_digest(wildcards):
    """The digest of what the encode stage reads (the rule's params: an edit reruns it)."""
    return stage_digest(pool_of(wildcards).config, "encode")


def encode_gpus(wildcards):
    """One GPU when the text encoders run on CUDA (backbone.device)."""
    device = pool_of(wildcards).config.backbone.device
    why = f"backbone.device {device}"
    return _gpus(f"encode {wildcards.pool}", int(_on_cuda(device)), why)


# Blocks of rounds (workflow.rounds_per_job K > 1, block.smk): a run's rounds in blocks of K,
# a block named by its last round e. Its job writes every file of its rounds at the paths of
# the single-round jobs; Snakemake knows its record and its last checkpoint.
BLOCK_RECORD = "block.json"
BLOCK_TRANSIENT_RECORD = "block-transient.json"


def block_record(run, block):
    """The record of ``block`` (a range of rounds) of ``run``: round-<e>/block.json, or
    block-transient.json when round e keeps no checkpoint (the rule block_transient's).
    """
    last = block[-1]
    name = BLOCK_RECORD if kept_round(run, last) else BLOCK_TRANSIENT_RECORD
    return f"{round_folder(run, last)}/{name}"


def block_files(run, block):
    """What ``block`` of ``run`` writes besides its outputs: every round's scores and
    metric lines, the kept rounds' rollouts and checkpoints, its evaluations."""
    files = []
    for round_index in block:
        folder = round_folder(run, round_index)
        files += [f"{folder}/scores"]
        files += [f"{folder}/{ROUND_RECORDS}/{stage}.jsonl" for stage in ROUND_STAGES]
        if kept_round(run, round_index):
            files += [rollout_dir(run, round_index), checkpoint_dir(run, round_index)]
    files += [
        f"{run.directory}/eval/{evaluation_name(n)}"
        for n in run.block_evaluations(block)
    ]
    return files


# Checkpoints written inside a block (kept rounds, not its last): what an evaluation run that
# names one waits for is the block's record.
BLOCK_WRITTEN = {
    os.path.normpath(checkpoint_dir(run, round_index)): block_record(run, block)
    for run in RUNS.values()
    for block in run.blocks
    for round_index in block[:-1]
    if kept_round(run, round_index)
}


def block_of(wildcards):
    """(run, rounds) of a block job: the block that ends with round ``wildcards.round``."""
    run, last = run_of(wildcards), int(wildcards.round)
    for block in run.blocks:
        if block[-1] == last:
            return run, block
    raise ValueError(
        f"{run.run_id}: round {last} ends no block of {run.rounds_per_job} rounds "
        f"(workflow.rounds_per_job); blocks end with rounds "
        f"{', '.join(str(block[-1]) for block in run.blocks)}"
    )


def block_inputs(wildcards):
    """The policy the block starts from (the previous block's last checkpoint), the toy world
    and the prompt pools its rounds and evaluations read."""
    run, block = block_of(wildcards)
    inputs = _toyworld_inputs(run.config)
    if block.start > 0:
        inputs["policy"] = _policy(run, block.start)
    pools = RUN_POOLS.get(run.run_id, {})
    if "rollout" in pools:
        inputs["conditioning"] = f"{CONDITIONING}/{pools['rollout']}"
    if run.block_evaluations(block) and "evaluate" in pools:
        inputs["eval_conditioning"] = f"{CONDITIONING}/{pools['evaluate']}"
    return inputs


def block_policy(wildcards):
    """The --policy of a block: base, or the checkpoint after its first round's predecessors."""
    run, block = block_of(wildcards)
    return _policy(run, block.start)


def run_folder(wildcards):
    """The job's run folder."""
    return run_of(wildcards).directory


def block_rounds(wildcards):
    """``FIRST LAST`` of a block job."""
    _, block = block_of(wildcards)
    return f"{block.start} {block[-1]}"


def block_kept(wildcards):
    """The block's rounds that keep their rollout and checkpoint (workflow.keep_every)."""
    run, block = block_of(wildcards)
    return " ".join(str(r) for r in block if kept_round(run, r))


def block_evaluations(wildcards):
    """The rounds trained before each evaluation the block runs (Run.block_evaluations)."""
    run, block = block_of(wildcards)
    return " ".join(str(n) for n in run.block_evaluations(block))


def block_conditioning_arguments(wildcards):
    """--conditioning and --eval-conditioning of a block job (as a list; none: inline)."""
    inputs = block_inputs(wildcards)
    arguments = []
    for key, flag in (
        ("conditioning", "--conditioning"),
        ("eval_conditioning", "--eval-conditioning"),
    ):
        if key in inputs:
            arguments += [flag, inputs[key]]
    return arguments


def block_digest(wildcards):
    """The digests of what the block's stages read (an edit of any reruns the block)."""
    run, block = block_of(wildcards)
    digests = [
        stage_digest(run.config, stage, round_index if stage == "train" else None)
        for round_index in block
        for stage in ROUND_STAGES
    ]
    if run.block_evaluations(block):
        digests.append(stage_digest(run.config, "evaluate"))
    return digest(digests)


def block_runtime(wildcards):
    """A block job's time limit in minutes: an hour, and half an hour per round."""
    _, block = block_of(wildcards)
    return 60 + 30 * len(block)


def force_lost_blocks(run):
    """Rerun the finished blocks of ``run`` whose files are not all there any more (deleted
    by hand, or lost with a disk): their record is what Snakemake knows of them, so it is
    forced (Snakemake's forcerun, added to the DAG being built: a record's content cannot
    say it). A rerun resumes after the last complete checkpoint before the first lost file.
    """
    dag = workflow.dag
    if dag is None or not workflow.is_main_process:
        return
    for block in run.blocks:
        record = block_record(run, block)
        files = block_files(run, block)
        if Path(record).is_file() and not all(Path(path).exists() for path in files):
            dag.forcefiles.add(record)
