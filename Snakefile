# jagg-pipeline: GRPO rounds of a text-to-image DiT with JAGG gradients, as a DAG.
#
# config.yaml holds the base experiment (the package's sections) and `workflow.experiments`:
# each experiment is a target rule of this file; its runs (variant x seed) live under
# results/<experiment>/<variant>/seed-<s>/. See README.md ("The workflow").
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config.yaml"


# common.smk resolves every run first (errors name the experiment, variant and key); the
# committed schema is the contract other tools read, checked as well.
include: "workflow/rules/common.smk"


validate(config, "workflow/schemas/config.schema.json")


include: "workflow/rules/toyworld.smk"
include: "workflow/rules/rollout.smk"
include: "workflow/rules/score.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/track.smk"
include: "workflow/rules/bench.smk"


localrules:
    all,
    compare_modes,
    ablation_no_interp,
    sweep_jagg_frac,
    sweep_window,
    sweep_backbone,
    bench,
    report,
    track,
    compare,


rule all:
    """The default: exact vs JAGG vs the no-interpolation ablation, a few rounds."""
    input:
        experiment_target("all"),


rule compare_modes:
    """The same three modes at the RL testbed's length, 3 seeds."""
    input:
        experiment_target("compare_modes"),


rule ablation_no_interp:
    """JAGG against its no-interpolation ablations (drop, nearest)."""
    input:
        experiment_target("ablation_no_interp"),


rule sweep_jagg_frac:
    """The fraction of windows routed to JAGG, 0 (exact) to 1."""
    input:
        experiment_target("sweep_jagg_frac"),


rule sweep_window:
    """The JAGG window W."""
    input:
        experiment_target("sweep_window"),


rule sweep_backbone:
    """JAGG on each toy backbone family."""
    input:
        experiment_target("sweep_backbone"),


rule bench:
    """The speed benchmark: results/bench/{bench.json, bench.csv, speedup.png}."""
    input:
        rules.bench_update.output,


rule report:
    """The comparison of every experiment named in workflow.report, read back from MLflow
    (results/report/<experiment>/index.html)."""
    input:
        report_inputs,
