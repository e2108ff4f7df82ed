# A prompt pool's conditioning, encoded once by the text encoders alone (no transformer, no
# VAE) for every run and round that samples from it (workflow.encode_prompts; see
# POOLS in common.smk).


rule encode:
    input:
        unpack(encode_inputs),
    output:
        directory(POOL),
    log:
        f"{LOGS}/conditioning/{{pool}}.log",
    benchmark:
        f"{BENCHMARKS}/conditioning/{{pool}}.tsv"
    wildcard_constraints:
        pool=_alternatives(POOLS),
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=8000,
        runtime=60,
        gpu=encode_gpus,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        settings=encode_settings,
        prompts=encode_source,
        column=encode_column,
        # What this job reads of the config: Snakemake reruns it when a value changes.
        digest=encode_digest,
    shell:
        "OMP_NUM_THREADS={threads} {params.python:q} -m jagg_pipeline encode"
        " {params.settings:q} --prompts {params.prompts:q} {params.column:q}"
        " --out {output:q} > {log:q} 2>&1"
