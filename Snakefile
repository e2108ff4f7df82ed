# jagg-pipeline: GRPO rounds of a text-to-image DiT with JAGG gradients, as a DAG.
#
# config.yaml holds the base experiment (the package's sections) and `workflow.experiments`:
# each experiment is a target rule of this file; its runs (variant x seed) live under
# results/<experiment>/<variant>/seed-<s>/. See docs/workflow.md.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config.yaml"


# common.smk resolves every run first (errors name the experiment, variant and key); the
# committed schema is the contract other tools read, checked as well.
include: "workflow/rules/common.smk"


validate(config, "workflow/schemas/config.schema.json")


onstart:
    write_run_files(workflow.dag)


include: "workflow/rules/toyworld.smk"
include: "workflow/rules/encode.smk"


# A run's rounds: each as its rollout, score and train jobs, or in blocks of
# workflow.rounds_per_job rounds, one job each.
if WORKFLOW.rounds_per_job == 1:

    include: "workflow/rules/rollout.smk"
    include: "workflow/rules/score.smk"
    include: "workflow/rules/train.smk"

else:

    include: "workflow/rules/block.smk"


include: "workflow/rules/evaluate.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/track.smk"
include: "workflow/rules/bench.smk"


localrules:
    bench,
    comparison,
    track,
    compare,


rule bench:
    """The speed benchmark: results/bench/{bench.json, bench.csv, speedup.png}."""
    input:
        rules.bench_update.output,


rule comparison:
    """The comparison of every experiment named in workflow.comparison, read back from MLflow
    (results/comparison/<experiment>/index.html)."""
    input:
        comparison_inputs,


# One target rule per experiment and evaluation of the config, named as it is: `snakemake
# NAME` runs it (tracked, after its summary). The default target is `all` when it exists,
# else the config's first experiment (never the benchmark, the first rule of this file).
_TARGETS = [*WORKFLOW.experiments, *WORKFLOW.evaluations]
_DEFAULT_TARGET = "all" if "all" in _TARGETS else next(iter(_TARGETS), None)
for _name in _TARGETS:
    if _name in {rule.name for rule in workflow.rules}:
        raise ValueError(
            f"workflow: the target {_name!r} is also a rule of the workflow "
            f"({', '.join(sorted(rule.name for rule in workflow.rules))}); rename the "
            "experiment or evaluation"
        )

    rule:
        name:
            _name
        default_target: _name == _DEFAULT_TARGET
        input:
            experiment_target(_name),
        localrule: True
