"""Finding and loading a backbone's checkpoint: path resolution, checks, pipeline components.

Owns:

- :class:`BackboneLoadError` and its messages naming the keys of :class:`BackboneConfig`, the
  config section of a backbone (defined, torch-free, in :mod:`jagg_pipeline.config.run`);
- the weight dtypes a backbone loads in (:data:`DTYPES`);
- resolving ``path`` to a local directory: an existing directory first, a hub id second (with
  ``HF_HUB_OFFLINE=1`` a missing model fails at once, naming the key to set);
- reading the components with the family's own diffusers pipeline loader
  (:func:`load_components`, what :meth:`Backbone.load` builds a backbone from);
- a transformer without its weights, for loads sized to the shard: built as diffusers builds
  it but with every parameter on the meta device (:func:`empty_transformer`), then filled by
  rows from the checkpoint's safetensors (:func:`read_transformer_rows`), each rank reading
  only the rows of its own shards, converted as diffusers converts them.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

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

TRANSFORMER = "transformer"  # the pipeline component, and its folder in a checkpoint
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = f"{WEIGHTS_NAME}.index.json"
# How much a rank reads from the memory-mapped files before closing them (_TransformerFiles).
_REOPEN_BYTES = 64 << 20

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
    spec: BackboneConfig,
    text_components: tuple[str, ...],
    *,
    empty: bool = False,
    text_only: bool = False,
) -> tuple[dict[str, Any], Path]:
    """The pipeline components of checkpoint ``spec.path`` and its local directory.

    The directory is checked first (model_index.json, pipeline class, component folders)
    so that mistakes fail with a message naming the config key; the components are then
    read by ``spec.family``'s own diffusers pipeline loader and the pipeline object dropped.
    ``text_components`` are skipped when ``spec.load_text_encoders`` is false. ``empty``: the
    transformer is not read but built with its parameters on the meta device
    (:func:`empty_transformer`), for the caller to shard and fill. ``text_only``: only
    ``text_components`` are read, whatever ``spec.load_text_encoders`` says (the others are
    None: the encode stage needs no transformer, VAE or scheduler).
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
    if empty:
        skipped[TRANSFORMER] = None
    if text_only:
        skipped = {
            name: None
            for name, entry in index.items()
            if isinstance(entry, list) and name not in text_components
        }
    pipeline = pipeline_class.from_pretrained(path, dtype=DTYPES[spec.dtype], **skipped)
    components = dict(pipeline.components)
    if empty:
        components[TRANSFORMER] = empty_transformer(path, index, spec)
    return components, path


# --------------------------------------------------------------------------------------------
# The transformer without its weights, filled by rows
# --------------------------------------------------------------------------------------------


def _transformer_class(index: dict[str, Any], spec: BackboneConfig) -> type[nn.Module]:
    library, name = index[TRANSFORMER]
    module = importlib.import_module(library)
    if not hasattr(module, name):
        raise BackboneLoadError(
            f"{spec.key}.path={spec.path}: model_index.json names the transformer class "
            f"{library}.{name}, which this diffusers does not have"
        )
    return getattr(module, name)


