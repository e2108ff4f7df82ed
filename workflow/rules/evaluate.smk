# Held-out evaluation of the policy after `trained` rounds (0: the base policy).


rule evaluate:
    input:
        unpack(evaluate_inputs),
        conditioning=evaluate_conditioning,
    output:
        metrics=directory(RUN_EVAL),
    log:
        f"{LOGS}/{JOB_EVAL}.log",
    benchmark:
        f"{BENCHMARKS}/{JOB_EVAL}.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    # Every process of the training ranks samples its share; rank 0 scores the images.
    threads: ranks_threads
    resources:
        mem_mb=8000,
        runtime=60,
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
        policy=evaluate_policy,
        device=backbone_device,
        python=PYTHON,
        # What this job reads of the config: Snakemake reruns it when a value changes.
        digest=evaluate_digest,
        conditioning=evaluate_conditioning_arguments,
    shell:
        "{params.python:q} -m jagg_pipeline launch evaluate"
        " --config {params.config:q} --set backbone.device={params.device:q}"
        " --policy {params.policy:q} {params.conditioning:q}"
        " --out {output.metrics:q} > {log:q} 2>&1"
