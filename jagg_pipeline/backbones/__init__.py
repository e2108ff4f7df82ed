"""Backbones: velocity networks behind one calling convention ``(z, sigma, cond) -> v``.

Today: the analytic diagnostic models that ``gradcheck`` and the gradient-core tests use.
The diffusers adapters (Flux, SD3, QwenImage) join this registry.
"""

from jagg_pipeline.backbones.analytic import (
    ANALYTIC_BACKBONES,
    AffineVelocity,
    AnalyticBackbone,
    MlpDiT,
    build_analytic,
)

__all__ = ["ANALYTIC_BACKBONES", "AffineVelocity", "AnalyticBackbone", "MlpDiT", "build_analytic"]
