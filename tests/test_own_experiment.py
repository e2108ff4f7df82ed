"""A researcher's own experiment: their config file, their targets, evaluation runs.

The user's file replaces config.yaml (keys it leaves out take the package's defaults), a set
it names (reward weights, variants) is never merged with the default's, every experiment and
evaluation is a target under its name, and a dry run writes nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from stage_helpers import tiny_checkpoint
from workflow_helpers import REDUCED, comparable_outputs, copy_run, snakemake, write_config

from jagg_pipeline.config.fields import ConfigError
from jagg_pipeline.io.tables import read_table
from jagg_pipeline.stages.scoring import table_path
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.sections import merge

# The tiny experiment on a tiny SD3 checkpoint (no toy world to build): 1 round, 2 groups.
TINY = {
    "backbone": {"height": 32, "width": 32, "dtype": "float32", "max_sequence_length": 16},
    "sampler": {
        "num_steps": 4,
        "group_size": 2,
        "prompts_per_round": 2,
        "batch_size": 4,
        "segment_steps": 2,
        "segment_start": [0, 1],
    },
    "jagg": {"window": 2},
    "eval": {"max_prompts": 2, "samples_per_prompt": 1, "num_steps": 3, "every": 1},
    "tracking": {"backend": "none"},
}


def _own_config(tmp_path: Path, **sections) -> dict:
    data = merge(
        TINY, {"backbone": {"family": "sd3", "path": str(tiny_checkpoint("sd3", tmp_path))}}
    )
    return merge(data, sections)


# 1. merge semantics ---------------------------------------------------------------------------


def test_a_set_named_by_a_later_layer_replaces_the_earlier_one():
    default = {"rewards": {"weights": {"toy_attributes": 1.0}, "device": None}}
    mine = {"rewards": {"weights": {"hpsv21": 1.0, "pickscore": 0.5}}}
    assert merge(default, mine)["rewards"] == {
        "weights": {"hpsv21": 1.0, "pickscore": 0.5},
        "device": None,
    }
    # The same inside an experiment: a variant's weights are the weights.
    data = {
        "rewards": {"weights": {"toy_attributes": 1.0}},
        "workflow": {
            "experiments": {
                "e": {"variants": {"hps": {"rewards": {"weights": {"jpeg_compressibility": 1}}}}}
            }
        },
    }
    (run,) = resolve_runs(data).values()
    assert run.config.rewards.weights == {"jpeg_compressibility": 1.0}


def _swap(**experiment) -> dict:
    """A workflow config with a backbone x mode cross named ``swap`` (``experiment`` added)."""
    cross = {
        "backbone": {"sd3": {}, "flux": {"backbone": {"family": "flux", "path": "p/flux"}}},
        "mode": {"exact": {"jagg": {"mode": "exact"}}, "jagg": {}},
    }
    swap = {"variants": {"base": {}}, "cross": cross, **experiment}
    return {"workflow": {"experiments": {"swap": swap}}}


def test_cross_groups_make_a_variant_per_combination():
    runs = resolve_runs(_swap(sweep={"key": "jagg.window", "values": [2, 4]}))
    variants = sorted(run.variant for run in runs.values())
    assert variants == sorted(
        f"{b}_{m}_window-{w}" for b in ("sd3", "flux") for m in ("exact", "jagg") for w in (2, 4)
    )
    flux = runs["swap/flux_exact_window-4/seed-0"].config
    assert (flux.backbone.family, flux.jagg.mode, flux.jagg.window) == ("flux", "exact", 4)


def test_crossed_names_that_collide_are_refused():
    data = {
        "workflow": {
            "experiments": {
                "e": {"variants": {"a": {}, "a_b": {}}, "cross": {"g": {"b_c": {}, "c": {}}}}
            }
        }
    }
    with pytest.raises(ConfigError, match=r"experiments\.e: two combinations are both named"):
        resolve_runs(data)


@pytest.mark.parametrize("name", ["comparison", "toyworld", "bench", "score", "my-exp"])
def test_target_names_that_are_folders_or_no_rule_names_are_refused(name):
    data = {"workflow": {"experiments": {name: {}}}}
    with pytest.raises(ConfigError, match=rf"workflow\.experiments\.{name}"):
        resolve_runs(data)


def test_an_evaluation_crosses_policies_prompt_sets_and_noise_seeds():
    checkpoint = "results/all/jagg/seed-0/round-0003/checkpoint"
    data = {
        "workflow": {
            "evaluations": {
                "heldout": {
                    "policies": {"base": {}, "trained": {"checkpoint": checkpoint}},
                    "prompts": {"toy": {}, "train": {"prompts": "toy:train", "max_prompts": 5}},
                    "metrics": ["jpeg_compressibility"],
                    "seeds": [7, 8],
                }
            }
        }
    }
    runs = resolve_runs(data)
    assert len(runs) == 8
    trained = runs["heldout/trained_train/seed-8"]
    assert trained.policy == checkpoint and trained.evaluated_rounds == [0]
    assert trained.config.eval.seed == 8 and trained.config.eval.max_prompts == 5
    assert trained.config.eval.metrics == ["jpeg_compressibility"]
    assert runs["heldout/base_toy/seed-7"].policy == "base"


# 2. the workflow: own file, own targets, a dry run that writes nothing ---------------------


def test_a_users_config_file_defines_the_experiment_and_its_targets(tmp_path):
    """--configfile replaces config.yaml: its reward weights are exactly those scored (the
    default's toy_attributes is not added), and its experiment is a target by its name."""
    from reward_models import tiny_models

    models = tiny_models(tmp_path)
    write_config(tmp_path, REDUCED)  # the project's default, with toy rewards
    mine = _own_config(
        tmp_path,
        rewards={
            "weights": {"hpsv21": 1.0, "pickscore": 1.0},
            "hpsv21": {"checkpoint": str(models.hps_checkpoint), "arch": str(models.hps_arch_json)},
            "pickscore": {"model": str(models.hf_clip_dir), "processor": str(models.hf_clip_dir)},
        },
        eval={"metrics": ["pickscore"]},
        workflow={
            "experiments": {
                "myexp": {"overrides": {"train": {"rounds": 1}}, "variants": {"jagg": {}}}
            }
        },
    )
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(mine))
    done = snakemake(tmp_path, "--cores", "2", "myexp", f"--configfile={tmp_path / 'mine.yaml'}")
    assert done.returncode == 0, done.stderr[-3000:]
    scores = tmp_path / "results/myexp/jagg/seed-0/round-0000/scores"
    columns = set(read_table(table_path(scores))[0])
    assert {"hpsv21", "pickscore"} <= columns and "toy_attributes" not in columns
    assert (tmp_path / "results/myexp/tracking/tracked.json").is_file()


