# Round r samples a rollout from the policy after r rounds (the base policy at r = 0), and
# keeps its metric lines in round-<r>/metrics/rollout.jsonl.


rule rollout:
    input:
        unpack(rollout_inputs),
        conditioning=rollout_conditioning,
    output:
        rollout=directory(f"{RUN_ROUND}/rollout"),
        metrics=round_record("rollout"),
    log:
        f"{LOGS}/{JOB_ROUND}/rollout.log",
    benchmark:
        f"{BENCHMARKS}/{JOB_ROUND}/rollout.tsv"
    group:
        SAMPLE_GROUP
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    # Every process of the training ranks samples its share with the sharded policy (one
    # core and thread each).
    threads: ranks_threads
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=ranks_gpus,
        cpus_per_task=task_cpus,
        # train.nodes > 1: one task per node and the GPUs per node (see ranks_slurm).
        nodes=ranks_nodes,
        tasks=ranks_tasks,
        mpi=ranks_mpi,
        gres=ranks_gres,
        tasks_per_gpu=ranks_tasks_per_gpu,
    params:
        config=run_config_file,
        policy=rollout_policy,
        device=backbone_device,
        python=PYTHON,
        # What this job reads of the config: Snakemake reruns it when a value changes.
        digest=rollout_digest,
        conditioning=rollout_conditioning_arguments,
    shell:
        "{params.python:q} -m jagg_pipeline launch rollout"
        " --config {params.config:q} --set backbone.device={params.device:q}"
        " --policy {params.policy:q} --round {wildcards.round:q}"
        " {params.conditioning:q} --out {output.rollout:q} > {log:q} 2>&1"
        " && cp {output.rollout:q}/metrics.jsonl {output.metrics:q} 2>> {log:q}"


# The rollout of a round that keeps neither rollout nor checkpoint (workflow.keep_every):
# deleted once the round's score and train jobs are done.
use rule rollout as rollout_transient with:
    output:
        rollout=temp(directory(f"{RUN_ROUND}/{TRANSIENT}/rollout")),
        metrics=round_record("rollout"),
