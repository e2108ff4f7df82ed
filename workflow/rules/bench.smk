# The speed benchmark (`python -m jagg_pipeline bench`): the update stage of every gradient
# mode timed side by side, a whole round, reduce-scatter counts. Not part of `all`; run it
# with `snakemake bench` (on a GPU node under SLURM when backbone.device is cuda).


rule bench_update:
    output:
        json=f"{RESULTS}/bench/bench.json",
        csv=f"{RESULTS}/bench/bench.csv",
        png=report(
            f"{RESULTS}/bench/speedup.png",
            caption="../report/bench.rst",
            category="speed (benchmark)",
        ),
    log:
        f"{LOGS}/bench.log",
    benchmark:
        f"{BENCHMARKS}/bench.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    # Timing runs on one thread; the reduce-scatter count starts two gloo processes.
    threads: 2
    resources:
        mem_mb=8000,
        runtime=120,
        gpu=bench_gpus,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        device=bench_device(),
        out=parent_folder,
    shell:
        "{params.python:q} -m jagg_pipeline bench --device {params.device:q}"
        " --out {params.out:q} > {log:q} 2>&1"