def test_the_workflows_rules_are_the_reserved_names(tmp_path):
    """Every rule of the workflow but the targets is read by names.workflow_rules, which
    config check and the workflow refuse as target names: the rules of single rounds and
    those of blocks (workflow.rounds_per_job), which replace rollout, score and train."""
    from jagg_pipeline.workflow.names import workflow_rules

    rules = {}
    for rounds_per_job in (1, 2):
        data = copy.deepcopy(REDUCED)
        data["workflow"]["rounds_per_job"] = rounds_per_job
        write_config(tmp_path, data)
        done = snakemake(tmp_path, "--list-rules")
        assert done.returncode == 0, done.stderr[-3000:]
        listed = {line.split()[0] for line in done.stdout.splitlines() if line[:1].isalpha()}
        rules[rounds_per_job] = listed - {"all"}
    assert rules[1] | rules[2] == set(workflow_rules())
    single = {"rollout", "rollout_transient", "score", "train", "train_transient"}
    assert rules[1] - rules[2] == single and rules[2] - rules[1] == {"block", "block_transient"}


def test_a_dry_run_writes_nothing(tmp_path, reduced_all):
    fresh = tmp_path / "fresh"
    write_config(fresh, REDUCED)
    done = snakemake(fresh, "-n", "all")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (fresh / "results").exists()

    used = tmp_path / "used"
    copy_run(reduced_all, used)
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in (used / "results").rglob("*")}
    # Another device in a dry run (what rewrote configs that running jobs read).
    done = snakemake(used, "-n", "all", "--config", "backbone={device: meta}")
    assert done.returncode == 0, done.stderr[-3000:]
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in (used / "results").rglob("*")}
    assert after == before


def test_an_evaluation_target_runs_and_reruns_byte_identically(tmp_path):
    config = _own_config(
        tmp_path,
        eval={"metrics": ["jpeg_compressibility"]},
        rewards={"weights": {"jpeg_compressibility": 1.0}},
        workflow={
            "evaluations": {
                "check": {
                    "policies": {"base": {}},
                    "prompts": {"train": {"prompts": "toy:train"}, "heldout": {}},
                    "seeds": [1],
                }
            }
        },
    )
    write_config(tmp_path, config)
    done = snakemake(tmp_path, "--cores", "2", "check")
    assert done.returncode == 0, done.stderr[-3000:]
    first = comparable_outputs(tmp_path)
    assert any(key.startswith("check/heldout/seed-1/eval/trained-0000/") for key in first)
    table = (tmp_path / "results/check/summary/table.md").read_text()
    assert "| variant | seeds | jpeg_compressibility |" in table and "-> final" not in table
    done = snakemake(tmp_path, "--cores", "2", "check", "--forcerun", "evaluate")
    assert done.returncode == 0, done.stderr[-3000:]
    assert comparable_outputs(tmp_path) == first


def test_the_comparison_pairs_each_variant_with_the_exact_variant_set_up_alike(tmp_path):
    """In a backbone x mode cross, flux_jagg's speed-up is over flux_exact, not over sd3's
    (or a variant that happens to be called exact)."""
    from jagg_pipeline.config.fields import to_dict
    from jagg_pipeline.reports.compare import exact_twins
    from jagg_pipeline.reports.summary import read_run

    runs = []
    for run in resolve_runs(_swap(seeds=[0, 1])).values():
        folder = tmp_path / run.run_id
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(to_dict(run.config)))
        runs.append(read_run(folder, run.variant, run.seed))
    assert exact_twins(runs) == {
        "sd3_exact": "sd3_exact",
        "sd3_jagg": "sd3_exact",
        "flux_exact": "flux_exact",
        "flux_jagg": "flux_exact",
    }
