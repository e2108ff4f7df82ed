# Held-out evaluation of the policy after `trained` rounds (0: the base policy).


rule evaluate:
    input:
        unpack(evaluate_inputs),
    output:
        metrics=directory(f"{RUN}/eval/{EVALUATION_PREFIX}{{trained}}"),
    log:
        f"{LOGS}/{JOB}/eval/{EVALUATION_PREFIX}{{trained}}.log",
    benchmark:
        f"{BENCHMARKS}/{JOB}/eval/{EVALUATION_PREFIX}{{trained}}.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=evaluate_gpus,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        config=run_config_file,
        policy=evaluate_policy,
        device=backbone_device,
        digest=evaluate_digest,
    shell:
        "OMP_NUM_THREADS={threads} {params.python:q} -m jagg_pipeline evaluate"
        " --config {params.config:q} --set backbone.device={params.device:q}"
        " --policy {params.policy:q} --out {output.metrics:q} > {log:q} 2>&1"
