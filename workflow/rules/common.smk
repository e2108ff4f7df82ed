# Named helpers of the rules: thin adapters from a job's wildcards to the package's workflow
# functions (jagg_pipeline.workflow: runs, layout, retention, resources, pools), which hold the
# logic and are unit-tested without Snakemake.
#
# Every job parses this file again, so it imports only the torch-free part of the package.
import os
import re
import sys
from pathlib import Path

import yaml

from jagg_pipeline.config.fields import ConfigError, digest, to_dict
from jagg_pipeline.config.yaml_io import apply_overrides, read_yaml
from jagg_pipeline.io.artifacts import (
    EVALUATION_PREFIX,
    ROUND_STAGES,
    atomic_write_text,
)
from jagg_pipeline.io.manifest import stage_digest
from jagg_pipeline.toyworld.config import TOY_FAMILIES
from jagg_pipeline.workflow import containers, layout, resources
from jagg_pipeline.workflow.checks import check_runs
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.pools import shared_pools
from jagg_pipeline.workflow.retention import Retention
from jagg_pipeline.workflow.runs import dag_recursion_limit
from jagg_pipeline.workflow.sections import merge, split


def _own_config():
    """The config the workflow runs: the user's --configfile(s) INSTEAD of config.yaml when
    given (keys they leave out take the package's defaults), then --config values; layered
    by sections.merge, so a file's rewards.weights, variants or eval metrics are the ones
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


# Snakemake's own --configfile/--config handling deep-merges the user's file into config.yaml
# (a file's reward weights would join config.yaml's); the config is replaced by our layering.
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
# The run layout's patterns (jagg_pipeline.workflow.layout): a run's folder, and the same
# below the logs' and benchmarks' folders; a round's and an evaluation's under each.
JOB = layout.run_id("{experiment}", "{variant}", "{seed}")
RUN = layout.run_directory(RESULTS, "{experiment}", "{variant}", "{seed}")
RUN_ROUND = layout.round_pattern(RUN)
JOB_ROUND = layout.round_pattern(JOB)
RUN_EVAL = f"{RUN}/{layout.EVALUATIONS}/{EVALUATION_PREFIX}{{trained}}"
JOB_EVAL = f"{JOB}/{layout.EVALUATIONS}/{EVALUATION_PREFIX}{{trained}}"
SUMMARY = layout.experiment_folder(RESULTS, "{experiment}", layout.SUMMARY)
TRACKED = (
    f"{layout.experiment_folder(RESULTS, '{experiment}', layout.TRACKING)}/tracked.json"
)
COMPARISON = layout.comparison_folder(RESULTS, "{experiment}")
POOL = layout.conditioning_folder(RESULTS, "{pool}")
TRANSIENT = layout.TRANSIENT
BLOCK_RECORD = layout.BLOCK_RECORD
BLOCK_TRANSIENT_RECORD = layout.BLOCK_TRANSIENT_RECORD
# On a cluster a round's rollout and score share one allocation. Train stays out: it feeds the
# next round's rollout, and Snakemake merges connected jobs of a group, so every round of a run
# would become one job.
SAMPLE_GROUP = "sample"


def _alternatives(values):
    return "|".join(re.escape(str(v)) for v in sorted(set(values))) or "^$"


# Closed wildcard sets: a path matches a rule only for the runs and pools of this config.
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
    return RUNS[layout.run_id(wildcards.experiment, wildcards.variant, wildcards.seed)]


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
    return layout.toyworld_inputs(config, TOYWORLD)


# Retention (workflow.keep_every; jagg_pipeline.workflow.retention): a kept round's
# checkpoint and rollout are outputs of the rules train and rollout, the other rounds' of
# train_transient and rollout_transient (temp(): deleted once no job needs them).
RETENTION = Retention.of(RUNS.values())


def round_record(stage):
    """The pattern of a round's kept metric lines of ``stage`` (rollout, score, train)."""
    return layout.round_record(RUN_ROUND, stage)


def rollout_inputs(wildcards):
    """The policy being sampled (the previous round's checkpoint) and the toy world."""
    run = run_of(wildcards)
    inputs = _toyworld_inputs(run.config)
    if int(wildcards.round) > 0:
        inputs["policy"] = RETENTION.policy(run, int(wildcards.round))
    return inputs


def rollout_policy(wildcards):
    """The --policy argument of a round's rollout and training."""
    return RETENTION.policy(run_of(wildcards), int(wildcards.round))


def score_inputs(wildcards):
    """The round's rollout (kept or transient)."""
    return {"rollouts": RETENTION.rollout_dir(run_of(wildcards), int(wildcards.round))}


