"""The paper presets (presets/*.yaml): valid as shipped, every value sourced, one round each.

A preset is a complete workflow config (the package's sections + a ``workflow`` section with one
experiment, ``paper``: exact vs JAGG at jagg_frac 0.6). The fast tests read the files as shipped;
the end-to-end test replaces only what cannot run here (the hub checkpoints and reward models by
tiny ones of the same classes, CUDA by the CPU) and the sizes (images, groups, prompts,
evaluation), keeping every gradient setting (step family, noise level, trajectory kind, trained
steps, window W, jagg_frac, GRPO clip, LoRA or full, mixed precision), then runs round 0 of both
variants through the stage functions the workflow's jobs call.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from reward_models import tiny_models
from stage_helpers import EVAL_PROMPTS, tiny_checkpoint, write_prompts

from jagg_pipeline.config import run as config_module
from jagg_pipeline.config.fields import to_dict
from jagg_pipeline.config.yaml_io import read_yaml
from jagg_pipeline.toyworld.tiny import TINY_IMAGE_SIZE
from jagg_pipeline.workflow.checks import check_runs
from jagg_pipeline.workflow.experiments import resolve_runs
from jagg_pipeline.workflow.sections import split

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a preset is, and the routing of its trajectory: windows of W, round(0.6 n) routed."""

    family: str
    path: str
    rewards: tuple[str, ...]
    step: str
    trajectory: str
    windows: int
    routed: int


EXPECTED = {
    "flux-dancegrpo-hpsv21": Expected(
        "flux", "black-forest-labs/FLUX.1-dev", ("hpsv21",), "dance_grpo", "full", 3, 2
    ),
    "sd35m-flowgrpofast-pickscore": Expected(
        "sd3", "stabilityai/stable-diffusion-3.5-medium", ("pickscore",), "flow_grpo", "segment",
        2, 1,
    ),
    "qwenimage-hpsv21-pickscore": Expected(
        "qwenimage", "Qwen/Qwen-Image", ("hpsv21", "pickscore"), "flow_grpo", "full", 3, 2
    ),
}  # fmt: skip
# The sections a preset writes out in full (no field silently left to a dataclass default).
COMPLETE_SECTIONS = {
    "backbone": config_module.BackboneConfig,
    "sampler": config_module.SamplerConfig,
    "advantage": config_module.AdvantageConfig,
    "grpo": config_module.GRPOConfig,
    "jagg": config_module.JaggConfig,
    "train": config_module.TrainConfig,
    "eval": config_module.EvalConfig,
    "tracking": config_module.TrackingConfig,
}
# The package's sections: every value set there carries a comment naming its source.
SOURCED_SECTIONS = (*COMPLETE_SECTIONS, "rewards")
# Columns of a score table besides the rewards' own.
SCORE_TABLE_FIXED = {
    "sample", "prompt_id", "group", "total", "advantage", "group_mean", "group_std",
}  # fmt: skip


def load_preset(name: str) -> dict:
    return read_yaml(PRESETS_DIR / f"{name}.yaml")


def test_the_presets_are_the_three_paper_settings():
    assert sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) == sorted(EXPECTED)
    assert (PRESETS_DIR / "README.md").is_file()


