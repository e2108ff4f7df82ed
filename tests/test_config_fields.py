import dataclasses
import math
from typing import Literal

import jsonschema
import pytest

from jagg_pipeline.config.fields import ConfigError, check_bounds, digest, field, from_dict, to_dict
from jagg_pipeline.config.schema import json_schema
from jagg_pipeline.config.yaml_io import apply_overrides, load_yaml


@dataclasses.dataclass
class Inner:
    """An inner section."""

    rate: float = field(1e-3, help="a rate", exclusive_minimum=0)
    mode: Literal["a", "b"] = field("a", help="a choice")
    frac: float | Literal["auto"] = field(0.5, help="number or auto", minimum=0, maximum=1)
    decay: float | None = field(None, help="optional number", minimum=0)
    hidden: int = field(0, help="set by code", internal=True)


@dataclasses.dataclass
class Outer:
    """The whole thing."""

    name: str = field(help="required name")
    steps: int = field(10, help="an integer")
    tags: list[str] = field(default_factory=list, help="a list")
    inner: Inner = field(default_factory=Inner, help="nested")
    path: str | None = field(None, help="optional")

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def test_round_trip_with_defaults_filled():
    cfg = from_dict(Outer, {"name": "x", "inner": {"frac": "auto"}})
    assert cfg.inner == Inner(frac="auto") and cfg.steps == 10
    assert from_dict(Outer, to_dict(cfg)) == cfg
    assert from_dict(Outer, {"name": "x", "inner": {"rate": 1}}).inner.rate == 1.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "stepz": 3}, "stepz: unknown key"),
        ({"name": "x", "inner": {"rat": 1}}, "inner.rat: unknown key"),
        ({"name": "x", "steps": "10"}, "steps: expected an integer"),
        ({"name": "x", "steps": True}, "steps: expected an integer"),
        ({"name": "x", "inner": {"mode": "c"}}, "inner.mode: 'c' is not one of 'a', 'b'"),
        ({"name": "x", "inner": {"frac": "half"}}, "inner.frac: 'half' fits none of"),
        ({"name": "x", "tags": [1]}, r"tags\[0\]: expected str"),
        ({"steps": 3}, "name: required key"),
        ({"name": "x", "steps": 0}, "steps must be >= 1"),
        ({"name": "x", "inner": {"frac": 1.5}}, r"^inner\.frac: 1\.5 is above the maximum 1$"),
        ({"name": "x", "inner": {"frac": -1}}, r"^inner\.frac: -1\.0 is below the minimum 0$"),
        ({"name": "x", "inner": {"rate": 0}}, r"^inner\.rate: 0\.0 must be above 0$"),
        ({"name": "x", "inner": {"decay": -0.5}}, r"^inner\.decay: -0\.5 is below the minimum"),
        ({"name": "x", "inner": {"rate": math.inf}}, r"^inner\.rate: must be a finite number"),
        ({"name": "x", "inner": {"frac": math.nan}}, r"^inner\.frac: must be a finite number"),
        ({"name": "x", "inner": {"decay": -math.inf}}, r"^inner\.decay: must be a finite"),
        ({"name": "x", "inner": {"rate": "nan"}}, r"^inner\.rate: expected a number, got 'nan'"),
        ({"name": "x", "inner": {"rate": "infinity"}}, "inner.rate: expected a number"),
        ({"name": "x", "inner": {"rate": "1e-3x"}}, "inner.rate: expected a number"),
        ({"name": "x", "inner": {"hidden": 1}}, "inner.hidden: unknown key"),
    ],
)
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_numbers_written_as_text_are_numbers():
    """PyYAML reads 1e-3 (no dot) as a string; float fields take it as the number it spells."""
    for text, number in [("1e-3", 1e-3), ("2E+2", 200.0), ("+.5", 0.5), ("3", 3.0)]:
        cfg = from_dict(Outer, {"name": "x", "inner": {"decay": text, "rate": text}})
        assert cfg.inner.rate == cfg.inner.decay == number and isinstance(cfg.inner.rate, float)
    with pytest.raises(ConfigError, match=r"inner\.decay: -0\.5 is below the minimum 0"):
        from_dict(Outer, {"name": "x", "inner": {"decay": "-5e-1"}})
    assert from_dict(Outer, {"name": "x", "inner": {"frac": "1e-1"}}).inner.frac == 0.1
    with pytest.raises(ConfigError, match=r"inner\.frac: 2\.0 is above the maximum 1"):
        from_dict(Outer, {"name": "x", "inner": {"frac": "2e0"}})
    with pytest.raises(ConfigError, match="steps: expected an integer"):
        from_dict(Outer, {"name": "x", "steps": "1e1"})


def test_bounds_of_objects_built_by_code():
    check_bounds(Inner(), "inner")
    with pytest.raises(ConfigError, match=r"^inner\.frac: 2 is above the maximum 1$"):
        check_bounds(Inner(frac=2), "inner")
    with pytest.raises(KeyError, match="rate"):
        check_bounds(Inner(rate=-1.0), "inner", error=KeyError)


def test_a_field_without_default_is_required():
    (name,) = [f for f in dataclasses.fields(Outer) if f.name == "name"]
    assert name.default is dataclasses.MISSING and name.metadata["help"] == "required name"
    assert json_schema(Outer)["required"] == ["name"]
    assert Outer("positional").name == "positional"


def test_yaml_file_errors_name_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\ninner:\n  bogus: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}: inner.bogus: unknown key"):
        load_yaml(Outer, path)
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(Outer, tmp_path / "missing.yaml")
    good = tmp_path / "good.yaml"
    good.write_text("name: x\n")
    assert load_yaml(Outer, good, overrides=["inner.rate=0.1"]).inner.rate == 0.1
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_yaml(Outer, bad)


def test_overrides_parse_yaml_values():
    data = apply_overrides({"name": "x"}, ["inner.frac=auto", "steps=12", "tags=[a, b]"])
    cfg = from_dict(Outer, data)
    assert (cfg.inner.frac, cfg.steps, cfg.tags) == ("auto", 12, ["a", "b"])
    with pytest.raises(ConfigError, match=r"KEY\.PATH=VALUE"):
        apply_overrides({}, ["steps"])


def test_schema_accepts_what_the_loader_accepts_and_rejects_unknown_keys():
    schema = json_schema(Outer)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["inner"]["default"] == to_dict(Inner())
    assert schema["properties"]["steps"]["description"] == "an integer"
    inner = schema["properties"]["inner"]["properties"]
    assert (inner["frac"]["minimum"], inner["frac"]["maximum"]) == (0, 1)
    assert inner["rate"]["exclusiveMinimum"] == 0 and "minimum" not in inner["rate"]
    assert "hidden" not in inner and "hidden" not in to_dict(Inner())
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate({"name": "x", "inner": {"frac": "auto"}})
    validator.validate({"name": "x", "inner": {"rate": "1e-3", "frac": 1, "decay": None}})
    for bad in (
        {"name": "x", "stepz": 1},
        {"name": "x", "inner": {"mode": "c"}},
        {"steps": 1},
        {"name": "x", "inner": {"frac": 1.5}},
        {"name": "x", "inner": {"rate": 0}},
        {"name": "x", "inner": {"decay": -1}},
        {"name": "x", "inner": {"rate": "nan"}},
        {"name": "x", "inner": {"hidden": 1}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)


def test_digest_is_stable_and_sensitive():
    a = from_dict(Outer, {"name": "x"})
    assert digest(a) == digest(from_dict(Outer, {"name": "x", "steps": 10}))
    assert digest(a) != digest(from_dict(Outer, {"name": "x", "steps": 11}))
