"""YAML in and out: bounded, strict parsing, ``key=value`` overrides, commented writing.

:func:`read_yaml` refuses an alias bomb and a key given twice, naming the file and the line;
:func:`load_yaml` and :func:`load_data` turn what it read (and ``--set`` overrides) into a typed
section (:mod:`.fields`); :func:`commented_yaml` writes data with each key's help above it.
"""

from __future__ import annotations

import copy
import re
import textwrap
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from jagg_pipeline.config.fields import ConfigError, from_dict
from jagg_pipeline.support.errors import shown

T = TypeVar("T")
# What a YAML document may expand to once its aliases are followed: a config is a few hundred
# nodes, so these refuse an alias bomb (a KB of text that expands to 10^9 nodes) at once.
MAX_YAML_NODES = 100_000
MAX_YAML_CHARS = 10_000_000


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


def _flow(value: Any) -> str:
    """``value`` as one line of YAML (flow style)."""
    return yaml.safe_dump([value], default_flow_style=True, sort_keys=False).strip()[1:-1]


def commented_yaml(schema: Mapping[str, Any], data: Mapping[str, Any], indent: int = 0) -> str:
    """``data`` as block YAML with each key's schema description as a comment above it.

    Sections (schema objects with properties) nest as blocks; every other value is written
    on its key's line in flow style. Keys follow ``data``'s order.
    """
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
