# Round r samples a rollout from the policy after r rounds (the base policy at r = 0).


rule rollout:
    input:
        unpack(rollout_inputs),
    output:
        directory(f"{RUN}/round-{{round}}/rollout"),
    log:
        f"{LOGS}/{JOB}/round-{{round}}/rollout.log",
    benchmark:
        f"{BENCHMARKS}/{JOB}/round-{{round}}/rollout.tsv"
    group:
        SAMPLE_GROUP
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=rollout_gpus,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        config=run_config_file,
        policy=rollout_policy,
        device=backbone_device,
        digest=rollout_digest,
    shell:
        "OMP_NUM_THREADS={threads} {params.python} -m jagg_pipeline rollout --config {params.config}"
        " --set backbone.device={params.device} --policy {params.policy} --round {wildcards.round}"
        " --out {output} > {log} 2>&1"
