import dataclasses
import re
import subprocess
import sys
from typing import get_args

import jsonschema
import pytest
import yaml

from jagg_pipeline.config.fields import ConfigError, digest, from_dict, to_dict
from jagg_pipeline.config.run import (
    REWARD_NAMES,
    BackboneConfig,
    BackboneDtype,
    BackboneFamily,
    LoraConfig,
    RewardDtype,
    RewardsConfig,
    RunConfig,
    load_config,
    schema,
)


def test_importing_the_config_imports_no_heavy_library():
    """Every Snakemake job parses the config at start-up: no torch, diffusers, transformers."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import jagg_pipeline.config.run"],
        capture_output=True,
        text=True,
        check=True,
    )
    # stderr lines: "import time: self [us] | cumulative | <indent>package.module"
    modules = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "jagg_pipeline.config.run" in modules
    tops = {name.split(".")[0] for name in modules}
    assert not tops & {"torch", "diffusers", "transformers", "numpy"}, sorted(tops)


def test_default_config_round_trips_and_validates_against_its_schema():
    default = RunConfig()
    data = to_dict(default)
    assert from_dict(RunConfig, data) == default
    jsonschema.Draft202012Validator(schema()).validate(data)
    assert "key" not in data["backbone"]  # code-only field stays out of files


def test_schema_and_dataclasses_agree_on_every_key():
    """Every dataclass field of every section is in the schema with its default and help, and
    nothing else is."""
    spec = schema()
    seen = []

    def walk(obj, node, where):
        fields = {f.name: f for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
        assert set(node["properties"]) == set(fields), where
        assert node["additionalProperties"] is False, where
        assert node.get("description"), f"{where} has no description"
        for name, f in fields.items():
            prop = node["properties"][name]
            assert prop.get("description"), f"{where}.{name} has no help text"
            assert prop["description"] == f.metadata["help"], f"{where}.{name}"
            for bound, keyword in [
                ("minimum", "minimum"),
                ("maximum", "maximum"),
                ("exclusive_minimum", "exclusiveMinimum"),
            ]:
                assert prop.get(keyword) == f.metadata.get(bound), f"{where}.{name} {keyword}"
            value = getattr(obj, name)
            seen.append(f"{where}.{name}")
            if dataclasses.is_dataclass(value):
                walk(value, prop, f"{where}.{name}")
            else:
                assert prop["default"] == to_dict(value), f"{where}.{name}"

    walk(RunConfig(), spec, "config")
    for section in (f.name for f in dataclasses.fields(RunConfig)):
        assert any(key.startswith(f"config.{section}.") for key in seen), section
    assert "config.backbone.lora.rank" in seen
    assert all(f"config.rewards.{name}" in seen for name in REWARD_NAMES)


def test_bounds_are_in_the_schema_and_the_schema_enforces_them():
    spec = schema()
    frac = spec["properties"]["jagg"]["properties"]["jagg_frac"]
    assert (frac["minimum"], frac["maximum"]) == (0, 1)
    assert spec["properties"]["train"]["properties"]["lr"]["exclusiveMinimum"] == 0
    validator = jsonschema.Draft202012Validator(spec)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"jagg": {"jagg_frac": 1.5}})
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"rewards": {"jpeg_compressibility": {"quality": 0}}})
    validator.validate({"jagg": {"jagg_frac": "auto"}, "train": {"lr": "1e-4"}})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("jagg: {jagg_frac: 1.5}", r"jagg\.jagg_frac: 1\.5 is above the maximum 1$"),
        ("jagg: {window: 1}", r"jagg\.window: 1 is below the minimum 2$"),
        ("advantage: {eps: -1}", r"advantage\.eps: -1\.0 must be above 0$"),
        ("train: {lr: 0}", r"train\.lr: 0\.0 must be above 0$"),
        ("sampler: {noise_level: .inf}", r"sampler\.noise_level: must be a finite number"),
        ("jagg: {jagg_frac: .nan}", r"jagg\.jagg_frac: must be a finite number"),
        ("train: {ema_decay: .inf}", r"train\.ema_decay: must be a finite number"),
        ("train: {minibatches: 0}", r"train\.minibatches: 0 is below the minimum 1$"),
        ("train: {lr: nan}", r"train\.lr: expected a number, got 'nan'"),
        ("train: {lr: inf}", r"train\.lr: expected a number, got 'inf'"),
        ("sampler: {group_size: 1}", r"sampler\.group_size: 1 is below the minimum 2$"),
        ("backbone: {height: 0}", r"backbone\.height: 0 is below the minimum 1$"),
        ("backbone: {lora: {rank: 0}}", r"backbone\.lora\.rank: 0 is below the minimum 1$"),
        ("backbone: {lora: {dropout: 0.3}}", r"backbone\.lora\.dropout: 0\.3 is not supported"),
        (
            "rewards: {jpeg_compressibility: {quality: 100}}",
            r"rewards\.jpeg_compressibility\.quality: 100 is above the maximum 95$",
        ),
        ("rewards: {clipscore: {batch_size: 0}}", r"rewards\.clipscore\.batch_size: 0 is below"),
    ],
)
def test_out_of_bounds_values_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "experiment.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}"):
        load_config(path)


def test_yaml_numbers_without_a_dot_load_as_numbers(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text("train: {lr: 1e-4, weight_decay: 1E2}\ngrpo: {clip_range: 5e-6}\n")
    assert yaml.safe_load(path.read_text())["train"]["lr"] == "1e-4"  # YAML 1.1: a string
    cfg = load_config(path)
    assert cfg.train.lr == 0.0001 and isinstance(cfg.train.lr, float)
    assert (cfg.train.weight_decay, cfg.grpo.clip_range) == (100.0, 5e-6)
    assert load_config(path, ["jagg.jagg_frac=5e-1"]).jagg.jagg_frac == 0.5
    with pytest.raises(ConfigError, match=r"train\.rounds: expected an integer, got '1e3'"):
        load_config(path, ["train.rounds=1e3"])


def test_code_built_sections_check_their_bounds_too():
    with pytest.raises(ConfigError, match=r"^policy\.backbone\.cfg_scale: 0\.5 is below"):
        BackboneConfig("flux", "x", cfg_scale=0.5, key="policy.backbone")
    with pytest.raises(ValueError, match=r"backbone\.dtype must be one of"):
        BackboneConfig("flux", "x", dtype="float8")
    with pytest.raises(ConfigError, match=r"lora\.rank: 0 is below the minimum 1"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match=r"rewards\.weights\.nope: unknown reward"):
        RewardsConfig(weights={"nope": 1.0})
    with pytest.raises(
        ValueError, match=r"rewards\.weights\.hpsv21: must be a finite number, got nan"
    ):
        RewardsConfig(weights={"hpsv21": float("nan")})
    with pytest.raises(ConfigError, match=r"rewards\.nope: unknown reward"):
        RewardsConfig().spec("nope")
    assert RewardsConfig().spec("jpeg_compressibility").quality == 95


def test_config_types_agree_with_the_torch_side():
    """The registry, the dtype tables and the backbone families follow the config's types."""
    from jagg_pipeline.backbones import BACKBONE_FAMILIES
    from jagg_pipeline.backbones import loading as backbone_loading
    from jagg_pipeline.rewards import REWARDS
    from jagg_pipeline.rewards import base as reward_base

    assert tuple(backbone_loading.DTYPES) == get_args(BackboneDtype)
    assert tuple(reward_base.DTYPES) == get_args(RewardDtype)
    assert get_args(BackboneFamily) == BACKBONE_FAMILIES
    assert tuple(REWARDS) == REWARD_NAMES
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(RewardsConfig)}
    for name, info in REWARDS.items():
        assert helps[name] == info.summary, name  # the section's help is the module's summary


