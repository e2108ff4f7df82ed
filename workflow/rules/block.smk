# workflow.rounds_per_job K > 1: a run's rounds in blocks of K, each one job over the training
# ranks (sample, score, train, and the block's evaluations, the models resident). Round e is
# the last of its block; round-<e>/block.json is the block's record, and round e's checkpoint
# (the next block's policy) is the job's output, kept or transient as the round is. The other
# rounds' files (scores, metric lines, kept rollouts and checkpoints, evaluations) are the
# block's too, at the single-round jobs' paths; the record, written last, stands for them.


rule block:
    input:
        unpack(block_inputs),
    output:
        checkpoint=directory(f"{RUN_ROUND}/checkpoint"),
        record=f"{RUN_ROUND}/{BLOCK_RECORD}",
    log:
        f"{LOGS}/{JOB_ROUND}/block.log",
    benchmark:
        f"{BENCHMARKS}/{JOB_ROUND}/block.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    # One core per process of the training ranks, each on one thread (as train).
    threads: ranks_threads
    resources:
        mem_mb=16000,
        runtime=block_runtime,
        gpu=evaluate_gpus,
        cpus_per_task=task_cpus,
        # train.nodes > 1: one task per node and the GPUs per node (see ranks_slurm).
        nodes=ranks_nodes,
        tasks=ranks_tasks,
        mpi=ranks_mpi,
        gres=ranks_gres,
        tasks_per_gpu=ranks_tasks_per_gpu,
    params:
        config=run_config_file,
        run=run_folder,
        policy=block_policy,
        device=backbone_device,
        python=PYTHON,
        # What this job reads of the config: Snakemake reruns it when a value changes.
        digest=block_digest,
        rounds=block_rounds,
        keep=block_kept,
        evaluate=block_evaluations,
        conditioning=block_conditioning_arguments,
    shell:
        "{params.python:q} -m jagg_pipeline launch block"
        " --config {params.config:q} --set backbone.device={params.device:q}"
        " --policy {params.policy:q} --run-dir {params.run:q} --rounds {params.rounds}"
        " --keep {params.keep} --evaluate {params.evaluate} {params.conditioning:q}"
        " --checkpoint {output.checkpoint:q} --record {output.record:q} > {log:q} 2>&1"


# A block whose last round keeps no checkpoint (workflow.keep_every): its checkpoint is
# deleted once the next block is done.
use rule block as block_transient with:
    output:
        checkpoint=temp(directory(f"{RUN_ROUND}/{TRANSIENT}/checkpoint")),
        record=f"{RUN_ROUND}/{BLOCK_TRANSIENT_RECORD}",


ruleorder: block > block_transient
