"""The gradient diagnostic: how close JAGG and no-interp come to the exact GRPO gradient.

Builds a trajectory batch on a backbone (a straight rectified-flow ``chord`` path, on which
JAGG is exact for an affine velocity field, or a real ``sde`` rollout), a GRPO objective on
it, and compares, window by window, the jagg and no_interp gradients with the exact one. Also
counts the backward passes each mode spends on the whole trajectory under ``jagg_frac``.
Backbones: the analytic models, or ``tiny-flux``/``tiny-sd3``/``tiny-qwenimage`` (a tiny random
diffusers checkpoint built in a temporary directory and loaded through its adapter, with the
checkpoint's own sigma schedule and toy-caption conditioning).
Returns a plain dict (the JSON report); :mod:`jagg_pipeline.bench.gradcheck_report` reads
it (the printed tables, the worst window), the CLI prints and writes it.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

from jagg_pipeline.backbones import (
    ANALYTIC_BACKBONES,
    AnalyticBackbone,
    Backbone,
    build_analytic,
)
from jagg_pipeline.bench.gradcheck_config import (
    BACKBONES,
    DTYPE_NAMES,
    TRAJECTORIES,
    GradcheckConfig,
)
from jagg_pipeline.core import grpo, jagg, sde
from jagg_pipeline.core.objective import GRPOStepLoss, recompute_log_probs
from jagg_pipeline.core.options import EngineOptions
from jagg_pipeline.toyworld.tiny import TINY_BACKBONES, load_tiny_backbone

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# The command line offers these without importing torch; they must name what exists here.
assert BACKBONES == ANALYTIC_BACKBONES + TINY_BACKBONES
assert tuple(DTYPES) == DTYPE_NAMES


def _chord_latents(
    batch: int,
    shape: tuple[int, ...],
    sigmas: torch.Tensor,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> torch.Tensor:
    """x_sigma = (1 - sigma) x0 + sigma eps at every sigma: a straight line, linear in t."""
    x0 = torch.randn(batch, *shape, generator=gen, dtype=dtype)
    eps = torch.randn(batch, *shape, generator=gen, dtype=dtype)
    s = sigmas.to(dtype).reshape(1, -1, *([1] * len(shape)))
    return (1 - s) * x0[:, None] + s * eps[:, None]


@dataclass
class GradcheckProblem:
    """A trajectory batch with its GRPO objective: everything the engines need."""

    settings: GradcheckConfig
    backbone: AnalyticBackbone | Backbone
    latents: torch.Tensor
    sigmas: torch.Tensor
    cond: Any
    steps: list[int]
    coeffs: sde.StepCoefficients
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    # v_k at each trained step as the sampler saw it (what a rollout stores for reuse).
    velocities: dict[int, torch.Tensor]
    # The samples' captions (diffusers backbones; analytic ones have random conditioning).
    prompts: list[str]

    @property
    def velocity(self) -> sde.Velocity:
        return self.backbone.velocity

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.backbone.trainable_parameters()

    def objective(self) -> GRPOStepLoss:
        """A fresh per-step GRPO loss (mean over samples and trained steps)."""
        return GRPOStepLoss(
            self.latents,
            self.sigmas,
            self.old_log_probs,
            self.advantages,
            self.steps,
            self.coeffs,
            self.settings.clip_range,
        )

    def batch(self, velocities: dict[int, torch.Tensor] | None = None) -> jagg.MicroBatch:
        """The engines' record of this batch with a fresh objective (``velocities``: reuse)."""
        return jagg.MicroBatch(self.latents, self.sigmas, self.cond, self.objective(), velocities)

    def options(self, **overrides: Any) -> EngineOptions:
        """The settings' engine options, the other fields at their defaults, then ``overrides``."""
        settings = {
            "weights": self.settings.weights,
            "no_interp": self.settings.no_interp,
            "endpoint_backward": self.settings.endpoint_backward,
        }
        return EngineOptions(**{**settings, **overrides})

    def probe(self, anchors: jagg.Anchors = "separate") -> list[jagg.WindowProbe]:
        """Per-window agreement of jagg and no_interp with exact (window/options from settings)."""
        return jagg.probe_windows(
            self.params,
            self.velocity,
            self.batch(),
            self.steps,
            window=self.settings.window,
            options=self.options(anchors=anchors),
        )

    def gradient(
        self,
        mode: jagg.GradMode,
        network: sde.Velocity | None = None,
        known_velocities: dict[int, torch.Tensor] | None = None,
        **overrides: Any,
    ) -> tuple[torch.Tensor, jagg.TrajectoryStats]:
        """The flat whole-trajectory gradient of ``mode`` (window/routing from the settings).

        ``network``: a velocity callable to run instead of the backbone's (a wrapper of it);
        ``known_velocities``: the stored velocities the engine may reuse; ``overrides``:
        engine options or :func:`~jagg_pipeline.core.jagg.trajectory_gradient` arguments.
        """
        options = {name: overrides.pop(name) for name in EngineOptions.names() if name in overrides}
        routing = {
            "window": self.settings.window,
            "jagg_frac": self.settings.jagg_frac,
            **overrides,
        }
        result: list[jagg.TrajectoryStats] = []
        grad = jagg.collect_gradient(
            self.params,
            lambda: result.append(
                jagg.trajectory_gradient(
                    network or self.velocity,
                    self.batch(known_velocities),
                    self.steps,
                    mode=mode,
                    options=self.options(**options),
                    **routing,
                )
            ),
        )
        return grad, result[0]


