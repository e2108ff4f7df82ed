import dataclasses
from typing import Literal

import jsonschema
import pytest

from jagg_pipeline.configtools import (
    ConfigError,
    apply_overrides,
    digest,
    field,
    from_dict,
    json_schema,
    load_yaml,
    to_dict,
)


@dataclasses.dataclass
class Inner:
    """An inner section."""

    rate: float = field(1e-3, help="a rate")
    mode: Literal["a", "b"] = field("a", help="a choice")
    frac: float | Literal["auto"] = field(0.5, help="number or auto")


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
    ],
)
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


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
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate({"name": "x", "inner": {"frac": "auto"}})
    for bad in ({"name": "x", "stepz": 1}, {"name": "x", "inner": {"mode": "c"}}, {"steps": 1}):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)


def test_digest_is_stable_and_sensitive():
    a = from_dict(Outer, {"name": "x"})
    assert digest(a) == digest(from_dict(Outer, {"name": "x", "steps": 10}))
    assert digest(a) != digest(from_dict(Outer, {"name": "x", "steps": 11}))
