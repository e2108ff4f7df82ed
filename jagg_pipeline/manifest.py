"""Manifests: what produced an output, so a stage can refuse inputs that do not fit.

Every stage output has a small JSON manifest beside it: ``DIR/manifest.json`` for a directory
output (rollouts, checkpoints, evaluations), ``FILE.manifest.json`` for a file output (score
tables). It records the stage, the package version, the digest of the whole config and of each
section, the seeds, and the digest of every input. A consumer checks the sections it depends on
(:func:`check_input`): the training stage, for instance, refuses rollouts sampled under a
different ``backbone`` or ``sampler`` section, or scores computed from other rollouts, and the
error names the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jagg_pipeline import __version__
from jagg_pipeline.artifacts import atomic_write_json
from jagg_pipeline.configtools import digest

MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """An input's manifest is missing or does not match what the consuming stage expects."""


def manifest_path(output: str | Path) -> Path:
    """Where the manifest of ``output`` lives (inside a directory, beside a file)."""
    output = Path(output)
    if output.is_dir() or not output.suffix:
        return output / MANIFEST_NAME
    return output.with_name(output.name + ".manifest.json")


def digest_path(path: str | Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and contents, sorted).

    A directory's own manifest is left out, so writing it does not change the digest.
    """
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file():
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: nothing to digest")
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        if relative == MANIFEST_NAME or file.name.startswith("."):
            continue
        h.update(relative.encode() + b"\0" + digest_path(file).encode() + b"\n")
    return h.hexdigest()


def section_digests(config: Any) -> dict[str, str]:
    """Digest of each top-level section of a config dataclass."""
    return {f.name: digest(getattr(config, f.name)) for f in dataclasses.fields(config)}


def write_manifest(
    output: str | Path,
    *,
    stage: str,
    config: Any,
    seeds: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str | Path] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the manifest of ``output`` (after ``output`` itself is complete)."""
    manifest = {
        "stage": stage,
        "version": __version__,
        "config_digest": digest(config),
        "sections": section_digests(config),
        "seeds": dict(seeds or {}),
        "inputs": {
            name: {"path": str(path), "digest": digest_path(path)}
            for name, path in (inputs or {}).items()
        },
        **dict(extra or {}),
    }
    return atomic_write_json(manifest_path(output), manifest)


def read_manifest(output: str | Path) -> dict[str, Any]:
    """The manifest of ``output``; a clear error if it is missing or unreadable."""
    path = manifest_path(output)
    if not path.is_file():
        raise ManifestError(
            f"{output}: no manifest ({path} missing); was it written by a jagg-pipeline stage "
            "that finished?"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path}: not valid JSON ({err})") from None


def check_input(
    path: str | Path,
    *,
    stage: str | Iterable[str],
    config: Any,
    sections: Iterable[str] = (),
) -> dict[str, Any]:
    """Refuse ``path`` unless a ``stage`` output made under the same ``sections`` of ``config``.

    Returns the input's manifest.
    """
    manifest = read_manifest(path)
    stages = {stage} if isinstance(stage, str) else set(stage)
    if manifest.get("stage") not in stages:
        raise ManifestError(
            f"{path}: is a {manifest.get('stage')!r} output, expected {' or '.join(sorted(stages))}"
        )
    ours = section_digests(config)
    theirs = manifest.get("sections", {})
    differing = [s for s in sections if theirs.get(s) != ours[s]]
    if differing:
        raise ManifestError(
            f"{path}: was made with a different config section {', '.join(differing)} "
            f"(manifest {manifest_path(path)}); rerun it with this config or pass the config "
            "it was made with"
        )
    return manifest


def check_derived_from(
    path: str | Path, manifest: Mapping[str, Any], name: str, source: str | Path
) -> None:
    """Refuse ``path`` unless its manifest lists ``source`` (as input ``name``) with its digest."""
    recorded = manifest.get("inputs", {}).get(name)
    if recorded is None or recorded.get("digest") != digest_path(source):
        raise ManifestError(
            f"{path}: was not computed from {source} (its manifest's input {name!r} is "
            f"{recorded['path'] if recorded else 'missing'} with another digest)"
        )
