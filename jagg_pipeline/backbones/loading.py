"""Finding and loading a backbone's checkpoint: path resolution, checks, pipeline components.

Owns:

- :class:`BackboneLoadError` and its messages naming the keys of :class:`BackboneConfig`, the
  config section of a backbone (defined, torch-free, in :mod:`jagg_pipeline.config.run`);
- the weight dtypes a backbone loads in (:data:`DTYPES`);
- resolving ``path`` to a local directory: an existing directory first, a hub id second (with
  ``HF_HUB_OFFLINE=1`` a missing model fails at once, naming the key to set);
- reading the components with the family's own diffusers pipeline loader
  (:func:`load_components`, what :meth:`Backbone.load` builds a backbone from).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, get_args

import torch

from jagg_pipeline.config import sources
from jagg_pipeline.config.run import BackboneConfig, BackboneDtype
from jagg_pipeline.config.sources import snapshot_dir
from jagg_pipeline.support.errors import InputError
from jagg_pipeline.support.startup import importing

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
if tuple(DTYPES) != get_args(BackboneDtype):
    raise ImportError(f"backbone DTYPES {tuple(DTYPES)} differ from config.BackboneDtype")

# Only the diffusers-format parts of a hub repository (Flux repos also hold a 23 GB
# original-format checkpoint at the top level).
HUB_PATTERNS = (
    "model_index.json",
    "scheduler/*",
    "transformer/*",
    "vae/*",
    "text_encoder*/*",
    "tokenizer*/*",
)


class BackboneLoadError(InputError):
    """A checkpoint could not be found or does not fit the configured family."""


def resolve_checkpoint(spec: BackboneConfig) -> Path:
    """The local directory of ``spec.path``: an existing directory, else a hub id's snapshot.

    Hub snapshots are limited to the diffusers parts (:data:`HUB_PATTERNS`). Offline
    (``HF_HUB_OFFLINE=1``) a hub id must already be in the local cache.
    """
    return snapshot_dir(
        f"{spec.key}.path",
        spec.path,
        "a local diffusers-format directory (the one holding model_index.json) or a hub id",
        revision=spec.revision,
        allow_patterns=HUB_PATTERNS,
        error=BackboneLoadError,
    )


def read_model_index(directory: Path, spec: BackboneConfig) -> dict[str, Any]:
    """``model_index.json`` of a checkpoint, checked to be a checkpoint of ``spec.family``."""
    return sources.read_model_index(
        directory, f"{spec.key}.path", spec.path, spec.family, BackboneLoadError
    )


def load_components(
    spec: BackboneConfig, text_components: tuple[str, ...]
) -> tuple[dict[str, Any], Path]:
    """The pipeline components of checkpoint ``spec.path`` and its local directory.

    The directory is checked first (model_index.json, pipeline class, component folders)
    so that mistakes fail with a message naming the config key; the components are then
    read by ``spec.family``'s own diffusers pipeline loader and the pipeline object dropped.
    ``text_components`` are skipped when ``spec.load_text_encoders`` is false.
    """
    path = resolve_checkpoint(spec)
    index = read_model_index(path, spec)
    # Most of a stage's start-up: the pipeline module imports diffusers' models and loaders,
    # transformers, peft and scipy.
    with importing():
        import diffusers

        # diffusers only loads components from libraries already imported; components of
        # our own package (the toy world's codec) are code we ship, so import them first.
        for entry in index.values():
            if isinstance(entry, list) and str(entry[0]).startswith("jagg_pipeline."):
                importlib.import_module(entry[0])
        pipeline_class = getattr(diffusers, sources.PIPELINE_CLASSES[spec.family])
    skipped = {} if spec.load_text_encoders else dict.fromkeys(text_components)
    pipeline = pipeline_class.from_pretrained(path, dtype=DTYPES[spec.dtype], **skipped)
    return dict(pipeline.components), path
