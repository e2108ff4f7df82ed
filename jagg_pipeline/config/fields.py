"""Typed config sections: declared fields, conversion from plain data, bounds, digests.

The dataclasses are the single source of truth. :func:`field` declares a key with its help text
and numeric bounds; :func:`from_dict` builds a section from parsed YAML or JSON, rejecting
unknown keys and wrong types with the dotted key and the file in the message; :func:`to_dict`
and :func:`digest` give it back as plain data and as its sha256. Reading YAML lives in
:mod:`.yaml_io`, the JSON Schema in :mod:`.schema`. Knows nothing of torch or Snakemake.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from jagg_pipeline.support.errors import InputError, shown

T = TypeVar("T")
# A number written as text: PyYAML (YAML 1.1) reads ``1e-4`` (no dot) as a string. Letters other
# than e/E are excluded, so 'nan' and 'inf' stay strings (and are rejected).
NUMBER_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?$"


class ConfigError(InputError):
    """A configuration problem; the message names the key (and the file when known)."""


def field(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: float | None = None,
    internal: bool = False,
    **kwargs: Any,
) -> Any:
    """A dataclass field with the ``help`` text the schema and the docs show.

    No ``default`` (nor ``default_factory``) makes the field required. ``minimum``,
    ``maximum`` and ``exclusive_minimum`` bound a numeric value: the loader enforces them and
    the schema carries them. ``internal`` fields are set by code only: config files cannot set
    them and the schema and :func:`to_dict` leave them out.
    """
    if isinstance(default, list | dict):
        raise TypeError("use default_factory for mutable defaults")
    metadata: dict[str, Any] = {"help": help}
    bounds = {"minimum": minimum, "maximum": maximum, "exclusive_minimum": exclusive_minimum}
    metadata.update({name: bound for name, bound in bounds.items() if bound is not None})
    if internal:
        metadata["internal"] = True
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _bound_error(value: Any, metadata: Mapping[str, Any]) -> str | None:
    """Why ``value`` breaks the numeric bounds in a field's ``metadata`` (None: it does not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if "minimum" in metadata and value < metadata["minimum"]:
        return f"{shown(value)} is below the minimum {metadata['minimum']!r}"
    if "exclusive_minimum" in metadata and value <= metadata["exclusive_minimum"]:
        return f"{shown(value)} must be above {metadata['exclusive_minimum']!r}"
    if "maximum" in metadata and value > metadata["maximum"]:
        return f"{shown(value)} is above the maximum {metadata['maximum']!r}"
    return None


