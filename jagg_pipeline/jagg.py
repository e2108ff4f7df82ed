"""Gradient engines over windows of trained denoising steps: exact, JAGG and no-interp.

For a window of W steps with v_j = v_theta(z_j, t_j) and a per-step loss L_j(v_j), the exact
gradient is G = sum_j J_j^T s_j with J_j = dv_j/dtheta and s_j = dL_j/dv_j. JAGG replaces
J_j by (1 - alpha_j) J_0 + alpha_j J_{W-1}, alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}), so that
G ~ J_0^T s_base + J_{W-1}^T s_corr: one backward through the network instead of W
(DESIGN section 4). The schedule here:

1. both endpoints in ONE stacked forward with grad;
2. the W - 2 interior steps in ONE batched no-grad forward (no endpoint is evaluated twice),
   or none at all on the on-policy step: the rollout's own velocities are those v_j;
3. every s_j by autograd through the step loss only, on a detached proxy of v_j;
4. ONE backward of the stacked endpoint output with grad_outputs [s_base; s_corr].

Gradients accumulate into ``param.grad`` (as ``loss.backward()`` would), so the engines
compose with optimisers, gradient accumulation and FSDP2 hooks. Backbone-agnostic: the
network is any ``velocity(z, sigma, cond) -> v`` callable; ``cond`` may be a tensor, a
dict/tuple of tensors batched along dim 0, or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from jagg_pipeline.sde import Velocity, sigma_batch

GradMode = Literal["exact", "jagg", "no_interp"]
GRAD_MODES: tuple[str, ...] = ("exact", "jagg", "no_interp")
Weights = Literal["time", "index"]
NoInterpVariant = Literal["drop", "nearest"]
# (v_k, k) -> scalar loss of trained step k; must depend on parameters only through v_k.
StepLoss = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class WindowStats:
    """What one window cost and contributed.

    ``forward_rows`` counts step evaluations (one per step of the window and sample batch),
    ``network_calls`` velocity calls, ``backward_calls`` backward calls into the network (under
    FSDP2, one reduce-scatter per parameter group each).
    ``loss`` sums the step losses that the mode evaluated (no_interp/drop skips interiors).
    ``reused_rows`` counts interior velocities taken from the rollout instead of a forward.
    """

    steps: list[int]
    mode: str
    loss: float = 0.0
    forward_rows: int = 0
    network_calls: int = 0
    backward_calls: int = 0
    reused_rows: int = 0


def repeat_cond(cond: Any, times: int) -> Any:
    """Stack ``times`` copies of a batched condition along dim 0 (tensors, dicts, tuples, None)."""
    if isinstance(cond, torch.Tensor):
        return torch.cat([cond] * times) if times > 1 else cond
    if isinstance(cond, dict):
        return {key: repeat_cond(value, times) for key, value in cond.items()}
    if isinstance(cond, list | tuple):
        return type(cond)(repeat_cond(value, times) for value in cond)
    return cond


def interpolation_weights(
    sigmas: torch.Tensor, steps: Sequence[int], weights: Weights = "time"
) -> list[float]:
    """alpha_j of each step of a window: t-weights (t_0 - t_j)/(t_0 - t_{W-1}) or index j/(W-1).

    Index weights are wrong under shifted schedules; they exist for the ablation and tests.
    """
    width = len(steps)
    if width < 2:
        raise ValueError("interpolation needs a window of at least 2 steps")
    if weights == "index":
        return [j / (width - 1) for j in range(width)]
    if weights != "time":
        raise ValueError(f"weights must be 'time' or 'index', got {weights!r}")
    t = [float(sigmas[k]) for k in steps]
    span = t[0] - t[-1]
    if span == 0:
        raise ValueError(f"window {list(steps)} has equal endpoint sigmas; cannot interpolate")
    return [(t[0] - tj) / span for tj in t]


def _step_signal(step_loss: StepLoss, v: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    """s_k = dL_k/dv_k by autograd through the step loss only, on a detached proxy of v_k."""
    proxy = v.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = step_loss(proxy, k)
        (signal,) = torch.autograd.grad(loss, proxy, allow_unused=True)
    if signal is None:
        signal = torch.zeros_like(proxy)
    return signal, float(loss.detach())


def _evaluate(
    velocity: Velocity, latents: torch.Tensor, sigmas: torch.Tensor, cond: Any, steps: list[int]
) -> torch.Tensor:
    """One velocity call over the steps ``steps`` stacked along the batch dimension."""
    batch = latents.shape[0]
    z = torch.cat([latents[:, k] for k in steps])
    sigma = torch.cat([sigma_batch(sigmas, k, batch, latents.dtype) for k in steps])
    return velocity(z, sigma, repeat_cond(cond, len(steps)))


def _exact(velocity, step_loss, latents, sigmas, cond, stats: WindowStats) -> None:
    for k in stats.steps:
        v = _evaluate(velocity, latents, sigmas, cond, [k])
        loss = step_loss(v, k)
        loss.backward()
        stats.loss += float(loss.detach())
        stats.forward_rows += 1
        stats.network_calls += 1
        stats.backward_calls += 1


def _endpoint_weights(
    mode: str, alphas: list[float], no_interp: NoInterpVariant
) -> list[tuple[float, float]]:
    """(weight on J_0, weight on J_{W-1}) for each step's signal."""
    if mode == "jagg":
        return [(1.0 - a, a) for a in alphas]
    if no_interp == "drop":
        last = len(alphas) - 1
        return [
            (1.0, 0.0) if j == 0 else (0.0, 1.0) if j == last else (0.0, 0.0)
            for j in range(len(alphas))
        ]
    if no_interp == "nearest":
        return [(1.0, 0.0) if a < 0.5 else (0.0, 1.0) if a > 0.5 else (0.5, 0.5) for a in alphas]
    raise ValueError(f"no_interp variant must be 'drop' or 'nearest', got {no_interp!r}")


