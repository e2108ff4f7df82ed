# Each run's resolved config.yaml and overrides.yaml, written by a job (never while the
# Snakefile is parsed, so a dry run writes nothing). Its params digest what it writes: an edit
# rewrites the files of the runs it changes; the stage jobs take them as ancient inputs and
# rerun by their own section digests only.


rule run_config:
    output:
        config=f"{RUN}/config.yaml",
        overrides=f"{RUN}/overrides.yaml",
    log:
        f"{LOGS}/{JOB}/config.log",
    localrule: True
    params:
        digest=run_files_digest,
    run:
        write_run_files(wildcards, output)