def train_inputs(wildcards):
    """The round's rollout and scores, and the policy it continues from."""
    run, round_index = run_of(wildcards), int(wildcards.round)
    inputs = rollout_inputs(wildcards)
    inputs.update(
        rollouts=RETENTION.rollout_dir(run, round_index),
        scores=layout.scores_folder(run.directory, round_index),
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
    return RETENTION.policy(run, int(wildcards.trained))


# Devices and GPUs (jagg_pipeline.workflow.resources). Every model-running rule passes its
# device on the command line (so a dry run shows it) and asks for a GPU exactly when that
# device is CUDA.
def _gpu_limit():
    """The GPUs that jobs share when Snakemake schedules them on this machine, else None.

    Snakemake quietly caps a job's request at the global `gpu` resource (gpu: 0 would start
    a GPU job with none), so the workflow sets that resource to the machine's count itself
    and refuses bigger requests (resources.checked_gpus). `--resources gpu=N` wins. With
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
    count, source = resources.machine_gpus(os.environ)
    workflow.register_resource("gpu", count)
    return count, source


GPU_LIMIT = _gpu_limit()


def _gpus(job, request):
    """A request (count, why) of ``job`` checked against this machine's GPUs."""
    if request is None:
        return None
    return resources.checked_gpus(job, *request, GPU_LIMIT)


def backbone_device(wildcards):
    """backbone.device of the job's run: the policy's device in rollout, train, evaluate."""
    return run_of(wildcards).config.backbone.device


def reward_device(wildcards):
    """The device of the run's reward models: rewards.device, else backbone.device."""
    config = run_of(wildcards).config
    return config.rewards.resolve_device(config.backbone.device)


def score_gpus(wildcards):
    """One GPU when the reward models run on CUDA (the score job is one process)."""
    run = run_of(wildcards)
    return _gpus(run.run_id, resources.score_gpus(run.config))


def ranks_gpus(wildcards):
    """One GPU per process of the training ranks (train.nproc) when the policy runs on CUDA;
    None for a multi-node job, whose GPUs per node are its ``gres`` (ranks_slurm)."""
    run = run_of(wildcards)
    return _gpus(run.run_id, resources.ranks_gpus(run.config))


def evaluate_gpus(wildcards):
    """The ranks' GPUs; one when only the reward models (rank 0 scores) run on CUDA."""
    run = run_of(wildcards)
    return _gpus(run.run_id, resources.evaluate_gpus(run.config))


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
# The images hold the dependencies, not the package: a job imports it from this checkout.
if IN_APPTAINER:
    os.environ.update(
        containers.apptainer_environ(containers.package_root(), os.environ)
    )


def _ranks_resource(name):
    # One input function per SLURM resource: a rule's resources take one function each.
    def resource(wildcards):
        run = run_of(wildcards)
        slurm = resources.ranks_slurm(
            run.run_id, run.config, runs_here=RUNS_HERE, in_apptainer=IN_APPTAINER
        )
        return slurm[name]

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
    MLflow the page is read back from, and every file its runs keep (Retention.run_files;
    lost lines and blocks are forced, Retention.lost_records and lost_blocks), so that a
    finished target notices a deleted one. Asking for tracked.json retries a failed push: it
    is gone after one (Snakemake removes a failed job's outputs), and Snakemake remakes a
    missing intermediate only when asked for it.
    """
    wildcards = {"experiment": experiment}
    files = [
        TRACKED.format(**wildcards),
        f"{COMPARISON.format(**wildcards)}/index.html",
    ]
    for run in _runs(experiment):
        files += RETENTION.run_files(run)
        if workflow.dag is not None and workflow.is_main_process:
            # Snakemake's forcerun, added to the DAG being built: what a finished run lost
            # that no target can ask for by name.
            workflow.dag.forcefiles.update(RETENTION.lost_records(run))
            workflow.dag.forcefiles.update(RETENTION.lost_blocks(run))
    return files


def experiment_target(experiment):
    """Input function of a target rule: :func:`target_files` of its experiment."""

    def inputs(wildcards):
        return target_files(experiment)

    inputs.__name__ = f"{experiment}_target"
    return inputs


def summary_inputs(wildcards):
    """Every file the summary reads: what the experiment's runs keep (Retention.run_files)."""
    return [
        path for run in _runs(wildcards.experiment) for path in RETENTION.run_files(run)
    ]


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
    return SUMMARY.format(experiment=wildcards.experiment)


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
    return _gpus("bench", (int(resources.on_cuda(device)), f"backbone.device {device}"))


# Prompt pools encoded once (workflow.encode_prompts; jagg_pipeline.workflow.pools): run id
# -> stage -> pool key, and pool key -> the pool.
RUN_POOLS, POOLS = shared_pools(RUNS.values()) if WORKFLOW.encode_prompts else ({}, {})


def _conditioning(stage, arguments):
    def helper(wildcards):
        key = RUN_POOLS.get(run_of(wildcards).run_id, {}).get(stage)
        if key is None:
            return []
        folder = layout.conditioning_folder(RESULTS, key)
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
    return pool_of(wildcards).inputs(TOYWORLD)


def encode_settings(wildcards):
    """``--set KEY=VALUE`` for every key the encode stage reads and the backbone device."""
    return pool_of(wildcards).settings()


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
    request = (int(resources.on_cuda(device)), f"backbone.device {device}")
    return _gpus(f"encode {wildcards.pool}", request)


# Blocks of rounds (workflow.rounds_per_job K > 1, block.smk): a run's rounds in blocks of K,
# a block named by its last round e. Its job writes every file of its rounds at the paths of
# the single-round jobs; Snakemake knows its record and its last checkpoint.
# Checkpoints written inside a block (kept rounds, not its last): what an evaluation run that
# names one waits for is the block's record.
BLOCK_WRITTEN = RETENTION.block_written(RUNS.values())


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
        inputs["policy"] = RETENTION.policy(run, block.start)
    pools = RUN_POOLS.get(run.run_id, {})
    if "rollout" in pools:
        inputs["conditioning"] = layout.conditioning_folder(RESULTS, pools["rollout"])
    if run.block_evaluations(block) and "evaluate" in pools:
        inputs["eval_conditioning"] = layout.conditioning_folder(
            RESULTS, pools["evaluate"]
        )
    return inputs


def block_policy(wildcards):
    """The --policy of a block: base, or the checkpoint after its first round's predecessors."""
    run, block = block_of(wildcards)
    return RETENTION.policy(run, block.start)


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
    return " ".join(str(r) for r in block if RETENTION.kept(run, r))


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
    """A block job's time limit in minutes (resources.block_runtime)."""
    _, block = block_of(wildcards)
    return resources.block_runtime(len(block))
