"""Strict typed configuration: dataclasses <-> YAML/JSON, JSON Schema, overrides, digests.

The dataclasses are the single source of truth. :func:`from_dict` builds them from parsed YAML
and rejects unknown keys and wrong types with the dotted key and the file in the message;
:func:`json_schema` derives the draft 2020-12 schema (defaults filled, descriptions from field
metadata) that Snakemake validates config.yaml against. Knows nothing of torch or Snakemake.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from jagg_pipeline.support.errors import InputError, shown

T = TypeVar("T")
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# A number written as text: PyYAML (YAML 1.1) reads ``1e-4`` (no dot) as a string. Letters other
# than e/E are excluded, so 'nan' and 'inf' stay strings (and are rejected).
NUMBER_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?$"
# field() keyword -> the JSON Schema keyword of a numeric bound.
_BOUNDS = {"minimum": "minimum", "maximum": "maximum", "exclusive_minimum": "exclusiveMinimum"}
# What a YAML document may expand to once its aliases are followed: a config is a few hundred
# nodes, so these refuse an alias bomb (a KB of text that expands to 10^9 nodes) at once.
MAX_YAML_NODES = 100_000
MAX_YAML_CHARS = 10_000_000


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


def _config_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields a config file may set (``internal`` ones are set by code only)."""
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _where(key: str, source: str | None) -> str:
    return f"{source}: {key}" if source else key


