"""Export folders: how one is recognised, and which ``--out`` an export may replace.

``export`` writes a checkpoint's policy as a folder the usual loaders read as it is: for
``backbone.training: lora`` an adapter (``adapter_config.json``, ``adapter_model.safetensors``,
``pytorch_lora_weights.safetensors``), for ``full`` a diffusers pipeline folder (the base
checkpoint's components, the trained ``transformer/`` in its place). Each also carries a stage
manifest, ``manifest.json`` (stage :data:`STAGE`, its kind under ``export``, the checkpoint's
``policy/`` as input, every file's digest), which those loaders ignore.

That manifest, not the file set, is what makes a folder a previous export: the base model's
own folder has a diffusers pipeline's files and a user's own adapter a LoRA export's, and
replacing either would delete what export never wrote. Its file list also tells whether a
previous export still holds only what export wrote.

:func:`check_destination` reads ``--out`` before anything is loaded or written and refuses
what replacing it would destroy; it writes, moves and removes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from jagg_pipeline.io.artifacts import ROUND_FOLDER
from jagg_pipeline.io.manifest import CONFIG_NAME, MANIFEST_NAME
from jagg_pipeline.support.errors import InputError

# The ``stage`` of an export's manifest; its ``export`` field holds one of KINDS.
STAGE = "export"
KINDS = {"lora": "a LoRA adapter", "full": "a diffusers pipeline, of full fine-tuning"}

_FRESH = "name a new folder or an empty one, e.g. --out exported/"


class DestinationError(InputError):
    """``--out`` names something an export would destroy; nothing was written or moved.

    The message is ``--out PATH: <why>; <fix>``.
    """


def _refuse(out: Path, why: str, fix: str = _FRESH) -> DestinationError:
    return DestinationError(f"--out {out}: {why}; {fix}")


def check_destination(
    out: str | Path, checkpoint: str | Path, kind: str, base: str | Path | None = None
) -> bool:
    """Whether writing the ``kind`` export of ``checkpoint`` to ``out`` replaces a previous one.

    True: ``out`` is a previous export of ``kind`` holding only the files its manifest lists.
    False: nothing is at ``out``, or an empty folder. Anything else raises
    :class:`DestinationError`: ``out`` (symlinks and ``..`` resolved) is or holds the current
    folder or the home folder, is the checkpoint, holds it or lies inside it, lies inside the
    local ``base`` checkpoint (``backbone.path``), is a file, a stage output, a run folder,
    a run's round folder, a Snakemake folder, an export of the other kind or one with files
    added since, or any other non-empty folder. Only reads.
    """
    given, target = Path(out), Path(out).resolve()
    for folder, name in ((Path.cwd(), "the current folder"), (Path.home(), "the home folder")):
        if folder.resolve().is_relative_to(target):
            what = name if target == folder.resolve() else f"a folder holding {name}"
            raise _refuse(given, f"is {what} ({target})")
    ckpt = Path(checkpoint).resolve()
    if target == ckpt:
        raise _refuse(given, "is the checkpoint being exported")
    if ckpt in target.parents:
        raise _refuse(
            given,
            f"is inside the checkpoint being exported ({ckpt}), which the run's retention "
            "(workflow.keep_every) may delete with the export in it",
        )
    if target in ckpt.parents:
        raise _refuse(given, f"holds the checkpoint being exported ({ckpt})")
    if base is not None and target.is_relative_to(Path(base).resolve()):
        raise _refuse(given, f"is the base checkpoint (backbone.path) or inside it ({base})")
    if not target.exists():
        return False
    if not target.is_dir():
        raise _refuse(given, "is an existing file (an export is a folder)")
    entries = sorted(entry.name for entry in target.iterdir())
    if not entries:
        return False
    if MANIFEST_NAME in entries:
        return _previous_export(given, target, kind)
    rounds = [name for name in entries if ROUND_FOLDER.fullmatch(name)]
    if rounds or CONFIG_NAME in entries:
        held = ", ".join([*rounds[:2], *([CONFIG_NAME] if CONFIG_NAME in entries else [])])
        raise _refuse(given, f"is a run folder (it holds {held})")
    if ROUND_FOLDER.fullmatch(target.name):
        raise _refuse(given, "is a round folder of a run")
    if ".snakemake" in entries:
        raise _refuse(given, "is a Snakemake working folder (it holds .snakemake/)")
    raise _refuse(
        given,
        f"is a non-empty folder that export did not write (it holds {', '.join(entries[:3])}"
        f"{', ...' if len(entries) > 3 else ''}; an export carries {MANIFEST_NAME})",
        "name a new folder or an empty one, or delete this one yourself",
    )


def _previous_export(given: Path, target: Path, kind: str) -> bool:
    """True when ``target`` (holding a manifest) is an export of ``kind`` and nothing more."""
    try:
        manifest = json.loads((target / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        raise _refuse(given, f"holds a {MANIFEST_NAME} that is not a readable manifest")
    if manifest.get("stage") != STAGE:
        raise _refuse(
            given, f"is the output of stage {manifest.get('stage')!r} (its {MANIFEST_NAME})"
        )
    theirs = manifest.get("export")
    if theirs != kind:
        raise _refuse(
            given,
            f"holds an export of another kind ({KINDS.get(theirs, repr(theirs))}; this "
            f"checkpoint exports {KINDS[kind]})",
            "name another folder, or delete this one yourself",
        )
    listed = set(manifest.get("files") or ())
    # A symlink counts as added: an export writes none, and one to a folder is not ours.
    added = sorted(
        relative
        for path in target.rglob("*")
        if (path.is_symlink() or not path.is_dir())
        and (relative := path.relative_to(target).as_posix()) not in listed | {MANIFEST_NAME}
    )
    if added:
        raise _refuse(
            given,
            f"is a previous export, but holds files it did not write ({', '.join(added[:3])}"
            f"{', ...' if len(added) > 3 else ''})",
            "move them out, or name another folder",
        )
    return True
