# Every configured reward on a round's rollout (kept or transient), and the group advantages;
# its metric lines are kept in round-<r>/metrics/score.jsonl.


rule score:
    input:
        unpack(score_inputs),
    output:
        scores=directory(f"{RUN_ROUND}/scores"),
        metrics=round_record("score"),
    log:
        f"{LOGS}/{JOB_ROUND}/score.log",
    benchmark:
        f"{BENCHMARKS}/{JOB_ROUND}/score.tsv"
    group:
        SAMPLE_GROUP
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=8000,
        runtime=30,
        gpu=score_gpus,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        config=run_config_file,
        device=reward_device,
        # What this job reads of the config: Snakemake reruns it when a value changes.
        digest=score_digest,
    shell:
        "OMP_NUM_THREADS={threads} {params.python:q} -m jagg_pipeline score"
        " --config {params.config:q} --rollouts {input.rollouts:q} --device {params.device:q}"
        " --out {output.scores:q} > {log:q} 2>&1"
        " && cp {output.scores:q}/metrics.jsonl {output.metrics:q} 2>> {log:q}"
