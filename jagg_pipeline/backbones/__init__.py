"""Backbones: velocity networks behind one calling convention ``(z, sigma, cond) -> v``.

Two kinds live here: the analytic diagnostic models that ``gradcheck`` and the gradient-core
tests use, and the diffusers adapters (Flux, SD3, QwenImage) behind the :class:`Backbone`
interface, chosen by ``BackboneSpec.family``. Family modules import diffusers, so they are
imported only when a family is loaded.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, get_args

from jagg_pipeline.backbones.analytic import (
    ANALYTIC_BACKBONES,
    AffineVelocity,
    AnalyticBackbone,
    MlpDiT,
    build_analytic,
)
from jagg_pipeline.backbones.base import Backbone, BackboneLoadError
from jagg_pipeline.config import BackboneFamily, BackboneSpec, LoraSettings

_FAMILIES = {
    "flux": ("jagg_pipeline.backbones.flux", "FluxBackbone"),
    "sd3": ("jagg_pipeline.backbones.sd3", "SD3Backbone"),
    "qwenimage": ("jagg_pipeline.backbones.qwenimage", "QwenImageBackbone"),
}
BACKBONE_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
if get_args(BackboneFamily) != BACKBONE_FAMILIES:
    raise ImportError(f"backbone families {BACKBONE_FAMILIES} differ from config.BackboneFamily")
TINY_BACKBONES: tuple[str, ...] = tuple(f"tiny-{family}" for family in _FAMILIES)


def backbone_class(family: str) -> type[Backbone]:
    """The adapter class of ``family`` (imports its module on first use)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown backbone family {family!r}; choose from {BACKBONE_FAMILIES}")
    module, name = _FAMILIES[family]
    return getattr(importlib.import_module(module), name)


def load_backbone(spec: BackboneSpec) -> Backbone:
    """Load the checkpoint that ``spec`` names with its family's adapter."""
    return backbone_class(spec.family).load(spec)


def load_tiny_backbone(name: str, directory: str | Path, seed: int = 0, **spec: Any) -> Backbone:
    """Build the tiny pipeline ``name`` (``tiny-flux``, ...) into ``directory`` and load it.

    The spec defaults fit the tiny models (32 x 32 images, float32, 16 T5 tokens, full
    fine-tuning); keyword arguments override any :class:`BackboneSpec` field.
    """
    from jagg_pipeline.backbones.tiny import TINY_IMAGE_SIZE, save_tiny_pipeline

    if name not in TINY_BACKBONES:
        raise ValueError(f"unknown tiny backbone {name!r}; choose from {TINY_BACKBONES}")
    family = name.removeprefix("tiny-")
    save_tiny_pipeline(family, directory, seed)
    options = {
        "height": TINY_IMAGE_SIZE,
        "width": TINY_IMAGE_SIZE,
        "dtype": "float32",
        "max_sequence_length": 16,
        "training": "full",
        **spec,
    }
    return load_backbone(BackboneSpec(family=family, path=str(directory), **options))


__all__ = [
    "ANALYTIC_BACKBONES",
    "BACKBONE_FAMILIES",
    "TINY_BACKBONES",
    "AffineVelocity",
    "AnalyticBackbone",
    "Backbone",
    "BackboneLoadError",
    "BackboneSpec",
    "LoraSettings",
    "MlpDiT",
    "backbone_class",
    "build_analytic",
    "load_backbone",
    "load_tiny_backbone",
]
