# One GRPO round on a scored rollout; its checkpoint is the next round's policy. Its metric
# lines are kept in round-<r>/metrics/train.jsonl.


rule train:
    input:
        unpack(train_inputs),
    output:
        checkpoint=directory(f"{RUN_ROUND}/checkpoint"),
        metrics=round_record("train"),
    log:
        f"{LOGS}/{JOB_ROUND}/train.log",
    benchmark:
        f"{BENCHMARKS}/{JOB_ROUND}/train.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    # One core per process (torchrun starts train.nproc of them on each node), each on one
    # thread (`launch` pins every thread count: the bytes must not depend on --cores).
    threads: ranks_threads
    resources:
        mem_mb=16000,
        runtime=120,
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
        digest=train_digest,
    shell:
        "{params.python:q} -m jagg_pipeline launch train"
        " --config {params.config:q} --set backbone.device={params.device:q}"
        " --policy {params.policy:q} --rollouts {input.rollouts:q} --scores {input.scores:q}"
        " --out {output.checkpoint:q} > {log:q} 2>&1"
        " && cp {output.checkpoint:q}/metrics.jsonl {output.metrics:q} 2>> {log:q}"


# Training of a round that keeps neither checkpoint nor rollout (workflow.keep_every): its
# checkpoint is deleted once the next round's rollout and training are done.
use rule train as train_transient with:
    output:
        checkpoint=temp(directory(f"{RUN_ROUND}/{TRANSIENT}/checkpoint")),
        metrics=round_record("train"),


# A round's rollout and train metric lines are outputs of the rule pair that writes its
# stage folder (kept or transient). The summary and the targets ask for a kept round's lines
# by name: the kept rule makes them (a transient round's are never asked for by name).
ruleorder: rollout > rollout_transient
ruleorder: train > train_transient
