# An experiment's runs compared: one metrics table (what the tracking rule pushes), the
# markdown table and the curves.


rule summary:
    input:
        summary_inputs,
    output:
        table=report(
            f"{RESULTS}/{{experiment}}/summary/table.md",
            caption="../report/table.rst",
            category="comparison",
            subcategory="{experiment}",
        ),
        curves=report(
            f"{RESULTS}/{{experiment}}/summary/curves.png",
            caption="../report/curves.rst",
            category="comparison",
            subcategory="{experiment}",
        ),
        grids=report(
            directory(f"{RESULTS}/{{experiment}}/summary/grids"),
            patterns=["{name}.png"],
            caption="../report/grids.rst",
            category="evaluation grids",
            subcategory="{experiment}",
        ),
        metrics=f"{RESULTS}/{{experiment}}/summary/metrics.jsonl",
        summary=f"{RESULTS}/{{experiment}}/summary/summary.json",
    log:
        f"{LOGS}/{{experiment}}/summary.log",
    conda:
        "../../envs/summary.yaml"
    container:
        CONTAINERS.summary
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
        gpu=0,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        runs=summary_arguments,
        out=summary_folder,
    shell:
        "{params.python:q} -m jagg_pipeline summarize {params.runs:q}"
        " --title {wildcards.experiment:q} --out {params.out:q} > {log:q} 2>&1"
