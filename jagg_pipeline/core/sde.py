"""Flow-matching sampling maths: sigma schedules, the SDE/ODE/CPS step, its log-prob, noise masks.

Conventions: sigma in [0, 1] with sigma = 1 pure noise,
x_sigma = (1 - sigma) x0 + sigma eps, the model predicts v = eps - x0, and a step goes from
sigma to sigma_next < sigma (dt = sigma_next - sigma < 0).

Everything here is a pure tensor function on one device. Nothing here knows about backbones,
rewards or GRPO: a sampler takes any velocity callable ``(z, sigma, cond) -> v``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

StepKind = Literal["flow_grpo", "dance_grpo", "ode", "cps"]
STEP_KINDS: tuple[str, ...] = ("flow_grpo", "dance_grpo", "ode", "cps")

Velocity = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


def static_shift_sigmas(num_steps: int, shift: float, dtype: torch.dtype = torch.float64):
    """``num_steps + 1`` sigmas from 1 to 0: sigma' = s u / (1 + (s - 1) u), u = linspace(1, 0).

    SD3.5 uses s = 3; DanceGRPO uses s = 3 for every model.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * u / (1.0 + (shift - 1.0) * u)).to(dtype)


# --------------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCoefficients:
    """Which step family and its noise level.

    ``flow_grpo``: g = a sqrt(sigma / (1 - sigma)) with a = ``noise_level`` (0.7 SD3.5, 0.9 Flux,
    1.2 QwenImage); ``dance_grpo``: g = eta = ``noise_level``; ``ode``: g = 0;
    ``cps``: std = sigma_next sin(a pi / 2), the coefficients-preserving form.
    """

    kind: StepKind = "flow_grpo"
    noise_level: float = 0.7

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"step kind must be one of {STEP_KINDS}, got {self.kind!r}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")


