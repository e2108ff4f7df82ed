# The embedded toy world: the toy CLIP once, then one pretrained toy DiT per family that a
# run's backbone.path points at (<toyworld root>/<family>). A family's pretraining needs no
# CLIP, so it is a job of its own that runs beside the CLIP's; the backbone job then scores
# its samples with the CLIP and writes the checkpoint and report.


rule toyworld_clip:
    output:
        directory(f"{TOYWORLD}/clip"),
    log:
        f"{LOGS}/toyworld/clip.log",
    benchmark:
        f"{BENCHMARKS}/toyworld/clip.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
        gpu=0,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        root=parent_folder,
        seed=WORKFLOW.toyworld.seed,
        clip_steps=WORKFLOW.toyworld.clip_steps,
    shell:
        "OMP_NUM_THREADS={threads} {params.python:q} -m jagg_pipeline toyworld clip"
        " --out {params.root:q} --seed {params.seed} --clip-steps {params.clip_steps} --quiet"
        " > {log:q} 2>&1"


rule toyworld_pretrain:
    output:
        temp(directory(f"{TOYWORLD}/pretrain-{{family}}")),
    log:
        f"{LOGS}/toyworld/pretrain-{{family}}.log",
    benchmark:
        f"{BENCHMARKS}/toyworld/pretrain-{{family}}.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
        gpu=0,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        root=parent_folder,
        seed=WORKFLOW.toyworld.seed,
        steps=WORKFLOW.toyworld.steps,
        batch=WORKFLOW.toyworld.batch,
        clip_steps=WORKFLOW.toyworld.clip_steps,
    shell:
        "OMP_NUM_THREADS={threads} {params.python:q} -m jagg_pipeline toyworld pretrain"
        " --out {params.root:q} --backbone {wildcards.family:q} --seed {params.seed}"
        " --steps {params.steps} --batch {params.batch} --clip-steps {params.clip_steps}"
        " --quiet > {log:q} 2>&1"


rule toyworld_backbone:
    input:
        clip=f"{TOYWORLD}/clip",
        pretrained=f"{TOYWORLD}/pretrain-{{family}}",
    output:
        checkpoint=directory(f"{TOYWORLD}/{{family}}"),
        report=f"{TOYWORLD}/report-{{family}}.json",
        samples=report(
            f"{TOYWORLD}/samples-{{family}}.png",
            caption="../report/toyworld.rst",
            category="toy world",
        ),
        loss=f"{TOYWORLD}/loss-{{family}}.png",
    log:
        f"{LOGS}/toyworld/{{family}}.log",
    benchmark:
        f"{BENCHMARKS}/toyworld/{{family}}.tsv"
    conda:
        "../../envs/pipeline.yaml"
    container:
        CONTAINERS.pipeline
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
        gpu=0,
        cpus_per_task=task_cpus,
    params:
        python=PYTHON,
        root=parent_folder,
        seed=WORKFLOW.toyworld.seed,
        steps=WORKFLOW.toyworld.steps,
        batch=WORKFLOW.toyworld.batch,
        clip_steps=WORKFLOW.toyworld.clip_steps,
    shell:
        "OMP_NUM_THREADS={threads} {params.python:q} -m jagg_pipeline toyworld build"
        " --out {params.root:q} --backbone {wildcards.family:q} --seed {params.seed}"
        " --steps {params.steps} --batch {params.batch} --clip-steps {params.clip_steps}"
        " --quiet > {log:q} 2>&1"