def _check(value: Any, annotation: Any, key: str, source: str | None, base: Any = None) -> Any:
    """``value`` converted to ``annotation``, or a ConfigError naming ``key``.

    ``base``: for a section, the values its keys default to.
    """
    origin = get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{_where(key, source)}: expected a mapping, got {shown(value)}")
        return from_dict(annotation, value, source=source, prefix=key, base=base)
    if origin is Literal:
        choices = get_args(annotation)
        if value not in choices:
            raise ConfigError(
                f"{_where(key, source)}: {shown(value)} is not one of "
                f"{', '.join(map(repr, choices))}{yaml_boolean_hint(value, choices)}"
            )
        return value
    if origin in (Union, types.UnionType):
        errors = []
        options = get_args(annotation)
        if isinstance(value, float) and float in options and not math.isfinite(value):
            return _check(value, float, key, source)
        for option in options:
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(value, option, key, source)
            except ConfigError as exc:
                errors.append(str(exc).split(": ", 2)[-1])
        raise ConfigError(
            f"{_where(key, source)}: {shown(value)} fits none of: {'; '.join(errors)}"
        )
    if origin in (list, tuple, Sequence):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{_where(key, source)}: expected a list, got {shown(value)}")
        (item,) = get_args(annotation)[:1] or (Any,)
        items = [_check(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{_where(key, source)}: expected a mapping, got {shown(value)}")
        names, item = get_args(annotation)
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
    if annotation is Any:
        return value
    if annotation is float:
        if isinstance(value, str) and re.fullmatch(NUMBER_PATTERN, value):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{_where(key, source)}: expected a number, got {shown(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{_where(key, source)}: must be a finite number, got {shown(value)}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{_where(key, source)}: expected an integer, got {shown(value)}")
        return value
    if annotation in (str, bool):
        if not isinstance(value, annotation):
            raise ConfigError(
                f"{_where(key, source)}: expected {annotation.__name__}, got {shown(value)}"
            )
        return value
    raise TypeError(f"unsupported config annotation {annotation!r} at {key}")


def _default_value(f: dataclasses.Field) -> Any:
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
    fields = _config_fields(cls)
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
        default = getattr(base, name) if base is not None else _default_value(f)
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
        return {name: to_dict(getattr(config, name)) for name in _config_fields(type(config))}
    if isinstance(config, list | tuple):
        return [to_dict(item) for item in config]
    if isinstance(config, Mapping):
        return {str(key): to_dict(value) for key, value in config.items()}
    return config


class YAMLBoundError(yaml.composer.ComposerError):
    """A YAML document whose aliases expand beyond the bounds, or refer to themselves."""


def _check_expansion(root: yaml.Node | None) -> None:
    """Refuse a YAML document that its aliases would blow up, or that contains itself.

    Following ``root``'s aliases must give at most :data:`MAX_YAML_NODES` nodes and
    :data:`MAX_YAML_CHARS` characters of scalars. An alias is the very node of its anchor,
    so sizes are summed once per node (memoised): linear in the document, however much it
    would expand.
    """
    sizes: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> tuple[int, int]:
        ident = id(node)
        if ident in sizes:
            return sizes[ident]
        if ident in open_nodes:
            raise YAMLBoundError(
                None, None, "an alias refers to a node that contains it", node.start_mark
            )
        open_nodes.add(ident)
        if isinstance(node, yaml.ScalarNode):
            nodes, chars = 1, len(node.value)
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else sum(node.value, ())
            nodes, chars = 1, 0
            for child in children:
                child_nodes, child_chars = size(child)
                nodes, chars = nodes + child_nodes, chars + child_chars
        open_nodes.discard(ident)
        if nodes > MAX_YAML_NODES or chars > MAX_YAML_CHARS:
            raise YAMLBoundError(
                None,
                None,
                f"with its aliases followed this value holds more than {MAX_YAML_NODES} "
                f"values or {MAX_YAML_CHARS} characters (an alias bomb?); write it out or "
                "use fewer aliases",
                node.start_mark,
            )
        sizes[ident] = nodes, chars
        return sizes[ident]

    if root is not None:
        size(root)


class _BoundedLoader(yaml.SafeLoader):
    """Safe YAML whose aliases cannot blow up.

    :func:`_check_expansion` runs before anything is built; merge keys (``<<: *base``) work
    as in any YAML 1.1 loader.
    """

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        _check_expansion(node)
        return node


class _StrictLoader(_BoundedLoader):
    """Bounded YAML without silent surprises: a key given twice in one mapping is an error.

    Keys that a merge (``<<: *base``) brings in may be given again: that is what a merge is for.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the constructor below refuses it, naming the line
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {shown(key)} (first on line {seen[key]}): the last one would "
                    "silently win",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str) -> Any:
    """``text`` parsed as bounded, strict YAML; errors are ConfigErrors naming ``where``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested too deeply") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, YAMLBoundError) else f"not valid YAML: {text}"


def read_yaml(path: str | Path, *, duplicates_ok: bool = False) -> Any:
    """Parse a YAML file strictly, its aliases bounded.

    A key given twice is refused, naming the key and both lines (``duplicates_ok``: the last
    one wins, as in plain YAML).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    loader = _BoundedLoader if duplicates_ok else _StrictLoader
    try:
        with open(path, encoding="utf-8") as stream:  # a stream, so that marks name the file
            return yaml.load(stream, Loader=loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def duplicate_keys(path: str | Path) -> list[str]:
    """Every key given twice in one mapping of YAML file ``path``, one line each.

    ``<path>: <dotted.key>: duplicate key (lines a and b): ...``. :func:`read_yaml` stops at the
    first; this finds them all (for reporting every problem of a file at once). A file that is
    not valid YAML has none (:func:`read_yaml` reports it).
    """
    try:
        with open(path, encoding="utf-8") as stream:
            root = yaml.compose(stream, Loader=_BoundedLoader)
    except (OSError, UnicodeDecodeError, RecursionError, yaml.YAMLError):
        return []
    found: list[str] = []

    def walk(node: yaml.Node | None, where: str) -> None:
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, Any], int] = {}
            for key_node, value_node in node.value:
                name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                key = f"{where}.{name}" if where else name
                ident = (
                    key_node.tag,
                    key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node),
                )
                line = key_node.start_mark.line + 1
                if ident in seen:
                    found.append(
                        f"{path}: {key}: duplicate key (lines {seen[ident]} and {line}): the last "
                        "one would silently win"
                    )
                else:
                    seen[ident] = line
                walk(value_node, key)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                walk(item, f"{where}[{index}]")

    walk(root, "")
    return found


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


def _dotted_path(parts: Sequence[Any]) -> str:
    """``a.b[0].c`` of a JSON Schema error path."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def load_yaml(cls: type[T], path: str | Path, overrides: Sequence[str] = ()) -> T:
    """Read ``path`` strictly into ``cls``, after applying ``key.sub=value`` overrides.

    An error that only an override brings in names the override (``--set key=value``), not
    the file.
    """
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return load_data(cls, data, str(path), overrides)


def load_data(
    cls: type[T], data: Mapping[str, Any], source: str, overrides: Sequence[str] = ()
) -> T:
    """:func:`load_yaml` of data already read from ``source`` (errors name it, or the override).

    The overrides are applied together and the result checked once: keys checked against each
    other (``sampler.num_steps``, ``sampler.segment_steps``, ``jagg.window``) may be set in
    any order. An error blames the overrides whose key it names, or else all of them.
    """
    config = from_dict(cls, data, source=source)
    if not overrides:
        return config
    try:
        return from_dict(cls, apply_overrides(data, overrides))
    except ConfigError as exc:
        named = [
            item
            for item in overrides
            if re.search(rf"(?<![\w.]){re.escape(item.partition('=')[0])}(?!\.?\w)", str(exc))
        ]
        raise ConfigError(f"--set {' '.join(named or overrides)}: {exc}") from None


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``a.b.c=value`` set (value parsed as YAML)."""
    result = copy.deepcopy(dict(data))  # not a JSON round trip: it would make keys text
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {shown(item)}: expected KEY.PATH=VALUE")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {shown(item)}: {part} is not a mapping")
        node[leaf] = parse_yaml(raw, f"override {shown(item)}")
    return result


def digest(config: Any) -> str:
    """sha256 of the canonical JSON of a config: equal configs, equal digests."""
    canonical = json.dumps(to_dict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


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
    for f in _config_fields(cls).values():
        default = getattr(base, f.name) if base is not None else _default_value(f)
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


def _flow(value: Any) -> str:
    """``value`` as one line of YAML (flow style)."""
    return yaml.safe_dump([value], default_flow_style=True, sort_keys=False).strip()[1:-1]


def commented_yaml(schema: Mapping[str, Any], data: Mapping[str, Any], indent: int = 0) -> str:
    """``data`` as block YAML with each key's schema description as a comment above it.

    Sections (schema objects with properties) nest as blocks; every other value is written
    on its key's line in flow style. Keys follow ``data``'s order.
    """
    import textwrap

    pad = " " * indent
    lines = []
    properties = schema.get("properties", {})
    for key, value in data.items():
        prop = properties.get(key, {})
        description = prop.get("description")
        if description:
            width = max(40, 98 - indent)
            lines += [f"{pad}# {line}" for line in textwrap.wrap(description, width)]
        if "properties" in prop and isinstance(value, Mapping):
            lines.append(f"{pad}{key}:")
            lines.append(commented_yaml(prop, value, indent + 2).rstrip("\n"))
        else:
            lines.append(f"{pad}{key}: {_flow(value)}")
    return "\n".join(lines) + "\n"
