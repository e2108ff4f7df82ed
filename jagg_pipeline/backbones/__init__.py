"""Backbones: velocity networks behind one calling convention ``(z, sigma, cond) -> v``.

Two kinds live here: the analytic diagnostic models that ``gradcheck`` and the gradient-core
tests use, and the diffusers adapters (Flux, SD3, QwenImage) behind the :class:`Backbone`
interface, chosen by ``BackboneConfig.family``. Family modules import diffusers, so they are
imported only when a family is loaded.
"""

from __future__ import annotations

import importlib
from typing import get_args

from jagg_pipeline.backbones.analytic import (
    ANALYTIC_BACKBONES,
    AffineVelocity,
    AnalyticBackbone,
    MlpDiT,
    build_analytic,
)
from jagg_pipeline.backbones.base import Backbone
from jagg_pipeline.backbones.loading import BackboneLoadError
from jagg_pipeline.config.run import BackboneConfig, BackboneFamily, LoraConfig

_FAMILIES = {
    "flux": ("jagg_pipeline.backbones.flux", "FluxBackbone"),
    "sd3": ("jagg_pipeline.backbones.sd3", "SD3Backbone"),
    "qwenimage": ("jagg_pipeline.backbones.qwenimage", "QwenImageBackbone"),
}
BACKBONE_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
if get_args(BackboneFamily) != BACKBONE_FAMILIES:
    raise ImportError(f"backbone families {BACKBONE_FAMILIES} differ from config.BackboneFamily")


def backbone_class(family: str) -> type[Backbone]:
    """The adapter class of ``family`` (imports its module on first use)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown backbone family {family!r}; choose from {BACKBONE_FAMILIES}")
    module, name = _FAMILIES[family]
    return getattr(importlib.import_module(module), name)


def load_backbone(spec: BackboneConfig) -> Backbone:
    """Load the checkpoint that ``spec`` names with its family's adapter."""
    return backbone_class(spec.family).load(spec)


__all__ = [
    "ANALYTIC_BACKBONES",
    "BACKBONE_FAMILIES",
    "AffineVelocity",
    "AnalyticBackbone",
    "Backbone",
    "BackboneConfig",
    "BackboneLoadError",
    "LoraConfig",
    "MlpDiT",
    "backbone_class",
    "build_analytic",
    "load_backbone",
]