def _tiny_backbone(settings: GradcheckConfig) -> Backbone:
    """A tiny diffusers checkpoint built in a temporary directory, loaded by its adapter."""
    with tempfile.TemporaryDirectory(prefix="jagg-gradcheck-") as directory:
        return load_tiny_backbone(
            settings.backbone, directory, seed=settings.seed, dtype=settings.dtype
        )


def build_problem(settings: GradcheckConfig, backbone: Backbone | None = None) -> GradcheckProblem:
    """The backbone, a trajectory batch on it and the GRPO data, all from ``settings.seed``.

    Analytic backbones use the static-shift schedule (``settings.shift``) and random
    conditioning vectors; diffusers backbones (tiny ones, or ``backbone`` when given, which
    replaces ``settings.backbone``) their checkpoint's schedule and encoded toy captions.
    """
    if backbone is None and settings.backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {BACKBONES}, got {settings.backbone!r}")
    if settings.trajectory not in TRAJECTORIES:
        raise ValueError(f"trajectory must be one of {TRAJECTORIES}, got {settings.trajectory!r}")
    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {settings.dtype!r}")
    dtype = DTYPES[settings.dtype]
    masks = sde.full_trajectory_masks(settings.num_steps)
    steps = masks.trained_indices
    coeffs = sde.StepCoefficients("flow_grpo", settings.noise_level)
    gen = torch.Generator().manual_seed(settings.seed + 1)

    if backbone is not None or settings.backbone in TINY_BACKBONES:
        from jagg_pipeline.toyworld.tiny import toy_captions

        backbone = backbone or _tiny_backbone(settings)
        sigmas = backbone.sigmas(settings.num_steps).to(torch.float64)
        captions = toy_captions()
        prompts = [captions[i % len(captions)] for i in range(settings.batch)]
        cond = backbone.encode_prompts(prompts)
    else:
        backbone = build_analytic(settings.backbone, dtype=dtype, seed=settings.seed)
        sigmas = sde.static_shift_sigmas(settings.num_steps, settings.shift)
        prompts = []
        cond = torch.randn(settings.batch, backbone.cond_dim, generator=gen, dtype=dtype)

    if settings.trajectory == "sde":
        x_init = torch.randn(settings.batch, *backbone.latent_shape, generator=gen, dtype=dtype)
        traj = sde.sample(backbone.velocity, cond, x_init, sigmas, masks, coeffs, gen)
        latents, old_log_probs = traj.latents, traj.log_probs
        velocities = {k: traj.velocities[:, j] for j, k in enumerate(steps)}
    else:
        latents = _chord_latents(settings.batch, backbone.latent_shape, sigmas, dtype, gen)
        old_log_probs = torch.zeros(
            settings.batch, settings.num_steps, dtype=sde.compute_dtype(dtype)
        )
        old_log_probs[:, steps] = recompute_log_probs(
            backbone.velocity, latents, sigmas, cond, steps, coeffs
        )
        with torch.no_grad():
            velocities = {
                k: backbone.velocity(
                    latents[:, k], sde.sigma_batch(sigmas, k, len(latents), latents.dtype), cond
                )
                for k in steps
            }

    rewards = torch.randn(settings.batch, generator=gen, dtype=torch.float64)
    advantages = grpo.group_advantages(
        rewards, torch.zeros(settings.batch, dtype=torch.long)
    ).values
    return GradcheckProblem(
        settings,
        backbone,
        latents,
        sigmas,
        cond,
        steps,
        coeffs,
        old_log_probs,
        advantages,
        velocities,
        prompts,
    )


def _layout_report(
    problem: GradcheckProblem, anchors: jagg.Anchors, exact: tuple[torch.Tensor, int]
) -> dict[str, Any]:
    """Per-window agreement, backward calls and whole-trajectory agreement of one layout.

    ``exact``: the whole-trajectory exact gradient and its backward calls, which no layout
    changes (one backward call per step), computed once for both layouts.
    """
    full, backward_calls = {"exact": exact[0]}, {"exact": exact[1]}
    for mode in ("jagg", "no_interp"):
        full[mode], stats = problem.gradient(mode, anchors=anchors)
        backward_calls[mode] = stats.backward_calls
    return {
        "windows": [p.to_dict() for p in problem.probe(anchors)],
        "backward_calls": backward_calls,
        "trajectory": {
            "jagg_frac": problem.settings.jagg_frac,
            "jagg": asdict(jagg.agreement(full["jagg"], full["exact"])),
            "no_interp": asdict(jagg.agreement(full["no_interp"], full["exact"])),
        },
    }


def run_gradcheck(settings: GradcheckConfig) -> dict[str, Any]:
    """Run the diagnostic on both anchor layouts at the same interpolation span (W steps).

    The report has ``windows``, ``backward_calls`` and ``trajectory`` for separate anchors
    (each window its own two ends) and the same under ``shared`` (adjacent windows share
    their boundary step: every window after the first owns W - 1 steps).
    """
    if settings.window < 2:
        raise ValueError(f"window must be >= 2 to compare anything, got {settings.window}")
    problem = build_problem(settings)
    exact, stats = problem.gradient("exact")
    return {
        "settings": asdict(settings),
        "sigmas": [float(s) for s in problem.sigmas],
        "trained_steps": problem.steps,
        **_layout_report(problem, "separate", (exact, stats.backward_calls)),
        "shared": _layout_report(problem, "shared", (exact, stats.backward_calls)),
    }
