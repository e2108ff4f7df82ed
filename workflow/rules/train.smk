# One GRPO round on a scored rollout; its checkpoint is the next round's policy.


rule train:
    input:
        unpack(train_inputs),
    output:
        directory(f"{RUN}/round-{{round}}/checkpoint"),
    log:
        f"{LOGS}/{JOB}/round-{{round}}/train.log",
    benchmark:
        f"{BENCHMARKS}/{JOB}/round-{{round}}/train.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    # One core per process (torchrun starts train.nproc of them), each on one OpenMP thread.
    threads: train_threads
    resources:
        mem_mb=16000,
        runtime=120,
        gpu=train_gpus,
        cpus_per_task=task_cpus,
    params:
        config=run_config_file,
        policy=rollout_policy,
        device=backbone_device,
        launcher=train_launcher,
        digest=train_digest,
    shell:
        "OMP_NUM_THREADS=1 {params.launcher} -m jagg_pipeline train"
        " --config {params.config} --set backbone.device={params.device}"
        " --policy {params.policy} --rollouts {input.rollouts} --rewards {input.scores}"
        " --out {output} > {log} 2>&1"
