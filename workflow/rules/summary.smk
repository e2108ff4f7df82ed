# An experiment's runs compared: one metrics table (what the tracking rule pushes), the
# markdown table and the curves.


rule summary:
    input:
        summary_inputs,
    output:
        table=report(
            f"{SUMMARY}/table.md",
            caption="../report/table.rst",
            category="comparison",
            subcategory="{experiment}",
        ),
        curves=report(
            f"{SUMMARY}/curves.png",
            caption="../report/curves.rst",
            category="comparison",
            subcategory="{experiment}",
        ),
        grids=report(
            directory(f"{SUMMARY}/grids"),
            patterns=["{name}.png"],
            caption="../report/grids.rst",
            category="evaluation grids",
            subcategory="{experiment}",
        ),
        metrics=f"{SUMMARY}/metrics.jsonl",
        summary=f"{SUMMARY}/summary.json",
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