def check_bounds(config: Any, prefix: str, error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` naming ``prefix.field`` if a numeric field of ``config`` breaks its bounds.

    :func:`from_dict` checks bounds while loading; this is for objects that code builds
    directly (a ``__post_init__``, a loader handed a spec).
    """
    for f in dataclasses.fields(config):
        problem = _bound_error(getattr(config, f.name), f.metadata)
        if problem:
            raise error(f"{prefix}.{f.name}: {problem}")


def config_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields a config file may set (``internal`` ones are set by code only)."""
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _where(key: str, source: str | None) -> str:
    return f"{source}: {key}" if source else key


def _check(value: Any, annotation: Any, key: str, source: str | None, base: Any = None) -> Any:
    """``value`` converted to ``annotation``, or a ConfigError naming ``key``.

    ``base``: for a section, the values its keys default to.
    """
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{_where(key, source)}: expected a mapping, got {shown(value)}")
        return from_dict(annotation, value, source=source, prefix=key, base=base)
    origin = get_origin(annotation)
    if origin is Literal:
        return _check_choice(value, get_args(annotation), key, source)
    if origin in (Union, types.UnionType):
        return _check_union(value, get_args(annotation), key, source)
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{_where(key, source)}: expected a list, got {shown(value)}")
        (item,) = get_args(annotation)[:1] or (Any,)
        items = [_check(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        return _check_mapping(value, get_args(annotation), key, source)
    if annotation is Any:
        return value
    if annotation in _SCALARS:
        return _SCALARS[annotation](value, _where(key, source))
    raise TypeError(f"unsupported config annotation {annotation!r} at {key}")


def _check_choice(value: Any, choices: tuple[Any, ...], key: str, source: str | None) -> Any:
    if value not in choices:
        raise ConfigError(
            f"{_where(key, source)}: {shown(value)} is not one of "
            f"{', '.join(map(repr, choices))}{yaml_boolean_hint(value, choices)}"
        )
    return value


def _check_union(value: Any, options: tuple[Any, ...], key: str, source: str | None) -> Any:
    """The first option that ``value`` fits, or an error listing why it fits none."""
    if isinstance(value, float) and float in options and not math.isfinite(value):
        return _check(value, float, key, source)
    errors = []
    for option in options:
        if option is type(None):
            if value is None:
                return None
            continue
        try:
            return _check(value, option, key, source)
        except ConfigError as exc:
            errors.append(str(exc).split(": ", 2)[-1])
    raise ConfigError(f"{_where(key, source)}: {shown(value)} fits none of: {'; '.join(errors)}")


def _check_mapping(
    value: Any, args: tuple[Any, Any], key: str, source: str | None
) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_where(key, source)}: expected a mapping, got {shown(value)}")
    names, item = args
    for k in value:
        if names is str and not isinstance(k, str):
            # A name that YAML 1.1 typed: on/off/yes/no are booleans, 010 is the number 8.
            kinds = {bool: "a boolean", int: "a number", float: "a number"}
            kind = "null" if k is None else kinds.get(type(k), f"a {type(k).__name__}")
            raise ConfigError(
                f"{_where(key, source)}: the name {shown(k)} is {kind}, not text (YAML "
                "reads on/off/yes/no/true/false as booleans and 010 as the number 8); "
                "quote it in the file, e.g. 'on': or '010':"
            )
    return {str(k): _check(v, item, f"{key}.{k}", source) for k, v in value.items()}


def _check_float(value: Any, where: str) -> float:
    if isinstance(value, str) and re.fullmatch(NUMBER_PATTERN, value):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {shown(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {shown(value)}")
    return float(value)


def _check_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
    return value


def _check_exact(kind: type) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> Any:
        if not isinstance(value, kind):
            raise ConfigError(f"{where}: expected {kind.__name__}, got {shown(value)}")
        return value

    return check


# Scalar annotation -> its converter (bool is an int to Python, so int refuses it explicitly).
_SCALARS: dict[Any, Callable[[Any, str], Any]] = {
    float: _check_float,
    int: _check_int,
    str: _check_exact(str),
    bool: _check_exact(bool),
}


def default_value(f: dataclasses.Field) -> Any:
    """A field's default (its factory called), or ``dataclasses.MISSING`` for a required one."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def from_dict(
    cls: type[T],
    data: Mapping[str, Any],
    *,
    source: str | None = None,
    prefix: str = "",
    base: Any = None,
) -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are ConfigErrors.

    Keys that ``data`` leaves out take their value from ``base`` (an instance of ``cls``) or
    else the field default; a nested section given in part keeps the rest of its default, so
    ``backbone: {dtype: bfloat16}`` changes only the dtype of the default backbone.
    """
    hints = get_type_hints(cls)
    fields = config_fields(cls)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        keys = ", ".join(f"{prefix}.{k}" if prefix else str(k) for k in unknown)
        # A section's MOVED_KEYS (old name -> where it lives now) turn into the fix.
        renamed = getattr(cls, "MOVED_KEYS", {})
        moved = [f"{k} is now {renamed[k]}" for k in unknown if k in renamed]
        hint = f" ({'; '.join(moved)})" if moved else ""
        raise ConfigError(
            f"{_where(keys, source)}: unknown key(s){hint}; known keys here: {', '.join(fields)}"
        )
    kwargs, missing = {}, []
    for name, f in fields.items():
        default = getattr(base, name) if base is not None else default_value(f)
        if name in data:
            key = f"{prefix}.{name}" if prefix else name
            moved = getattr(cls, "MOVED_VALUES", {}).get(name, {})
            if isinstance(data[name], Hashable) and data[name] in moved:
                raise ConfigError(
                    f"{_where(key, source)}: {data[name]!r} is now called {moved[data[name]]!r}"
                )
            nested_base = default if dataclasses.is_dataclass(default) else None
            kwargs[name] = _check(data[name], hints[name], key, source, nested_base)
            problem = _bound_error(kwargs[name], f.metadata)
            if problem:
                raise ConfigError(f"{_where(key, source)}: {problem}")
        elif default is dataclasses.MISSING:
            missing.append(name)
        else:
            kwargs[name] = default
    if missing:
        keys = ", ".join(f"{prefix}.{k}" if prefix else k for k in missing)
        raise ConfigError(f"{_where(keys, source)}: required key(s) missing")
    internal = {
        f.name: getattr(base, f.name)
        for f in dataclasses.fields(cls)
        if f.metadata.get("internal") and base is not None
    }
    try:
        return cls(**kwargs, **internal)
    except (ValueError, TypeError) as exc:  # __post_init__ checks across fields
        message = str(exc)
        names_its_key = re.match(r"^[a-z_]+(\.[a-z_0-9]+)*:", message)
        if not (message.startswith(prefix) if prefix else names_its_key):
            message = f"{prefix or cls.__name__}: {message}"
        raise ConfigError(_where(message, source)) from None


def to_dict(config: Any) -> Any:
    """Plain data (dicts, lists) of a config dataclass, for YAML/JSON; internal fields left out."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {name: to_dict(getattr(config, name)) for name in config_fields(type(config))}
    if isinstance(config, list | tuple):
        return [to_dict(item) for item in config]
    if isinstance(config, Mapping):
        return {str(key): to_dict(value) for key, value in config.items()}
    return config


def digest(config: Any) -> str:
    """sha256 of the canonical JSON of a config: equal configs, equal digests."""
    canonical = json.dumps(to_dict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# The words YAML 1.1 (PyYAML) reads as booleans when unquoted.
_YAML_BOOLEANS = {"yes", "no", "on", "off", "true", "false", "y", "n"}


def yaml_boolean_hint(value: Any, choices: Sequence[Any]) -> str:
    """Why a boolean met a choice of words, when a choice is one YAML reads as a boolean.

    ``mixed_precision: no`` unquoted is YAML's false: the hint says to quote the word.
    """
    words = [c for c in choices if isinstance(c, str) and c.lower() in _YAML_BOOLEANS]
    if not isinstance(value, bool) or not words:
        return ""
    return (
        f" (YAML reads an unquoted {'/'.join(words)} as a boolean: write it in quotes, "
        f"e.g. '{words[0]}')"
    )
