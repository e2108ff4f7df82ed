# An experiment's finished runs pushed to MLflow (tracking section of the runs' config), then
# read back from it into the comparison report. Both run on the submitting host (localrules):
# a SQLite store is written by one process at a time, never from several cluster nodes.
# track keeps pushed.json beside tracked.json (the runs pushed to each store), not an output:
# Snakemake removes a failed job's outputs, and the ledger must outlive a failed push.


rule track:
    input:
        summary=f"{SUMMARY}/table.md",
        curves=f"{SUMMARY}/curves.png",
    output:
        TRACKED,
    log:
        f"{LOGS}/{{experiment}}/track.log",
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
        # What this job reads of the config: Snakemake reruns it when a value changes.
        digest=tracking_digest,
    shell:
        "{params.python:q} -m jagg_pipeline track --experiment {wildcards.experiment:q}"
        " {params.runs:q} --parent-file {input.summary:q} --parent-file {input.curves:q}"
        " --out {output:q} > {log:q} 2>&1"


rule compare:
    input:
        TRACKED,
    output:
        html=f"{COMPARISON}/index.html",
        table=f"{COMPARISON}/table.md",
        curves=report(
            f"{COMPARISON}/curves.png",
            caption="../report/compare.rst",
            category="comparison (read back from MLflow)",
            subcategory="{experiment}",
        ),
        speed=report(
            f"{COMPARISON}/speed.png",
            caption="../report/speed.rst",
            category="comparison (read back from MLflow)",
            subcategory="{experiment}",
        ),
        cos_sim=report(
            f"{COMPARISON}/cos_sim.png",
            caption="../report/cos_sim.rst",
            category="comparison (read back from MLflow)",
            subcategory="{experiment}",
        ),
    log:
        f"{LOGS}/{{experiment}}/compare.log",
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
        out=parent_folder,
    shell:
        "{params.python:q} -m jagg_pipeline compare --experiment {wildcards.experiment:q}"
        " {params.runs:q} --out {params.out:q} > {log:q} 2>&1"
