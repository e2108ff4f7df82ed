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

Digests: the manifest lists every data file's digest in the algorithm it names
(``digest_algorithm``: blake3; none named: sha256, manifests written before). Writing one
reads no file back: each digest was recorded while the file was written, by this process or
by the ranks that send theirs (:func:`recorded_digests`); an input's digest comes from the
input's manifest. A consumer verifies the files it reads (:func:`verify_files`). Hashing by
reading is counted (:func:`hash_counts`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jagg_pipeline import __version__
from jagg_pipeline.config.fields import digest, to_dict
from jagg_pipeline.io.artifacts import (
    DIGEST_ALGORITHM,
    DIGEST_ALGORITHMS,
    LEGACY_DIGEST_ALGORITHM,
    METRICS_NAME,
    FileKey,
    atomic_write_json,
    atomic_write_text,
    file_key,
    new_hasher,
    recorded_digest,
    reset_written_counts,
    written_counts,
)
from jagg_pipeline.io.shards import METADATA_FILE
from jagg_pipeline.support.errors import InputError

if TYPE_CHECKING:
    from jagg_pipeline.config.run import RunConfig

MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.yaml"
# The config sections (or dotted keys) each stage reads, narrowed by stage_values: the
# workflow's rules pass their digests as params (stage_digest), so a job reruns when a value it
# reads changes and only then. Rollouts also depend on the policy they sample from, a file
# input of the rule.
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
    # Of `rewards`, the models rewards.weights names (_rewards_read).
    "score": ("rewards", "advantage"),
    # Of the schedule, the learning rates of the round's own steps (TrainConfig.round_lrs).
    "train": ("backbone", "sampler", "advantage", "grpo", "jagg", "rewards", "train"),
    # Of `rewards`, the models eval.metrics names.
    "evaluate": ("backbone", "sampler.batch_size", "eval", "rewards"),
    # A prompt pool's conditioning: the text encoders' checkpoint, dtype and token cap, and
    # the negative prompt of CFG (io.conditioning.text_keys).
    "encode": (
        "backbone.family",
        "backbone.path",
        "backbone.revision",
        "backbone.dtype",
        "backbone.max_sequence_length",
        "backbone.negative_prompt",
        "backbone.cfg_scale",
    ),
}
# Keys no stage's result depends on: where training runs (a checkpoint resumes on any world
# size), how often evaluations run, and the schedule, of which the train stage reads its
# round's learning rates instead. Left out of stage_values, so changing them reruns nothing.
UNREAD_KEYS: tuple[str, ...] = (
    "train.nodes",
    "train.nproc",
    "train.rounds",
    "train.lr",
    "train.lr_schedule",
    "train.warmup_steps",
    "eval.every",
)
# In CHECKED_SECTIONS: compare everything the producing stage read (its stage_values, as
# the manifest's "reads" digest) instead of whole sections.
READS = "reads"
# What a consumer checks of a stage's output against its own config (check_input): of a
# rollout the whole sections it reads (a manifest records sections, not dotted keys); of a
# score table everything the score stage read (the rewards it ran, not the others); of a
# checkpoint only the backbone its weights fit, since evaluations compare policies trained
# under other sections.
CHECKED_SECTIONS: dict[str, tuple[str, ...]] = {
    "rollout": tuple(s for s in STAGE_SECTIONS["rollout"] if "." not in s),
    "score": (READS,),
    "train": ("backbone",),
    # Its text keys one by one (io.conditioning.open_conditioning): a section would refuse a
    # pool for a key the text encoders never read (backbone.device, training, ...).
    "encode": (),
}