def test_yaml_overrides_and_errors_name_file_and_key(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"jagg": {"mode": "exact"}, "train": {"rounds": 3}}))
    cfg = load_config(path, ["jagg.jagg_frac=auto", "sampler.group_size=4"])
    assert (cfg.jagg.mode, cfg.jagg.jagg_frac, cfg.train.rounds) == ("exact", "auto", 3)
    assert cfg.sampler.group_size == 4
    assert digest(cfg) != digest(RunConfig())
    path.write_text(yaml.safe_dump({"jagg": {"windw": 3}}))
    with pytest.raises(ConfigError, match=rf"{path}: jagg\.windw: unknown key"):
        load_config(path)
    for bad, message in [
        ("jagg.window=1", r"jagg\.window: 1 is below the minimum 2"),
        ("jagg.jagg_frac=1.5", r"jagg\.jagg_frac: 1\.5 is above the maximum 1"),
        ("jagg.jagg_frac=half", r"jagg\.jagg_frac: 'half' fits none of"),
        ("sampler.group_size=1", r"sampler\.group_size: 1 is below the minimum 2"),
        ("sampler.segment_start=[2, 3]", r"segment_steps 8 exceeds num_steps 10"),
        ("backbone.dtype=float8", r"backbone\.dtype: 'float8' is not one of"),
        ("backbone.family=unet", r"backbone\.family: 'unet' is not one of"),
        ("rewards.weights={nope: 1}", r"rewards\.weights\.nope: unknown reward"),
        ("rewards.weights={hpsv21: .nan}", r"rewards\.weights\.hpsv21: must be a finite"),
        ("rewards.hpsv21.chekpoint=x", r"rewards\.hpsv21\.chekpoint: unknown key"),
        ("rewards.clipscore.dtype=float64", r"rewards\.clipscore\.dtype: 'float64' is not"),
        ("backbone.lora.rank=0", r"backbone\.lora\.rank: 0 is below the minimum 1"),
    ]:
        path.write_text("{}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path, [bad])


def test_config_cli_shows_resolved_yaml_and_schema(tmp_path, capsys):
    from jagg_pipeline.cli import main

    out = tmp_path / "resolved.yaml"
    main(["config", "show", "--set", "jagg.mode=exact", "--out", str(out)])
    resolved = yaml.safe_load(out.read_text())
    assert resolved["jagg"]["mode"] == "exact"
    assert load_config(out) == from_dict(RunConfig, resolved)
    main(["config", "schema"])
    assert '"$schema"' in capsys.readouterr().out
    assert main(["config", "show", "--set", "jagg.mode=fast"]) == 2
    assert "jagg.mode: 'fast' is not one of" in capsys.readouterr().err
    assert main(["config", "show", "--set", "train.lr=0"]) == 2
    assert "train.lr: 0.0 must be above 0" in capsys.readouterr().err


def test_gradcheck_counts_the_backward_calls_of_the_default_training_step():
    from jagg_pipeline.bench.gradcheck_config import GradcheckConfig
    from jagg_pipeline.config.run import JaggConfig

    assert GradcheckConfig().endpoint_backward == JaggConfig().endpoint_backward


def test_the_backbone_defaults_are_the_default_experiments_toy_sd3():
    """One set of backbone defaults: a BackboneConfig built in Python is the config's default."""
    from jagg_pipeline.toyworld.models import toy_backbone_options

    default = BackboneConfig()
    toy = toy_backbone_options("sd3")
    assert {key: getattr(default, key) for key in toy} == toy
    assert RunConfig().backbone == default


def test_a_renamed_workflow_key_is_refused_naming_the_new_one():
    from jagg_pipeline.workflow.sections import split

    with pytest.raises(ConfigError, match=r"workflow\.report: .*is now workflow\.comparison"):
        split({"workflow": {"report": ["all"]}})


def _key_comments(text: str) -> dict[str, str]:
    """section.key -> the comment lines above it (whitespace-normalised), of a commented YAML."""
    comments, pending, section = {}, [], None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        if stripped and ":" in stripped and not stripped.startswith("-"):
            key = stripped.split(":", 1)[0]
            if not line.startswith(" "):
                section = key
            elif line.startswith("  ") and not line.startswith("   ") and pending:
                comments[f"{section}.{key}"] = " ".join(" ".join(pending).split())
        pending = []
    return comments


def test_config_yaml_comments_are_the_help_texts():
    from pathlib import Path

    from jagg_pipeline.config.run import schema
    from jagg_pipeline.config.yaml_io import commented_yaml

    # config.yaml's base sections are the template's, hand-wrapped and with their own values.
    template = _key_comments(commented_yaml(schema(), to_dict(RunConfig())))
    ours = _key_comments((Path(__file__).parents[1] / "config.yaml").read_text())
    shared = template.keys() & ours.keys()
    assert len(shared) > 50
    assert {key: ours[key] for key in shared} == {key: template[key] for key in shared}