def _aggregated(
    velocity, step_loss, latents, sigmas, cond, stats: WindowStats, weights, no_interp, stack, known
) -> None:
    steps = stats.steps
    k0, k_last = steps[0], steps[-1]
    alphas = interpolation_weights(sigmas, steps, weights)
    per_step = _endpoint_weights(stats.mode, alphas, no_interp)
    interior = [k for j, k in enumerate(steps[1:-1], start=1) if per_step[j] != (0.0, 0.0)]
    # Stacked: one call per group (fewer launches, bigger batches). Unstacked: every call has
    # the rollout's batch composition, so recomputed log-probs match the sampler bit for bit.
    groups = [[k0, k_last]] if stack else [[k0], [k_last]]
    outputs = [_evaluate(velocity, latents, sigmas, cond, group) for group in groups]
    velocities = dict(zip((k0, k_last), torch.cat(outputs).detach().chunk(2), strict=True))
    # Interior velocities the caller already has (the rollout's, while the weights are still
    # the ones that sampled it) need no forward: only their signals s_j enter the gradient.
    reused = [k for k in interior if known is not None and k in known]
    velocities.update((k, known[k].to(outputs[0].device, outputs[0].dtype)) for k in reused)
    stats.reused_rows += len(reused)
    interior = [k for k in interior if k not in velocities]
    if interior:
        with torch.no_grad():
            for group in [interior] if stack else [[k] for k in interior]:
                v = _evaluate(velocity, latents, sigmas, cond, group)
                velocities.update(zip(group, v.chunk(len(group)), strict=True))
                stats.network_calls += 1
    stats.network_calls += len(outputs)
    stats.forward_rows += 2 + len(interior)

    s_base = s_corr = None
    for k, (w_base, w_corr) in zip(steps, per_step, strict=True):
        if k not in velocities:
            continue
        signal, loss = _step_signal(step_loss, velocities[k], k)
        stats.loss += loss
        s_base = w_base * signal if s_base is None else s_base + w_base * signal
        s_corr = w_corr * signal if s_corr is None else s_corr + w_corr * signal
    grad_outputs = [torch.cat([s_base, s_corr])] if stack else [s_base, s_corr]
    torch.autograd.backward(
        outputs, [g.to(out.dtype) for g, out in zip(grad_outputs, outputs, strict=True)]
    )
    stats.backward_calls += 1


def window_gradient(
    velocity: Velocity,
    step_loss: StepLoss,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    steps: Sequence[int],
    mode: GradMode,
    *,
    weights: Weights = "time",
    no_interp: NoInterpVariant = "drop",
    stack_forwards: bool = True,
    known_velocities: Mapping[int, torch.Tensor] | None = None,
) -> WindowStats:
    """Accumulate into ``param.grad`` the gradient of sum_k step_loss(v_k, k) over one window.

    ``latents`` [B, T+1, ...] holds the trajectory (z_k = latents[:, k]), ``sigmas`` [T+1]
    its schedule, ``steps`` the window's trained step indices in order. ``mode``: ``exact``
    (W forwards, W backwards), ``jagg`` (one stacked endpoint forward with grad, one batched
    interior forward, one backward), ``no_interp`` (endpoints only; ``no_interp="drop"``
    ignores interior signals, ``"nearest"`` hands each to the nearer endpoint in t, ties split
    evenly). A one-step window is always exact; a two-step window under ``jagg`` is exact.
    ``stack_forwards=False`` evaluates each step at the sample batch size (W network calls,
    still one ``backward`` call over both endpoint outputs): slower on accelerators, but
    recomputed log-probs then equal the rollout's bit for bit (ratio == 1 exactly).
    ``known_velocities`` (step -> v_k [B, ...]): interior velocities to use instead of the
    interior forward, valid only while the parameters are those that produced them (the
    rollout's, before the round's first optimizer step); then a window costs the endpoint
    forward and one backward. Exact windows and endpoints always run the network.
    """
    if mode not in GRAD_MODES:
        raise ValueError(f"gradient mode must be one of {GRAD_MODES}, got {mode!r}")
    stats = WindowStats(steps=list(steps), mode=mode if len(steps) > 1 else "exact")
    if not stats.steps:
        raise ValueError("a window needs at least one step")
    if stats.mode == "exact":
        _exact(velocity, step_loss, latents, sigmas, cond, stats)
    else:
        _aggregated(
            velocity,
            step_loss,
            latents,
            sigmas,
            cond,
            stats,
            weights,
            no_interp,
            stack_forwards,
            known_velocities,
        )
    return stats