def _select(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _rewards_read(config: RunConfig, stage: str) -> dict[str, Any]:
    """What ``stage`` reads of the rewards section: the device and the models it runs."""
    rewards = config.rewards
    if stage == "evaluate":
        names, options = list(config.eval.metrics), {}
    else:
        names = list(rewards.weights)
        options = {"weights": rewards.weights, "normalize_separately": rewards.normalize_separately}
    return {"device": rewards.device, **options, **{n: to_dict(rewards.spec(n)) for n in names}}


def stage_values(config: RunConfig, stage: str, round_index: int | None = None) -> dict[str, Any]:
    """The values ``stage`` reads of a run config (:data:`STAGE_SECTIONS`), as data.

    Keyed by section or dotted key, without :data:`UNREAD_KEYS`; ``rewards`` as the models the
    stage runs; the train stage's with ``train.round_lrs``, the learning rates of round
    ``round_index``'s optimizer steps (required for it).
    """
    data = to_dict(config)
    values = {key: _select(data, key) for key in STAGE_SECTIONS[stage]}
    for dotted in UNREAD_KEYS:
        section, key = dotted.split(".")
        if isinstance(values.get(section), dict):
            values[section] = {k: v for k, v in values[section].items() if k != key}
    if "rewards" in values:
        values["rewards"] = _rewards_read(config, stage)
    if stage == "train":
        if round_index is None:
            raise ValueError("stage_values: the train stage's values need the round index")
        values["train.round_lrs"] = config.train.round_lrs(round_index)
    return values


def stage_digest(config: RunConfig, stage: str, round_index: int | None = None) -> str:
    """Digest of exactly the values ``stage`` reads (:func:`stage_values`)."""
    return digest(stage_values(config, stage, round_index))


def read_digests(config: RunConfig, stage: str, round_index: int | None = None) -> dict[str, str]:
    """Digest of each value ``stage`` reads (:func:`stage_values`), by section or key."""
    return {key: digest(value) for key, value in stage_values(config, stage, round_index).items()}


class ManifestError(InputError):
    """An input's manifest is missing or does not match what the consuming stage expects."""


def manifest_path(output: str | Path) -> Path:
    """Where the manifest of ``output`` lives (inside a directory, beside a file)."""
    output = Path(output)
    if output.is_dir() or not output.suffix:
        return output / MANIFEST_NAME
    return output.with_name(output.name + ".manifest.json")


# Every byte hashed by reading a file goes through _hash_file, which counts it by path.
_READ_BLOCK = 8 << 20  # enough for blake3 to spread each block over the cores
_reads: dict[str, list[int]] = {}  # path -> [times hashed, bytes hashed]
_reads_lock = threading.Lock()


def _hash_file(path: str, algorithm: str) -> str:
    hasher = new_hasher(algorithm)
    size = 0
    view = memoryview(bytearray(_READ_BLOCK))
    with open(path, "rb") as handle:
        while count := handle.readinto(view):
            hasher.update(view[:count])
            size += count
    with _reads_lock:
        counted = _reads.setdefault(path, [0, 0])
        counted[0] += 1
        counted[1] += size
    return hasher.hexdigest()


@functools.lru_cache(maxsize=4096)
def _cached_digest(path: str, algorithm: str, key: FileKey) -> str:
    return _hash_file(path, algorithm)


def file_digest(path: str | Path, algorithm: str = DIGEST_ALGORITHM) -> str:
    """The ``algorithm`` digest (hex) of a file, read and hashed once per process while unchanged.

    A stage may verify an input's file and digest it again for its own manifest: the second
    time is free. A rewrite changes the inode (atomic writes) or the size and mtime. Counted
    in :func:`hash_counts`; what this process wrote itself it never needs to read
    (:func:`file_digests`).
    """
    path = Path(path)
    return _cached_digest(str(path.resolve()), algorithm, file_key(path.stat()))


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file (:func:`file_digest`): what ``score-images`` records."""
    return file_digest(path, LEGACY_DIGEST_ALGORITHM)


def hash_counts() -> dict[str, Any]:
    """What this process hashed since :func:`reset_hash_counts`.

    ``read``: hashed by reading files (``files``: how many hashings, ``bytes``, and ``paths``:
    path -> ``{"times", "bytes"}``); ``written``: hashed while writing them (files, bytes).
    """
    with _reads_lock:
        paths = {path: {"times": t, "bytes": b} for path, (t, b) in _reads.items()}
    read = {
        "files": sum(p["times"] for p in paths.values()),
        "bytes": sum(p["bytes"] for p in paths.values()),
        "paths": paths,
    }
    return {"read": read, "written": written_counts()}


def reset_hash_counts() -> None:
    """Zero :func:`hash_counts` (the digests already known stay known)."""
    with _reads_lock:
        _reads.clear()
    reset_written_counts()


def manifest_algorithm(manifest: Mapping[str, Any], where: str | Path = "the manifest") -> str:
    """The algorithm of a manifest's digests: its ``digest_algorithm``, sha256 if it has none.

    Manifests written before the algorithm was named are sha256 ones. ``where`` names the
    manifest in the error an unknown algorithm raises.
    """
    algorithm = manifest.get("digest_algorithm", LEGACY_DIGEST_ALGORITHM)
    if algorithm not in DIGEST_ALGORITHMS:
        raise ManifestError(
            f"{where}: digest_algorithm {algorithm!r} is not one this version verifies "
            f"({', '.join(DIGEST_ALGORITHMS)}); rerun the stage that wrote it, or use a newer "
            "jagg-pipeline"
        )
    return algorithm


def _combined(digests: Mapping[str, str], algorithm: str) -> str:
    """One digest of a folder's files: its relative names and their digests, in path order."""
    h = new_hasher(algorithm)
    for relative in sorted(digests, key=lambda name: name.split("/")):
        h.update(relative.encode() + b"\0" + digests[relative].encode() + b"\n")
    return h.hexdigest()


def _listed_digests(path: Path, algorithm: str) -> dict[str, str] | None:
    """The digests of ``path``'s data files as a finished output's manifest lists them.

    Keyed as :func:`file_digests` keys them. The manifest is the nearest one of ``path`` or
    a folder above it; None unless it is in ``algorithm`` and lists exactly the data files
    ``path`` holds (a listing, nothing read).
    """
    path = path.absolute()
    for output in (path, *path.parents):
        where = manifest_path(output)
        if where.is_file():
            break
    else:
        return None
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    if manifest.get("digest_algorithm", LEGACY_DIGEST_ALGORITHM) != algorithm:
        return None
    listed = manifest["files"]
    root = output.parent if output.is_file() else output
    on_disk = {f.relative_to(root).as_posix(): f for f in data_files(path)}
    if path.is_dir() and path != root:
        prefix = path.relative_to(root).as_posix() + "/"
        wanted = {name for name in listed if name.startswith(prefix)}
    else:
        wanted = set(listed) if path.is_dir() else set(on_disk)
    if set(on_disk) != wanted or not wanted <= set(listed):
        return None
    base = path if path.is_dir() else path.parent
    return {f.relative_to(base).as_posix(): listed[name] for name, f in on_disk.items()}


def digest_path(path: str | Path, algorithm: str = DIGEST_ALGORITHM) -> str:
    """``algorithm`` digest of a file, or of a directory's files (relative names and digests).

    A directory's own manifest and its metrics (timings: not data) are left out, so writing
    them does not change the digest. In a finished output (the output, or a folder or file in
    it: a checkpoint's ``policy/``) the digests are those its manifest lists, when it lists
    exactly the files there in ``algorithm``: nothing is read, since a consumer verifies
    the files it reads (:func:`verify_files`). Else :func:`file_digests`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: nothing to digest")
    digests = _listed_digests(path, algorithm)
    if digests is None:
        digests = file_digests(path, algorithm)
    return digests[path.name] if path.is_file() else _combined(digests, algorithm)


# Sharded tensor folders keep their index in a hidden file.
_HIDDEN_DATA = (METADATA_FILE,)


def data_files(path: Path) -> list[Path]:
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


def file_digests(
    output: str | Path,
    algorithm: str = DIGEST_ALGORITHM,
    recorded: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The digest of every data file of ``output`` by name (relative to a directory output).

    Each is the digest recorded while the file was written: in ``recorded`` (relative name
    -> digest, from the other processes of a sharded write, :func:`recorded_digests`), else
    in this process's ledger (:mod:`jagg_pipeline.io.artifacts`). Only a file nobody
    recorded is read to hash it (:func:`file_digest`, counted).
    """
    output = Path(output)
    root = output.parent if output.is_file() else output
    files = {f.relative_to(root).as_posix(): f for f in data_files(output)}
    recorded = dict(recorded or {})
    if absent := sorted(set(recorded) - set(files)):
        raise ValueError(f"{output}: digests were recorded for files it lacks: {absent[:3]}")
    return {
        name: recorded.get(name) or recorded_digest(file, algorithm) or file_digest(file, algorithm)
        for name, file in files.items()
    }


def listed_files(output: str | Path) -> dict[str, Any]:
    """The ``digest_algorithm`` and ``files`` entries of a manifest of ``output`` as it is now.

    For outputs written outside the stage contract (the toy world's folders), so that
    ``verify`` and :func:`digest_path` can rely on their listing like any stage's.
    """
    return {"digest_algorithm": DIGEST_ALGORITHM, "files": file_digests(output)}


def recorded_digests(folder: str | Path, algorithm: str = DIGEST_ALGORITHM) -> dict[str, str]:
    """The digests this process recorded while writing ``folder``'s data files, by name.

    Names are relative to ``folder``: what each rank of a sharded write sends to the rank
    that writes the manifest (``recorded`` of :func:`finish_output`). Nothing is read.
    """
    folder = Path(folder)
    return {
        file.relative_to(folder).as_posix(): found
        for file in data_files(folder)
        if (found := recorded_digest(file, algorithm)) is not None
    }


def verify_files(
    output: str | Path, manifest: Mapping[str, Any], names: Iterable[str] | None = None
) -> None:
    """Refuse ``output`` if a data file its manifest lists is missing or has other bytes.

    ``names``: the files to check (relative names, as the manifest lists them; None: every
    file listed), each hashed with the manifest's algorithm (:func:`manifest_algorithm`).
    The error names the file: a truncated shard, a flipped byte, an edited table, a cut
    weight file. Manifests written before files were recorded are not checked.
    """
    output = Path(output)
    root = output.parent if output.is_file() else output
    listed = manifest.get("files")
    if listed is None:
        return
    where = manifest_path(output)
    algorithm = manifest_algorithm(manifest, where)
    for name in listed if names is None else names:
        file = root / name
        if name not in listed:
            raise ManifestError(
                f"{file}: not listed in {where}, so it cannot be verified; rerun the stage "
                "that wrote the output"
            )
        if not file.is_file():
            raise ManifestError(
                f"{file}: missing, though {where} lists it; rerun the stage that wrote it"
            )
        if file_digest(file, algorithm) != listed[name]:
            raise ManifestError(
                f"{file}: corrupt or changed since it was written (its {algorithm} differs "
                f"from {where}); rerun the stage that wrote it"
            )


def section_digests(config: RunConfig) -> dict[str, str]:
    """Digest of each top-level section of a config dataclass."""
    return {f.name: digest(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _reads_entry(stage: str, config: RunConfig, seeds: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``{"reads": {key: digest}}`` (:func:`read_digests`).

    For a stage of :data:`STAGE_SECTIONS`; a training round's from its ``round`` seed (weights
    saved outside a round have none: nothing consumes them as a round's output).
    """
    if stage not in STAGE_SECTIONS or (stage == "train" and "round" not in seeds):
        return {}
    return {READS: read_digests(config, stage, seeds.get("round"))}


def write_manifest(
    output: str | Path,
    *,
    stage: str,
    config: RunConfig,
    seeds: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str | Path] | None = None,
    extra: Mapping[str, Any] | None = None,
    recorded: Mapping[str, str] | None = None,
) -> Path:
    """Write the manifest of ``output`` (after ``output`` itself is complete).

    Its digests are :data:`DIGEST_ALGORITHM` ones, named in ``digest_algorithm``; each file's
    is the one recorded while writing it (``recorded``: by other processes, see
    :func:`file_digests`), each input's comes from the input's own manifest
    (:func:`digest_path`).
    """
    manifest = {
        "stage": stage,
        "version": __version__,
        "digest_algorithm": DIGEST_ALGORITHM,
        "config_digest": digest(config),
        "sections": section_digests(config),
        **_reads_entry(stage, config, seeds or {}),
        "seeds": dict(seeds or {}),
        "inputs": {
            name: {"path": str(path), "digest": digest_path(path, DIGEST_ALGORITHM)}
            for name, path in (inputs or {}).items()
        },
        "files": file_digests(output, DIGEST_ALGORITHM, recorded),
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


def check_made(
    path: str | Path, *, stage: str | Iterable[str], config: RunConfig, sections: Iterable[str] = ()
) -> dict[str, Any]:
    """The manifest of ``path``, refused unless a ``stage`` output made under ``sections``.

    ``sections``: config sections compared whole, or :data:`READS` alone: every value the
    stage that made ``path`` read (its manifest's ``reads``, :func:`read_digests`).

    Nothing is hashed: a consumer verifies the files it reads (:func:`verify_files`,
    :mod:`jagg_pipeline.io.verify` once per node).
    """
    manifest = read_manifest(path)
    stages = {stage} if isinstance(stage, str) else set(stage)
    if manifest.get("stage") not in stages:
        raise ManifestError(
            f"{path}: is a {manifest.get('stage')!r} output, expected {' or '.join(sorted(stages))}"
        )
    if READS in sections:
        # A manifest written before "reads" was recorded differs in every value.
        made = manifest.get("stage")
        ours = read_digests(config, made, manifest.get("seeds", {}).get("round"))
        theirs, sections = manifest.get(READS, {}), list(ours)
    else:
        ours, theirs = section_digests(config), manifest.get("sections", {})
    differing = [s for s in sections if theirs.get(s) != ours[s]]
    if differing:
        raise ManifestError(
            f"{path}: was made with a different config section {', '.join(differing)} "
            f"(manifest {manifest_path(path)}); rerun it with this config or pass the config "
            "it was made with"
        )
    return manifest


def check_input(
    path: str | Path,
    *,
    stage: str | Iterable[str],
    config: RunConfig,
    sections: Iterable[str] = (),
) -> dict[str, Any]:
    """:func:`check_made`, then every data file verified against its recorded digest.

    For a consumer that reads all of ``path`` (:func:`verify_files`). Returns the manifest.
    """
    manifest = check_made(path, stage=stage, config=config, sections=sections)
    verify_files(path, manifest)
    return manifest


def check_derived_from(
    path: str | Path, manifest: Mapping[str, Any], name: str, source: str | Path
) -> None:
    """Refuse ``path`` unless its manifest lists ``source`` (as input ``name``) with its digest.

    The digest of ``source`` is computed with the algorithm of ``path``'s manifest.
    """
    algorithm = manifest_algorithm(manifest, manifest_path(path))
    recorded = manifest.get("inputs", {}).get(name)
    if recorded is None or recorded.get("digest") != digest_path(source, algorithm):
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
    config: RunConfig,
    *,
    stage: str,
    seeds: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str | Path] | None = None,
    extra: Mapping[str, Any] | None = None,
    recorded: Mapping[str, str] | None = None,
) -> Path:
    """Write the resolved config beside ``output``, then its manifest (last: it marks done).

    ``recorded``: the digests other processes recorded while writing their files of
    ``output`` (relative names; the union of their :func:`recorded_digests`), so that no
    file is read back (:func:`write_manifest`).
    """
    import yaml

    atomic_write_text(
        resolved_config_path(output), yaml.safe_dump(to_dict(config), sort_keys=False)
    )
    return write_manifest(
        output,
        stage=stage,
        config=config,
        seeds=seeds,
        inputs=inputs,
        extra=extra,
        recorded=recorded,
    )


def stage_inputs(source: str | Path, policy: str | Path) -> dict[str, Path]:
    """Manifest inputs of a sampling stage: the prompt file and the policy's weights, if any."""
    from jagg_pipeline.io.artifacts import BASE, policy_weights_dir
    from jagg_pipeline.io.prompts import TOY_SOURCES

    inputs = {} if str(source) in TOY_SOURCES else {"prompts": Path(source)}
    if str(policy) != BASE:
        inputs["policy"] = policy_weights_dir(policy)
    return inputs
