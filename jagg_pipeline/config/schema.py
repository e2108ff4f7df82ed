"""The JSON Schema (draft 2020-12) of a config section, and a data's problems against one.

:func:`json_schema` derives it from the dataclasses (defaults filled, descriptions from the
fields' help, unknown keys refused) for Snakemake to validate config.yaml against and for
``config schema`` to write; :func:`schema_errors` lists every problem of data, in
:func:`~jagg_pipeline.config.fields.from_dict`'s words.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from jagg_pipeline.config.fields import (
    NUMBER_PATTERN,
    config_fields,
    default_value,
    to_dict,
    yaml_boolean_hint,
)
from jagg_pipeline.support.errors import shown

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# field() keyword -> the JSON Schema keyword of a numeric bound.
_BOUNDS = {"minimum": "minimum", "maximum": "maximum", "exclusive_minimum": "exclusiveMinimum"}


def _schema(annotation: Any) -> dict[str, Any]:
    origin = get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return _object_schema(annotation)
    if origin is Literal:
        return {"enum": list(get_args(annotation))}
    if origin in (Union, types.UnionType):
        options = [_schema(a) for a in get_args(annotation)]
        return {"anyOf": options}
    if origin in (list, tuple, Sequence):
        (item,) = get_args(annotation)[:1] or (Any,)
        return {"type": "array", "items": _schema(item)}
    if origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _schema(get_args(annotation)[1])}
    simple = {
        # numbers written as text (YAML 1.1 reads 1e-4 as a string) are accepted, as by the loader
        float: {"type": ["number", "string"], "pattern": NUMBER_PATTERN},
        int: {"type": "integer"},
        str: {"type": "string"},
        bool: {"type": "boolean"},
        type(None): {"type": "null"},
        typing.Any: {},
    }
    if annotation in simple:
        return dict(simple[annotation])
    raise TypeError(f"no JSON schema for {annotation!r}")


def _object_schema(cls: type, base: Any = None) -> dict[str, Any]:
    """Schema of a section; ``base`` (an instance) supplies defaults, as in :func:`from_dict`."""
    hints = get_type_hints(cls)
    properties, required = {}, []
    for f in config_fields(cls).values():
        default = getattr(base, f.name) if base is not None else default_value(f)
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation) and dataclasses.is_dataclass(default):
            prop = _object_schema(annotation, default)
        else:
            prop = _schema(annotation)
        if f.metadata.get("help"):
            prop["description"] = f.metadata["help"]
        # JSON Schema applies numeric keywords to numbers only, so at the property level they
        # bound the number branch of e.g. ``float | Literal["auto"]`` and leave the rest alone.
        prop.update({_BOUNDS[k]: f.metadata[k] for k in _BOUNDS if k in f.metadata})
        if default is dataclasses.MISSING:
            required.append(f.name)
        else:
            prop["default"] = to_dict(default)
        properties[f.name] = prop
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    if required:
        schema["required"] = required
    return schema


def json_schema(cls: type) -> dict[str, Any]:
    """The draft 2020-12 JSON Schema of dataclass ``cls`` (defaults filled, strict objects)."""
    return {"$schema": SCHEMA_DIALECT, "title": cls.__name__, **_object_schema(cls)}


def schema_errors(schema: Mapping[str, Any], data: Any) -> list[tuple[str, str]]:
    """Every way ``data`` breaks JSON Schema ``schema`` (draft 2020-12), as (dotted key, message).

    All of them, sorted by key; an unknown key is named itself (not its parent), as
    :func:`from_dict` names it. Needs ``jsonschema`` (a dependency of Snakemake).
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    problems = []
    for error in validator.iter_errors(data):
        parts = list(error.absolute_path)
        where = _dotted_path(parts)
        if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
            known = list(error.schema.get("properties", {}))
            for extra in sorted(set(map(str, error.instance)) - set(known)):
                key = f"{where}.{extra}" if where else extra
                problems.append((key, f"unknown key; known keys here: {', '.join(known)}"))
            continue
        problems.append((where or "(top level)", _schema_message(error)))
    return sorted(set(problems), key=lambda problem: problem[0])


def _schema_message(error: Any) -> str:
    """A jsonschema error's message, in :func:`from_dict`'s words where they are clearer."""
    if error.validator == "pattern" and error.validator_value == NUMBER_PATTERN:
        return f"expected a number, got {shown(error.instance)}"
    if error.validator == "anyOf" and error.context:
        options = dict.fromkeys(_schema_message(sub) for sub in error.context)
        return f"{shown(error.instance)} fits none of: {'; '.join(options)}"
    if error.validator == "enum":
        return error.message + yaml_boolean_hint(error.instance, error.validator_value)
    return error.message


def _dotted_path(parts: Sequence[Any]) -> str:
    """``a.b[0].c`` of a JSON Schema error path."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