def _load_dtype(cls: type[nn.Module], name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype diffusers' ``from_pretrained`` gives a floating tensor ``name`` of ``cls``."""
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    return torch.float32 if any(module in name.split(".") for module in keep) else dtype


def empty_transformer(path: Path, index: dict[str, Any], spec: BackboneConfig) -> nn.Module:
    """The transformer of checkpoint ``path`` as diffusers builds it, its parameters on meta.

    Built like ``from_pretrained`` builds it: from its config, under the load dtype as the
    default dtype (what it computes at construction, rotary tables say, follows it), with
    accelerate's empty-weights context, which puts parameters on the meta device and leaves
    buffers and plain tensors real. The parameters take the dtype ``from_pretrained`` would
    give them, and the persistent buffers their values from the checkpoint; the parameter
    values are read later, only the rows a rank holds (:func:`read_transformer_rows`).
    """
    from accelerate import init_empty_weights

    cls = _transformer_class(index, spec)
    dtype = DTYPES[spec.dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with init_empty_weights(include_buffers=False):
            model = cls.from_config(cls.load_config(path / TRANSFORMER))
    finally:
        torch.set_default_dtype(previous)
    for name, param in model.named_parameters():
        if param.is_floating_point():
            param.data = param.data.to(_load_dtype(cls, name, dtype))
    persistent = set(model.state_dict()) - {name for name, _ in model.named_parameters()}
    if persistent:
        with _TransformerFiles(path / TRANSFORMER, spec) as files:
            for name in sorted(persistent):
                owner, _, leaf = name.rpartition(".")
                value = files.rows(name, None)
                if value.is_floating_point():
                    value = value.to(_load_dtype(cls, name, dtype))
                # A copy: a view would keep the file mapped as long as the model lives.
                model.get_submodule(owner).register_buffer(leaf, value.clone())
    return model.eval()


def read_transformer_rows(
    directory: Path,
    spec: BackboneConfig,
    targets: Mapping[str, tuple[torch.Tensor, slice | None]],
    cls: type[nn.Module],
) -> None:
    """Copy rows of the checkpoint's transformer weights into ``targets``, in place.

    ``targets``: checkpoint name -> (the tensor to fill, the rows of dim 0 it holds; None: all
    of it). Only those rows are read (safetensors slices of memory-mapped files), converted
    to the dtype diffusers would load them in (``spec.dtype``; float32 for a class's
    ``_keep_in_fp32_modules``), then copied to the target's device. A name the checkpoint
    lacks is refused naming the file.
    """
    dtype = DTYPES[spec.dtype]
    with _TransformerFiles(directory, spec) as files:
        for name, (target, rows) in targets.items():
            value = files.rows(name, rows)
            if value.is_floating_point():
                value = value.to(_load_dtype(cls, name, dtype))
            if tuple(value.shape) != tuple(target.shape):
                raise BackboneLoadError(
                    f"{files.file_of(name)}: {name} has rows of shape {tuple(value.shape)}, "
                    f"the model expects {tuple(target.shape)}; {spec.key}.path holds another "
                    "transformer than its config describes"
                )
            target.copy_(value)


class _TransformerFiles:
    """The safetensors files of a diffusers transformer folder, opened as rows are read.

    One file, or several with the index json that maps each weight to its file. The files
    are memory-mapped; once :data:`_REOPEN_BYTES` have been read, every open one is closed
    (and reopened when read again), so the mapped pages a rank touched leave its resident
    memory: a load holds no more of the files than that on top of its own shards.
    """

    def __init__(self, directory: Path, spec: BackboneConfig) -> None:
        self.directory = directory
        index = directory / WEIGHTS_INDEX
        single = directory / WEIGHTS_NAME
        if index.is_file():
            self.weight_map: dict[str, str] | None = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            self.weight_map = None
        else:
            raise BackboneLoadError(
                f"{spec.key}.path={spec.path}: {directory} has neither {WEIGHTS_NAME} nor "
                f"{WEIGHTS_INDEX}; a sharded load reads safetensors only (convert the "
                "transformer with save_pretrained(safe_serialization=True))"
            )
        self._handles: dict[Path, Any] = {}
        self._keys: dict[Path, set[str]] = {}
        self._read = 0  # bytes read since the files were last closed

    def __enter__(self) -> _TransformerFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every open file (a mapping lives on while a tensor read from it does)."""
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._read = 0

    def file_of(self, name: str) -> Path:
        if self.weight_map is None:
            return self.directory / WEIGHTS_NAME
        if name not in self.weight_map:
            raise BackboneLoadError(
                f"{self.directory / WEIGHTS_INDEX}: lists no {name}, which the model has"
            )
        return self.directory / self.weight_map[name]

    def rows(self, name: str, rows: slice | None) -> torch.Tensor:
        """Rows ``rows`` of tensor ``name`` (None: the whole tensor)."""
        from safetensors import safe_open

        if self._read >= _REOPEN_BYTES:
            self.close()
        file = self.file_of(name)
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), "pt")
            self._keys.setdefault(file, set(self._handles[file].keys()))
        if name not in self._keys[file]:
            raise BackboneLoadError(f"{file}: holds no {name}, which the model has")
        handle = self._handles[file]
        value = handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
        self._read += value.numel() * value.element_size()
        return value
