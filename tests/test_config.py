import dataclasses

import jsonschema
import pytest
import yaml

from jagg_pipeline.config import ExperimentConfig, load_config, schema
from jagg_pipeline.configtools import ConfigError, digest, from_dict, to_dict


def test_default_config_round_trips_and_validates_against_its_schema():
    default = ExperimentConfig()
    data = to_dict(default)
    assert from_dict(ExperimentConfig, data) == default
    jsonschema.Draft202012Validator(schema()).validate(data)
    assert "key" not in data["backbone"]  # code-only field stays out of files


def test_schema_and_dataclasses_agree_on_every_key():
    """Every dataclass field is in the schema with its default, and nothing else is."""
    spec = schema()

    def walk(obj, node, where):
        fields = {f.name for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
        assert set(node["properties"]) == fields, where
        assert node["additionalProperties"] is False
        for name in fields:
            value = getattr(obj, name)
            if dataclasses.is_dataclass(value):
                walk(value, node["properties"][name], f"{where}.{name}")
            else:
                assert node["properties"][name]["default"] == to_dict(value), f"{where}.{name}"

    walk(ExperimentConfig(), spec, "config")


def test_every_experiment_key_has_help():
    spec = schema()
    for section in ("sampler", "grpo", "jagg", "train", "eval", "tracking"):
        for name, prop in spec["properties"][section]["properties"].items():
            assert prop.get("description"), f"{section}.{name} has no help text"


def test_yaml_overrides_and_errors_name_file_and_key(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({"jagg": {"mode": "exact"}, "train": {"rounds": 3}}))
    cfg = load_config(path, ["jagg.jagg_frac=auto", "sampler.group_size=4"])
    assert (cfg.jagg.mode, cfg.jagg.jagg_frac, cfg.train.rounds) == ("exact", "auto", 3)
    assert cfg.sampler.group_size == 4
    assert digest(cfg) != digest(ExperimentConfig())
    path.write_text(yaml.safe_dump({"jagg": {"windw": 3}}))
    with pytest.raises(ConfigError, match=rf"{path}: jagg\.windw: unknown key"):
        load_config(path)
    for bad, message in [
        ("jagg.window=1", r"jagg\.window must be >= 2"),
        ("jagg.jagg_frac=1.5", r"jagg\.jagg_frac must be in \[0, 1\]"),
        ("sampler.group_size=1", r"sampler\.group_size must be >= 2"),
        ("backbone.dtype=float8", r"backbone\.dtype must be one of"),
        ("rewards.weights={nope: 1}", r"rewards\.weights\.nope: unknown reward"),
        ("rewards.hpsv21.chekpoint=x", r"rewards\.hpsv21\.chekpoint: unknown key"),
        ("backbone.lora.rank=0", "lora rank must be >= 1"),
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
    assert load_config(out) == from_dict(ExperimentConfig, resolved)
    main(["config", "schema"])
    assert '"$schema"' in capsys.readouterr().out
    assert main(["config", "show", "--set", "jagg.mode=fast"]) == 2
    assert "jagg.mode: 'fast' is not one of" in capsys.readouterr().err
