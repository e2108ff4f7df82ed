"""The stage I/O contract: an output begun, finished with its resolved config and manifest.

Every stage output has a small JSON manifest: ``DIR/manifest.json`` for a directory output
(every pipeline stage), ``FILE.manifest.json`` beside a file output (``score-images`` keeps
its own fields there: no run config, a digest of the scored images).
It records the stage, the package version, the digest of the whole config and of each
section, the seeds, and the digest of every input. :func:`begin_output` marks an output
unfinished (manifest removed, stale files cleared); :func:`finish_output` writes the resolved
``config.yaml`` and then the manifest, the mark of a finished output. A consumer checks the
sections it depends on (:func:`check_input`): the training stage, for instance, refuses
rollouts sampled under a different ``backbone`` or ``sampler`` section, or scores computed
from other rollouts, and the error names the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jagg_pipeline import __version__
from jagg_pipeline.config.tools import digest, to_dict
from jagg_pipeline.io.artifacts import METRICS_NAME, atomic_write_json, atomic_write_text
from jagg_pipeline.io.shards import METADATA_FILE
from jagg_pipeline.support.errors import InputError

MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.yaml"
# The config sections (or dotted keys) each stage reads: the workflow's rules pass their
# digests as params (experiments.stage_digest). Rollouts also depend on the policy they sample
# from, a file input of the rule.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    # The jagg keys decide which velocities a rollout stores (rollout.velocity_steps).
    "rollout": (
        "backbone",
        "sampler",
        "train.seed",
        "jagg.mode",
        "jagg.window",
        "jagg.anchors",
        "jagg.jagg_frac",
        "jagg.no_interp",
        "jagg.reuse_velocities",
    ),
    "score": ("rewards", "advantage"),
    "train": ("backbone", "sampler", "advantage", "grpo", "jagg", "rewards", "train"),
    "evaluate": ("backbone", "sampler.batch_size", "eval", "rewards"),
}
# What a consumer checks of a stage's output against its own config (check_input): the whole
# sections the stage reads (a manifest records sections, not dotted keys); of a checkpoint only
# the backbone its weights fit, since evaluations compare policies trained under other sections.
CHECKED_SECTIONS: dict[str, tuple[str, ...]] = {
    **{
        stage: tuple(s for s in STAGE_SECTIONS[stage] if "." not in s)
        for stage in ("rollout", "score")
    },
    "train": ("backbone",),
}


class ManifestError(InputError):
    """An input's manifest is missing or does not match what the consuming stage expects."""


def manifest_path(output: str | Path) -> Path:
    """Where the manifest of ``output`` lives (inside a directory, beside a file)."""
    output = Path(output)
    if output.is_dir() or not output.suffix:
        return output / MANIFEST_NAME
    return output.with_name(output.name + ".manifest.json")


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read 1 MiB at a time (no file is held in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)
def _cached_sha256(path: str, inode: int, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def _file_digest(path: Path) -> str:
    """sha256 of a file, hashed once per process while it is unchanged.

    A stage checks an input (every file), checks what the input was derived from and records
    the input's digest in its own manifest: without the cache the same shards would be read
    three times. A rewrite changes the inode (atomic writes) or the size and mtime.
    """
    stat = path.stat()
    return _cached_sha256(str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def digest_path(path: str | Path) -> str:
    """sha256 of a file, or of a directory's files (relative names and contents, sorted).

    A directory's own manifest and its metrics (timings: not data) are left out, so writing
    them does not change the digest.
    """
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: nothing to digest")
    h = hashlib.sha256()
    for relative, file_digest in file_digests(path).items():
        h.update(relative.encode() + b"\0" + file_digest.encode() + b"\n")
    return h.hexdigest()


# Sharded tensor folders keep their index in a hidden file.
_HIDDEN_DATA = (METADATA_FILE,)


def _data_files(path: Path) -> list[Path]:
    """The files whose bytes are the output: all but its manifest, metrics and hidden files."""
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.relative_to(path).as_posix() not in (MANIFEST_NAME, METRICS_NAME)
        and (not p.name.startswith(".") or p.name in _HIDDEN_DATA)
    )


def file_digests(output: str | Path) -> dict[str, str]:
    """sha256 of every data file of ``output`` by name (relative to a directory output)."""
    output = Path(output)
    root = output.parent if output.is_file() else output
    return {f.relative_to(root).as_posix(): _file_digest(f) for f in _data_files(output)}


def verify_files(output: str | Path, manifest: Mapping[str, Any]) -> None:
    """Refuse ``output`` if a data file its manifest lists is missing or has other bytes.

    The error names the file: a truncated shard, a flipped byte, an edited table, a cut
    weight file. Manifests written before files were recorded are not checked.
    """
    output = Path(output)
    root = output.parent if output.is_file() else output
    for name, recorded in (manifest.get("files") or {}).items():
        file = root / name
        if not file.is_file():
            raise ManifestError(
                f"{file}: missing, though {manifest_path(output)} lists it; rerun the stage "
                "that wrote it"
            )
        if _file_digest(file) != recorded:
            raise ManifestError(
                f"{file}: corrupt or changed since it was written (its sha256 differs from "
                f"{manifest_path(output)}); rerun the stage that wrote it"
            )


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
        "files": file_digests(output),
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

    Every data file is verified against the digest its manifest records (:func:`verify_files`).
    Returns the input's manifest.
    """
    manifest = read_manifest(path)
    stages = {stage} if isinstance(stage, str) else set(stage)
    if manifest.get("stage") not in stages:
        raise ManifestError(
            f"{path}: is a {manifest.get('stage')!r} output, expected {' or '.join(sorted(stages))}"
        )
    verify_files(path, manifest)
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


def resolved_config_path(output: str | Path) -> Path:
    """Where the resolved config of ``output`` lives (``config.yaml`` inside a directory)."""
    output = Path(output)
    if output.is_dir() or not output.suffix:
        return output / CONFIG_NAME
    return output.with_name(output.name + ".config.yaml")


def begin_output(output: str | Path, stale: Sequence[str] = ()) -> None:
    """Mark ``output`` unfinished: drop its manifest and the files matching ``stale`` globs.

    An output without a manifest is never taken as finished, and files a previous run left
    (more shards, more images) cannot leak in. A directory output must exist already.
    """
    output = Path(output)
    manifest_path(output).unlink(missing_ok=True)
    for pattern in stale:
        for path in output.glob(pattern):
            path.unlink()


def finish_output(
    output: str | Path,
    config: Any,
    *,
    stage: str,
    seeds: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str | Path] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the resolved config beside ``output``, then its manifest (last: it marks done)."""
    import yaml

    atomic_write_text(
        resolved_config_path(output), yaml.safe_dump(to_dict(config), sort_keys=False)
    )
    return write_manifest(
        output, stage=stage, config=config, seeds=seeds, inputs=inputs, extra=extra
    )


def stage_inputs(source: str | Path, policy: str | Path) -> dict[str, Path]:
    """Manifest inputs of a sampling stage: the prompt file and the policy's weights, if any."""
    from jagg_pipeline.io.artifacts import BASE, policy_weights_dir
    from jagg_pipeline.io.prompts import TOY_SOURCES

    inputs = {} if str(source) in TOY_SOURCES else {"prompts": Path(source)}
    if str(policy) != BASE:
        inputs["policy"] = policy_weights_dir(policy)
    return inputs