def split_windows(steps: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive chunks of ``window`` trained steps; the last one may be shorter (ragged)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    steps = list(steps)
    return [steps[i : i + window] for i in range(0, len(steps), window)]


def route_windows(n_windows: int, jagg_frac: float) -> list[bool]:
    """True for the first round(f * n) windows (highest noise first): the approximated ones."""
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be in [0, 1], got {jagg_frac}")
    n_routed = math.floor(jagg_frac * n_windows + 0.5)
    return [i < n_routed for i in range(n_windows)]


@dataclass
class TrajectoryStats:
    """Per-window statistics of one trajectory-batch gradient."""

    windows: list[WindowStats] = field(default_factory=list)

    @property
    def loss(self) -> float:
        return sum(w.loss for w in self.windows)

    @property
    def backward_calls(self) -> int:
        return sum(w.backward_calls for w in self.windows)

    @property
    def forward_rows(self) -> int:
        return sum(w.forward_rows for w in self.windows)

    @property
    def network_calls(self) -> int:
        return sum(w.network_calls for w in self.windows)

    @property
    def reused_rows(self) -> int:
        return sum(w.reused_rows for w in self.windows)


@dataclass
class MicroBatch:
    """Trajectories of one micro-batch and their per-step loss, on the network's device.

    ``velocities``: step -> v_k as the current parameters compute it, when known (the
    rollout's, on the on-policy optimizer step); the engines then skip interior forwards.
    """

    latents: torch.Tensor
    sigmas: torch.Tensor
    cond: Any
    objective: StepLoss
    velocities: Mapping[int, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.latents.shape[0]


def accumulate_gradient(
    velocity: Velocity,
    micro_batches: Sequence[MicroBatch],
    windows: Sequence[Sequence[int]],
    routed: Sequence[bool],
    mode: GradMode,
    set_sync: Callable[[bool], None] | None = None,
    **engine_options: Any,
) -> list[list[WindowStats]]:
    """Accumulate one optimizer step's gradient; ``stats[micro_batch][window]``.

    THE accumulation loop: training and the gradient diagnostic both run it, so the backward
    calls they report are the same thing. Windows with ``routed`` True use ``mode``, the others
    are exact. Backward calls are grouped into units: one per approximated window (a single
    backward call over both endpoints) and one per step of an exact window (an exact window IS
    W single-step backward calls, so splitting it computes exactly the same thing).
    ``set_sync(on)`` (FSDP2's gradient sync) is called before each unit with on for the last
    unit only: FSDP2 then accumulates the unsharded gradients locally and reduces each
    parameter group ONCE per optimizer step instead of once per backward call (fewer
    collectives, at the memory cost of holding the unsharded gradients of the step).
    """
    if len(routed) != len(windows):
        raise ValueError(f"routing has {len(routed)} entries for {len(windows)} windows")
    units = []
    for m in range(len(micro_batches)):
        for w, (chunk, approx) in enumerate(zip(windows, routed, strict=True)):
            if approx and mode != "exact":
                units.append((m, w, list(chunk), mode))
            else:
                units.extend((m, w, [k], "exact") for k in chunk)
    stats = [[WindowStats(steps=list(c), mode="exact") for c in windows] for _ in micro_batches]
    for index, (m, w, steps, unit_mode) in enumerate(units):
        if set_sync is not None:
            set_sync(index == len(units) - 1)
        part = micro_batches[m]
        result = window_gradient(
            velocity,
            part.objective,
            part.latents,
            part.sigmas,
            part.cond,
            steps,
            unit_mode,
            known_velocities=part.velocities,
            **engine_options,
        )
        merged = stats[m][w]
        if len(steps) > 1:
            merged.mode = result.mode
        merged.loss += result.loss
        merged.forward_rows += result.forward_rows
        merged.network_calls += result.network_calls
        merged.backward_calls += result.backward_calls
        merged.reused_rows += result.reused_rows
    return stats


def trajectory_gradient(
    velocity: Velocity,
    step_loss: StepLoss,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    steps: Sequence[int],
    *,
    window: int,
    mode: GradMode,
    jagg_frac: float = 1.0,
    routing: Sequence[bool] | None = None,
    weights: Weights = "time",
    no_interp: NoInterpVariant = "drop",
    stack_forwards: bool = True,
    known_velocities: Mapping[int, torch.Tensor] | None = None,
) -> TrajectoryStats:
    """Accumulate the gradient over all trained ``steps`` of one batch, windowed and routed.

    :func:`accumulate_gradient` on a single micro-batch: windows routed by ``jagg_frac`` (or
    an explicit per-window ``routing``) use ``mode``; the others are exact. With
    ``mode="exact"`` every window is exact whatever the routing. ``known_velocities``: see
    :func:`window_gradient`.
    """
    windows = split_windows(steps, window)
    if routing is None:
        routing = route_windows(len(windows), jagg_frac)
    (stats,) = accumulate_gradient(
        velocity,
        [MicroBatch(latents, sigmas, cond, step_loss, known_velocities)],
        windows,
        routing,
        mode,
        weights=weights,
        no_interp=no_interp,
        stack_forwards=stack_forwards,
    )
    return TrajectoryStats(windows=stats)


# --------------------------------------------------------------------------------------------
# Probing the approximation against the exact gradient
# --------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2 shards), a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def collect_gradient(params: Sequence[torch.nn.Parameter], run: Callable[[], Any]) -> torch.Tensor:
    """The flat float64 gradient that ``run()`` accumulates, leaving existing ``.grad`` intact."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        run()
        flat = [
            torch.zeros(p.numel(), dtype=torch.float64)
            if p.grad is None
            else _local(p.grad).detach().to(torch.float64).flatten().cpu()
            for p in params
        ]
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return torch.cat(flat)


@dataclass
class Agreement:
    """How close an approximate gradient is to the exact one."""

    cos_sim: float
    rel_err: float


def agreement(approx: torch.Tensor, exact: torch.Tensor) -> Agreement:
    """Cosine similarity and ||approx - exact|| / ||exact|| (float64)."""
    a, e = approx.to(torch.float64), exact.to(torch.float64)
    e_norm = float(e.norm())
    a_norm = float(a.norm())
    cos = float(a @ e) / (a_norm * e_norm) if a_norm > 0 and e_norm > 0 else float("nan")
    rel = float((a - e).norm()) / e_norm if e_norm > 0 else float("nan")
    return Agreement(cos_sim=cos, rel_err=rel)


@dataclass
class WindowProbe:
    """Agreement of each approximate mode with the exact gradient on one window."""

    index: int
    steps: list[int]
    sigma_start: float
    sigma_end: float
    jagg: Agreement
    no_interp: Agreement

    def to_dict(self) -> dict[str, Any]:
        """The record every report uses: gradcheck's JSON, train metrics and checkpoints."""
        return asdict(self)


def probe_windows(
    params: Iterable[torch.nn.Parameter],
    velocity: Velocity,
    step_loss: StepLoss,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    steps: Sequence[int],
    *,
    window: int,
    weights: Weights = "time",
    no_interp: NoInterpVariant = "drop",
    stack_forwards: bool = True,
) -> list[WindowProbe]:
    """Per window, cos-sim and relative error of the jagg and no_interp gradients vs exact.

    What ``jagg_frac: auto`` routes on; leaves the parameters' ``.grad`` as it found them.
    """
    params = [p for p in params if p.requires_grad]
    probes = []
    for index, chunk in enumerate(split_windows(steps, window)):
        grads = {
            mode: collect_gradient(
                params,
                lambda mode=mode, chunk=chunk: window_gradient(
                    velocity,
                    step_loss,
                    latents,
                    sigmas,
                    cond,
                    chunk,
                    mode,
                    weights=weights,
                    no_interp=no_interp,
                    stack_forwards=stack_forwards,
                ),
            )
            for mode in GRAD_MODES
        }
        probes.append(
            WindowProbe(
                index=index,
                steps=chunk,
                sigma_start=float(sigmas[chunk[0]]),
                sigma_end=float(sigmas[chunk[-1]]),
                jagg=agreement(grads["jagg"], grads["exact"]),
                no_interp=agreement(grads["no_interp"], grads["exact"]),
            )
        )
    return probes