@dataclass
class StepResult:
    """Output of :func:`step`: the next state, and the Gaussian it was drawn from."""

    x_next: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar or per-sample [B] sigma against a [B, ...] latent."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.dim() == 0:
        return t
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def sigma_batch(sigmas: torch.Tensor, index: int, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """The [B] sigma fed to the velocity at step ``index``: sampling and training share it.

    Kept in the step's compute dtype (float32 for bf16 latents): each backbone rounds its
    timestep the way its own pipeline does, which a bf16 sigma would pre-empt.
    """
    return sigmas[index].expand(batch).to(compute_dtype(dtype))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Steps and log-probs run in at least float32 (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise: torch.Tensor | None,
    coeffs: StepCoefficients,
    sigma_after_one: torch.Tensor | float | None = None,
) -> StepResult:
    """One step from ``sigma`` to ``sigma_next`` given the velocity ``v`` at ``(x, sigma)``.

    SDE families: mean = x + dt (v + g^2 / (2 sigma) eps_hat), eps_hat = x + (1 - sigma) v,
    std = g sqrt(-dt); CPS: mean = (1 - s') x0_hat + sqrt(s'^2 - std^2) eps_hat with
    std = s' sin(a pi / 2). ``noise`` None returns x_next = mean (what training needs to
    recompute a log-prob). ``sigma``/``sigma_next`` are scalars or per-sample [B] tensors.
    For Flow-GRPO at sigma = 1 the (1 - sigma) denominator uses ``sigma_after_one`` (the
    schedule's second sigma; defaults to ``sigma_next``), as the reference does.
    Computed in at least float32; ``x_next`` and ``mean`` come back in that precision.
    """
    cdt = compute_dtype(x.dtype)
    xf, vf = x.to(cdt), v.to(cdt)
    s = _per_sample(sigma, xf)
    s_next = _per_sample(sigma_next, xf)
    dt = s_next - s
    eps_hat = xf + (1.0 - s) * vf
    a = coeffs.noise_level

    if coeffs.kind == "cps":
        x0_hat = xf - s * vf
        std = s_next * math.sin(a * math.pi / 2.0)
        mean = (1.0 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * eps_hat
    elif coeffs.kind == "ode":
        # The schedulers' Euler update: dt * v in the velocity's dtype, added in float32, so
        # that ODE sampling in bf16 stays on the pipelines' numbers.
        mean = xf + (dt.to(v.dtype) * v).to(cdt)
        std = torch.zeros_like(s)
    else:
        if coeffs.kind == "dance_grpo":
            g = torch.full_like(s, a)
        else:
            after_one = s_next if sigma_after_one is None else _per_sample(sigma_after_one, xf)
            denom = 1.0 - torch.where(s >= 1.0, after_one, s)
            g = a * torch.sqrt(s / denom)
        mean = xf + dt * (vf + g**2 / (2.0 * s) * eps_hat)
        std = g * torch.sqrt(-dt)
    std = torch.as_tensor(std, dtype=cdt, device=x.device).expand_as(s)
    x_next = mean if noise is None else mean + std * noise.to(cdt)
    return StepResult(x_next=x_next, mean=mean, std=std)


def log_prob(
    x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, kind: StepKind = "flow_grpo"
) -> torch.Tensor:
    """Per-sample log-density of ``x_next`` under N(mean, std^2), MEAN over latent elements.

    Computed in at least float32. For ``cps`` the reference's surrogate -(x' - mean)^2 is used
    (constants and the std scale dropped; std does not depend on the parameters).
    ``std`` must be positive for the Gaussian families: ODE steps have no density.
    """
    cdt = compute_dtype(mean.dtype)
    diff = x_next.detach().to(cdt) - mean.to(cdt)
    if kind == "cps":
        per_elem = -(diff**2)
    else:
        sd = _per_sample(std, diff) if std.dim() <= 1 else std.to(cdt)
        per_elem = -(diff**2) / (2.0 * sd**2) - torch.log(sd) - 0.5 * math.log(2.0 * math.pi)
    return per_elem.reshape(per_elem.shape[0], -1).mean(dim=1)


# --------------------------------------------------------------------------------------------
# Which steps are noisy and which are trained
# --------------------------------------------------------------------------------------------


@dataclass
class StepMasks:
    """Boolean [num_steps] masks: where noise is injected, and which steps are trained."""

    sde: torch.Tensor
    train: torch.Tensor

    @property
    def trained_indices(self) -> list[int]:
        return [int(i) for i in torch.nonzero(self.train).flatten()]


def full_trajectory_masks(
    num_steps: int,
    trained_fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> StepMasks:
    """SDE on every step; train a selection of steps, always excluding the last (sigma -> 0).

    ``trained_fraction`` < 1 trains a random subset of that fraction of the eligible steps
    (DanceGRPO's timestep fraction), drawn with ``generator``; 1 trains them all.
    """
    if num_steps < 2:
        raise ValueError(f"need at least 2 steps to train any (last is excluded), got {num_steps}")
    if not 0.0 < trained_fraction <= 1.0:
        raise ValueError(f"trained_fraction must be in (0, 1], got {trained_fraction}")
    sde = torch.ones(num_steps, dtype=torch.bool)
    train = torch.zeros(num_steps, dtype=torch.bool)
    eligible = num_steps - 1
    count = max(1, round(trained_fraction * eligible))
    if count == eligible:
        train[:eligible] = True
    else:
        chosen = torch.randperm(eligible, generator=generator)[:count]
        train[chosen] = True
    return StepMasks(sde=sde, train=train)


def segment_masks(
    num_steps: int,
    segment_steps: int,
    start_range: tuple[int, int],
    generator: torch.Generator | None = None,
) -> StepMasks:
    """A segment of ``segment_steps`` consecutive SDE steps, ODE elsewhere (Flow-GRPO-Fast/MixGRPO).

    The start is drawn uniformly from the inclusive ``start_range``; only segment steps are
    trained, and never the last step of the trajectory.
    """
    lo, hi = start_range
    if segment_steps < 1:
        raise ValueError(f"segment_steps must be >= 1, got {segment_steps}")
    if not 0 <= lo <= hi or hi + segment_steps > num_steps:
        raise ValueError(
            f"start_range {start_range} with segment_steps {segment_steps} does not fit in "
            f"{num_steps} steps (need 0 <= lo <= hi and hi + segment_steps <= num_steps)"
        )
    start = int(torch.randint(lo, hi + 1, (1,), generator=generator))
    sde = torch.zeros(num_steps, dtype=torch.bool)
    sde[start : start + segment_steps] = True
    train = sde.clone()
    train[num_steps - 1] = False
    if not train.any():
        raise ValueError("the segment covers only the last step, which is never trained")
    return StepMasks(sde=sde, train=train)


# --------------------------------------------------------------------------------------------
# Sampling a trajectory
# --------------------------------------------------------------------------------------------


@dataclass
class Trajectory:
    """A sampled batch: what training needs to recompute every trained step.

    ``latents`` [B, T+1, ...] (x_0 = initial noise ... x_T = final latent), ``log_probs``
    [B, T] (0 where a step has no density), ``sigmas`` [T+1], the step masks, and
    ``velocities`` [B, n_trained, ...]: the network's velocity at each trained step
    (``masks.trained_indices`` order), which on-policy training can reuse. What sampling
    produces, before any conditioning, prompt or group is attached: the rollout stage turns
    it into an :class:`~jagg_pipeline.io.trajectories.TrajectoryBatch` (the shard on disk),
    training into :class:`~jagg_pipeline.core.jagg.MicroBatch` records (what one backward
    consumes).
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    masks: StepMasks
    velocities: torch.Tensor


def draw_noise(
    shape: Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Standard normal noise of ``shape``; with one generator per sample, row i from the i-th."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(tuple(shape), generator=generator, dtype=dtype)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {shape[0]}")
    return torch.stack([torch.randn(tuple(shape[1:]), generator=g, dtype=dtype) for g in generator])


@torch.no_grad()
def sample(
    velocity: Velocity,
    cond: Any,
    x_init: torch.Tensor,
    sigmas: torch.Tensor,
    masks: StepMasks,
    coeffs: StepCoefficients,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> Trajectory:
    """Run the sampler from ``x_init``: SDE (``coeffs``) on ``masks.sde`` steps, ODE elsewhere.

    Records the log-prob of each SDE step exactly as :func:`step` + :func:`log_prob` compute it
    at training time, so that an unchanged policy recomputes them bit for bit. ``generator``
    may be one generator per sample: each sample's noise then depends only on its own seed,
    not on which batch (or rank) it was sampled in.
    """
    num_steps = sigmas.numel() - 1
    if masks.sde.numel() != num_steps:
        raise ValueError(f"masks cover {masks.sde.numel()} steps, schedule has {num_steps}")
    batch = x_init.shape[0]
    ode = StepCoefficients("ode", 0.0)
    x = x_init
    latents = [x_init]
    log_probs = torch.zeros(batch, num_steps, dtype=compute_dtype(x_init.dtype))
    trained = []
    for i in range(num_steps):
        v = velocity(x, sigma_batch(sigmas, i, batch, x.dtype), cond)
        if masks.train[i]:
            trained.append(v)
        noisy = bool(masks.sde[i])
        noise = None
        if noisy:
            noise = draw_noise(x.shape, generator, x.dtype).to(x.device)
        result = step(v, x, sigmas[i], sigmas[i + 1], noise, coeffs if noisy else ode, sigmas[1])
        # The stored (possibly low-precision) latent is what training scores, so score it here.
        x = result.x_next.to(x_init.dtype)
        if noisy:
            log_probs[:, i] = log_prob(x, result.mean, result.std, coeffs.kind)
        latents.append(x)
    empty = x_init.new_zeros(batch, 0, *x_init.shape[1:])
    velocities = torch.stack(trained, dim=1) if trained else empty
    return Trajectory(torch.stack(latents, dim=1), log_probs, sigmas, masks, velocities)