# --------------------------------------------------------------------------------------------
# As shipped: valid, complete, sourced (no model, prompt file or GPU needed)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_resolves_as_shipped_without_touching_a_file(name, tmp_path, monkeypatch):
    data = load_preset(name)
    monkeypatch.chdir(tmp_path)  # none of the preset's relative paths exists here
    runs = resolve_runs(data)
    assert not any(tmp_path.iterdir())  # resolving wrote nothing and needed nothing

    assert {run.experiment for run in runs.values()} == {"paper"}
    assert data["workflow"]["comparison"] == ["paper"]
    assert data["workflow"]["results"] == f"results/{name}"
    by_variant = {run.variant: run for run in runs.values()}
    assert sorted(by_variant) == ["exact", "jagg"]
    exact, jagg = by_variant["exact"].config, by_variant["jagg"].config
    assert (exact.jagg.mode, jagg.jagg.mode, jagg.jagg.jagg_frac) == ("exact", "jagg", 0.6)
    # The variants differ in the gradient engine only.
    one, other = to_dict(exact), to_dict(jagg)
    one["jagg"].pop("mode"), other["jagg"].pop("mode")
    assert one == other

    expected = EXPECTED[name]
    backbone = jagg.backbone
    assert (backbone.family, backbone.path, backbone.device) == (
        expected.family,
        expected.path,
        "cuda",
    )
    assert tuple(jagg.rewards.weights) == expected.rewards
    assert set(jagg.eval.metrics) <= set(jagg.rewards.weights)
    assert (jagg.sampler.step, jagg.sampler.trajectory) == (expected.step, expected.trajectory)
    trained = jagg.trained_steps_at_most()
    assert -(-trained // jagg.jagg.window) == expected.windows
    assert round(0.6 * expected.windows) == expected.routed
    assert jagg.tracking.backend == "mlflow" and name in jagg.tracking.mlflow_experiment
    # One block job per evaluation interval, which keeps its checkpoint.
    run = by_variant["jagg"]
    assert run.rounds_per_job == jagg.eval.every == run.keep_every
    every, rounds = jagg.eval.every, jagg.train.rounds
    assert [block.stop for block in run.blocks] == sorted(
        {*range(every, rounds + 1, every), rounds}
    )
    assert all(block[-1] in run.kept_rounds for block in run.blocks)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_writes_every_key_of_its_sections(name):
    """A user's config file replaces config.yaml: a key left out would take the dataclass
    default (the toy world's, for some), so a preset spells every one out."""
    data = load_preset(name)
    for section, cls in COMPLETE_SECTIONS.items():
        keys = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        assert set(data[section]) == keys, (section, keys ^ set(data[section]))
    for reward in data["rewards"]["weights"]:
        spec = type(config_module.RewardsConfig().spec(reward))
        assert set(data["rewards"][reward]) == {f.name for f in dataclasses.fields(spec)}


def _value_lines(text: str) -> list[tuple[str, int, str]]:
    """(top-level section, line number, line) of every indented key line holding a value."""
    section, found = None, []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            section = line.split(":", 1)[0]
            continue
        key_value = re.match(r"\s+[\w.-]+:(.*)$", line)
        if key_value is None:
            continue
        value = key_value.group(1).split("#", 1)[0].strip()
        if value:  # a leaf (a nested mapping's header line holds no value)
            found.append((section, number, line))
    return found


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_value_names_its_source(name):
    text = (PRESETS_DIR / f"{name}.yaml").read_text()
    lines = [(s, n, line) for s, n, line in _value_lines(text) if s in SOURCED_SECTIONS]
    assert {s for s, _, _ in lines} == set(SOURCED_SECTIONS)
    for section, number, line in lines:
        comment = line.split("#", 1)[1].strip() if "#" in line else ""
        assert len(comment) >= 10, f"{name}.yaml:{number} ({section}) names no source: {line}"
    jagg_frac = [line for s, _, line in lines if s == "jagg" and "jagg_frac:" in line]
    assert len(jagg_frac) == 1 and "JAGG paper" in jagg_frac[0]
    # What the user must change is marked: the checkpoint, the reward models, the prompt files.
    edit = [line.split(":", 1)[0].strip() for _, _, line in lines if "EDIT" in line]
    assert {"path", "prompts"} <= set(edit)


# --------------------------------------------------------------------------------------------
# One round of each variant, end to end, on tiny models of the same classes
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    """The tiny real-format reward models: an open_clip HPS checkpoint, a CLIP for PickScore."""
    models = tiny_models(tmp_path_factory.getbasetemp())
    return {
        "hpsv21": {"checkpoint": str(models.hps_checkpoint), "arch": str(models.hps_arch_json)},
        "pickscore": {"model": str(models.hf_clip_dir), "processor": str(models.hf_clip_dir)},
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("preset-checkpoints")


def shrink(data: dict, checkpoint: Path, rewards: dict, prompts: Path, results: Path) -> dict:
    """The preset on tiny models and the CPU, with every gradient setting left as it is.

    Changed: the checkpoint (a tiny pipeline of the family), image size and text tokens (the
    tiny models' own), device (CPU) and dtype (float32; bf16 mixed precision stays on: it runs
    on the CPU too), the reward models (tiny ones of the same formats), groups of 2 and 2
    prompts a round (so the preset's 2 optimizer steps still get one micro-batch each, on one
    process), the prompt files, the evaluation's size, tracking (off) and the results folder.
    Kept: num_steps, step family and noise level, trajectory, trained_fraction / window, jagg
    (mode, W, jagg_frac, probes), GRPO clip, advantages, optimizer, LoRA settings, CFG, guidance.
    """
    data = copy.deepcopy(data)
    data["backbone"].update(
        path=str(checkpoint),
        height=TINY_IMAGE_SIZE,
        width=TINY_IMAGE_SIZE,
        device="cpu",
        dtype="float32",
        max_sequence_length=16,
    )
    data["sampler"].update(prompts=str(prompts), group_size=2, prompts_per_round=2, batch_size=2)
    data["train"].update(nproc=1)
    data["eval"].update(prompts=str(prompts), max_prompts=2, samples_per_prompt=1, num_steps=4)
    for name in {*data["rewards"]["weights"], *data["eval"]["metrics"]}:
        data["rewards"][name].update(rewards[name])
    data["tracking"] = {"backend": "none"}
    data["workflow"]["results"] = str(results)
    return data


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_on_tiny_real_format_models_passes_the_checks_before_any_job(
    name, tmp_path, checkpoints, rewards
):
    """The checkpoint's settings (Flux's guidance embedding, QwenImage's CFG), the reward
    model files by their headers (an open_clip HPS checkpoint, a transformers CLIP folder)."""
    checkpoint = tiny_checkpoint(EXPECTED[name].family, checkpoints)
    prompts = write_prompts(tmp_path / "prompts.txt", EVAL_PROMPTS)
    data = shrink(load_preset(name), checkpoint, rewards, prompts, tmp_path / "results")
    assert check_runs(resolve_runs(data).values(), split(data)[1]) == []


def _score_columns(scores: Path) -> set[str]:
    from jagg_pipeline.stages.scoring import table_path

    return set(pq.read_schema(table_path(scores)).names) - SCORE_TABLE_FIXED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_runs_one_round_of_each_variant(name, tmp_path, checkpoints, rewards):
    from jagg_pipeline.stages.evaluate import run_evaluate
    from jagg_pipeline.stages.rollout import run_rollout
    from jagg_pipeline.stages.scoring import run_score
    from jagg_pipeline.stages.train import train_round

    expected = EXPECTED[name]
    preset = load_preset(name)
    checkpoint = tiny_checkpoint(expected.family, checkpoints)
    prompts = write_prompts(tmp_path / "prompts.txt", EVAL_PROMPTS)
    data = shrink(preset, checkpoint, rewards, prompts, tmp_path / "results")
    runs = {run.variant: run for run in resolve_runs(data).values()}
    assert sorted(runs) == ["exact", "jagg"]

    backward_calls = {}
    for variant, run in runs.items():
        config, directory = run.config, Path(run.directory)
        # What the shrinking kept: the preset's gradient settings.
        for section in ("jagg", "grpo", "advantage"):
            assert to_dict(getattr(config, section)) == {
                **preset[section],
                **preset["workflow"]["experiments"]["paper"]["variants"][variant].get(section, {}),
            }
        for key in ("num_steps", "step", "noise_level", "trajectory", "trained_fraction"):
            assert getattr(config.sampler, key) == preset["sampler"][key], key
        assert config.backbone.mixed_precision == preset["backbone"]["mixed_precision"]
        assert config.backbone.training == preset["backbone"]["training"]

        rollout = directory / "round-0000" / "rollout"
        scores = directory / "round-0000" / "scores"
        checkpoint_dir = directory / "round-0000" / "checkpoint"
        run_rollout(config, "base", config.sampler.prompts, rollout, progress=False)
        run_score(config, rollout, scores)
        assert _score_columns(scores) == set(expected.rewards)

        result = train_round(config, "base", rollout, scores, checkpoint_dir, progress=False)
        assert (checkpoint_dir / "manifest.json").is_file()
        assert (checkpoint_dir / "policy").is_dir()
        assert len(result.metrics) == config.train.minibatches
        assert not any(row["skipped"] for row in result.metrics)
        first = result.metrics[0]
        routed = first["routing"]["routed"]
        assert len(routed) == expected.windows
        if variant == "jagg":  # round(0.6 x windows), the high-noise ones first
            count = round(0.6 * len(routed))
            assert count == expected.routed
            assert routed == [True] * count + [False] * (len(routed) - count)
        else:
            assert not any(routed)
        modes = [window["mode"] for window in first["windows"]]
        assert modes == ["jagg" if r else "exact" for r in routed]
        backward_calls[variant] = first["backward_calls"]
        # probe_every: round 0 measures every window's cos-sim for the report's heatmap.
        assert len(first["probe"]) == expected.windows

        report = run_evaluate(
            config, checkpoint_dir, directory / "eval" / "trained-0001", progress=False
        )
        assert (directory / "eval" / "trained-0001" / "metrics.json").is_file()
        assert set(report["metrics"]) == set(config.eval.metrics)
        for values in report["metrics"].values():
            assert math.isfinite(values["mean"])
    assert backward_calls["jagg"] < backward_calls["exact"]  # 2 per routed window instead of W
