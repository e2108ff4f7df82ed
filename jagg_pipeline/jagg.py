"""Gradient engines over windows of trained denoising steps: exact, JAGG and no-interp.

For a window of W steps with v_j = v_theta(z_j, t_j) and a per-step loss L_j(v_j), the exact
gradient is G = sum_j J_j^T s_j with J_j = dv_j/dtheta and s_j = dL_j/dv_j. JAGG replaces
J_j by (1 - alpha_j) J_0 + alpha_j J_{W-1}, alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}), so that
G ~ J_0^T s_base + J_{W-1}^T s_corr: two endpoint Jacobian products instead of W. The
schedule here:

1. the W - 2 interior steps in ONE batched no-grad forward (no endpoint is evaluated twice),
   or none at all on the on-policy step: the rollout's own velocities are those v_j, trusted
   while the recomputed endpoints agree with the stored ones (checked by value);
2. every s_j by autograd through the step loss only, on a detached proxy of v_j;
3. ``sequential`` endpoint backward: each endpoint's forward with grad and its backward with
   its own signal (s_base carries s_0 with weight 1 and s_{W-1} with 0, s_corr the reverse),
   one graph alive at a time, as exact; ``joint``: both endpoints in ONE stacked forward and
   ONE backward with grad_outputs [s_base; s_corr], both graphs alive at once.

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
EndpointBackward = Literal["joint", "sequential"]
ENDPOINT_BACKWARDS: tuple[str, ...] = ("joint", "sequential")
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
    ``reuse_error``: the largest relative deviation of a recomputed endpoint velocity from the
    stored one (None: nothing stored); ``reuse_rejected``: it exceeded
    :func:`reuse_tolerance`, so the interiors were recomputed.
    """

    steps: list[int]
    mode: str
    loss: float = 0.0
    forward_rows: int = 0
    network_calls: int = 0
    backward_calls: int = 0
    reused_rows: int = 0
    reuse_error: float | None = None
    reuse_rejected: bool = False


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


def _exact(velocity, step_loss, latents, sigmas, cond, stats: WindowStats, before_backward) -> None:
    for k in stats.steps:
        v = _evaluate(velocity, latents, sigmas, cond, [k])
        loss = step_loss(v, k)
        before_backward(k == stats.steps[-1])
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


# The on-policy check: stored velocities are trusted while the recomputed endpoints agree with
# the stored ones to within this many units of the network output's precision (its eps), as a
# relative RMS. Rounding differences from another batch composition accumulate through the
# layers (measured: 1.6 eps in float64 for the stacked endpoint forward of the MLP DiT, 0 on
# the CPU at the rollout's own batch size); other weights or a changed base checkpoint move
# the velocities by far more. In bfloat16 that is a coarse guard (8 eps = 6%); what it cannot
# see there, stored velocities computed in a finer precision than training computes in (a
# float32 rollout under bf16 mixed precision: 4-5 eps apart on the toy backbones), shows as
# stored values that bfloat16 cannot represent (:func:`finer_than`).
REUSE_TOLERANCE_EPS = 8.0


def reuse_tolerance(dtype: torch.dtype) -> float:
    """The largest relative deviation of a recomputed velocity from a stored one taken as equal."""
    return REUSE_TOLERANCE_EPS * torch.finfo(dtype).eps


def velocity_deviation(recomputed: torch.Tensor, stored: torch.Tensor) -> float:
    """||recomputed - stored|| / ||stored||, in float64 (0 when both are zero)."""
    a = recomputed.detach().to(torch.float64)
    b = stored.detach().to(a.device, torch.float64)
    scale, error = float(b.norm()), float((a - b).norm())
    if scale > 0:
        return error / scale
    return 0.0 if error == 0 else math.inf


def finer_than(stored: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``stored`` holds values that ``dtype`` cannot: computed in a finer precision."""
    if torch.finfo(stored.dtype).eps >= torch.finfo(dtype).eps:
        return False
    return not torch.equal(stored.to(dtype).to(stored.dtype), stored)


class _Window:
    """One approximated window's per-step signals and interior velocities.

    Interior velocities are the stored ones while every endpoint checked so far agrees with
    its stored velocity (:meth:`check`), else one no-grad forward recomputes them. Each step's
    signal s_j is computed once and shared by both endpoint sums.
    """

    def __init__(self, velocity, step_loss, latents, sigmas, cond, stats, per_step, stack, known):
        self.velocity, self.step_loss = velocity, step_loss
        self.latents, self.sigmas, self.cond = latents, sigmas, cond
        self.stats, self.per_step, self.stack, self.known = stats, per_step, stack, known
        steps = stats.steps
        self.interior = [k for k in steps[1:-1] if per_step[k] != (0.0, 0.0)]
        # Only what the endpoints vouch for is used: no stored endpoint, no check, no reuse.
        vouched = [*self.interior, steps[0], steps[-1]]
        self.stored = known is not None and all(k in known for k in vouched)
        self.velocities: dict[int, torch.Tensor] = {}
        self.signals: dict[int, torch.Tensor] = {}
        self.losses: dict[int, float] = {}

    def check(self, step: int, recomputed: torch.Tensor) -> None:
        """Compare an endpoint's recomputed velocity with the stored one; stop reusing if off."""
        if self.known is None or step not in self.known:
            return
        stats = self.stats
        stored = self.known[step]
        deviation = velocity_deviation(recomputed, stored)
        stats.reuse_error = max(stats.reuse_error or 0.0, deviation)
        off = deviation > reuse_tolerance(recomputed.dtype) or finer_than(stored, recomputed.dtype)
        if self.stored and off:
            stats.reuse_rejected = True
            self.stored = False
            for k in self.interior:  # anything taken from the stored values is redone
                self.velocities.pop(k, None)
                self.signals.pop(k, None)

    def endpoint(self, step: int, value: torch.Tensor) -> None:
        self.velocities[step] = value

    def interiors(self, like: torch.Tensor | None = None) -> None:
        """Fill in the interior velocities not known yet.

        The stored ones (cast to ``like``'s device and dtype) while they are trusted, else one
        no-grad forward.
        """
        missing = [k for k in self.interior if k not in self.velocities]
        if not missing:
            return
        if self.stored:
            self.velocities.update((k, self.known[k].to(like.device, like.dtype)) for k in missing)
            self.stats.reused_rows = len(missing)
            return
        self.stats.reused_rows = 0
        with torch.no_grad():
            for group in [missing] if self.stack else [[k] for k in missing]:
                v = _evaluate(self.velocity, self.latents, self.sigmas, self.cond, group)
                self.velocities.update(zip(group, v.chunk(len(group)), strict=True))
                self.stats.network_calls += 1
                self.stats.forward_rows += len(group)

    def signal(self, which: int, like: torch.Tensor) -> torch.Tensor:
        """sum_j w_j s_j over the steps known so far; ``which`` 0: s_base, 1: s_corr."""
        self.interiors(like)
        total = None
        for k in self.stats.steps:
            weight = self.per_step[k][which]
            if k not in self.velocities or weight == 0.0:
                continue
            if k not in self.signals:
                self.signals[k], self.losses[k] = _step_signal(
                    self.step_loss, self.velocities[k], k
                )
            term = weight * self.signals[k]
            total = term if total is None else total + term
        self.stats.loss = sum(self.losses.values())
        return total


def _aggregated(
    velocity,
    step_loss,
    latents,
    sigmas,
    cond,
    stats: WindowStats,
    weights,
    no_interp,
    stack,
    known,
    backward: EndpointBackward,
    before_backward: Callable[[bool], None],
) -> None:
    steps = stats.steps
    k0, k_last = steps[0], steps[-1]
    alphas = interpolation_weights(sigmas, steps, weights)
    per_step = dict(zip(steps, _endpoint_weights(stats.mode, alphas, no_interp), strict=True))
    window = _Window(velocity, step_loss, latents, sigmas, cond, stats, per_step, stack, known)
    if backward == "sequential":
        # One endpoint graph alive at a time: its forward, its signal (its own step's plus
        # the interiors' share), its backward. Exact's activation peak, two backward calls.
        # Interiors that must be recomputed are, before any graph exists.
        if not window.stored:
            window.interiors()
        for which, k in enumerate((k0, k_last)):
            out = _evaluate(velocity, latents, sigmas, cond, [k])
            stats.network_calls += 1
            stats.forward_rows += 1
            window.check(k, out)
            window.endpoint(k, out.detach())
            signal = window.signal(which, out)
            before_backward(which == 1)
            out.backward(signal.to(out.dtype))
            stats.backward_calls += 1
        return
    # Joint: both endpoint graphs alive until ONE backward call (one reduce-scatter per
    # parameter group under FSDP2). Stacked: one forward call (fewer launches, bigger
    # batches); unstacked: every call has the rollout's batch composition.
    groups = [[k0, k_last]] if stack else [[k0], [k_last]]
    outputs = [_evaluate(velocity, latents, sigmas, cond, group) for group in groups]
    stats.network_calls += len(outputs)
    stats.forward_rows += 2
    for k, v in zip((k0, k_last), torch.cat(outputs).detach().chunk(2), strict=True):
        window.check(k, v)
        window.endpoint(k, v)
    s_base, s_corr = window.signal(0, outputs[0]), window.signal(1, outputs[0])
    grad_outputs = [torch.cat([s_base, s_corr])] if stack else [s_base, s_corr]
    before_backward(True)
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
    endpoint_backward: EndpointBackward = "joint",
    before_backward: Callable[[bool], None] | None = None,
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
    forward and one backward. Exact windows and endpoints always run the network, and each
    recomputed endpoint is compared with its stored velocity (when one is given): beyond
    :func:`reuse_tolerance`, or stored in a finer precision than the network computes in
    (:func:`finer_than`), the stored interiors are not used (``stats.reuse_rejected``).
    ``endpoint_backward``: ``joint`` keeps both endpoint graphs alive until one backward call;
    ``sequential`` runs each endpoint's forward and backward on its own (two backward calls,
    the activation peak of one step, the same gradient). ``before_backward(last)`` is called
    before every backward call into the network, ``last`` True for the window's last one
    (FSDP2's gradient-sync switch).
    """
    if mode not in GRAD_MODES:
        raise ValueError(f"gradient mode must be one of {GRAD_MODES}, got {mode!r}")
    if endpoint_backward not in ENDPOINT_BACKWARDS:
        raise ValueError(
            f"endpoint_backward must be one of {ENDPOINT_BACKWARDS}, got {endpoint_backward!r}"
        )
    before_backward = before_backward or (lambda last: None)
    stats = WindowStats(steps=list(steps), mode=mode if len(steps) > 1 else "exact")
    if not stats.steps:
        raise ValueError("a window needs at least one step")
    if stats.mode == "exact":
        _exact(velocity, step_loss, latents, sigmas, cond, stats, before_backward)
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
            endpoint_backward,
            before_backward,
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


def reusable_steps(
    trained_steps: Sequence[int],
    window: int,
    routed: Sequence[bool] | None,
    mode: str,
    no_interp: NoInterpVariant = "drop",
) -> list[int]:
    """The trained steps whose sampled velocities an on-policy JAGG step can reuse.

    Every step of each approximated window that has interiors to fill in: the interiors are
    reused, the endpoints are what the reuse is checked against (:class:`_Window`). None for
    ``exact``, for ``no_interp`` with ``drop`` (interior signals unused), for windows of two
    steps and for windows routed to the exact engine. ``routed`` None: any window may be
    routed (routing decided later, e.g. probed).
    """
    if mode == "exact" or (mode == "no_interp" and no_interp == "drop"):
        return []
    windows = split_windows(trained_steps, window)
    routed = [True] * len(windows) if routed is None else list(routed)
    return [
        k for chunk, r in zip(windows, routed, strict=True) if r and len(chunk) > 2 for k in chunk
    ]


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
    are exact. Work is grouped into units: one per approximated window and one per step of an
    exact window (an exact window IS W single-step backward calls, so splitting it computes
    exactly the same thing). ``set_sync(on)`` (FSDP2's gradient sync) is called before each
    backward call with on for the last one only: FSDP2 then accumulates the unsharded
    gradients locally and reduces each parameter group ONCE per optimizer step instead of once
    per backward call (fewer collectives, at the memory cost of holding the unsharded
    gradients of the step).
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
        last_unit = index == len(units) - 1

        def before_backward(last: bool, last_unit: bool = last_unit) -> None:
            if set_sync is not None:
                set_sync(last_unit and last)

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
            before_backward=before_backward,
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
        merged.reuse_rejected |= result.reuse_rejected
        if result.reuse_error is not None:
            merged.reuse_error = max(merged.reuse_error or 0.0, result.reuse_error)
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
    endpoint_backward: EndpointBackward = "joint",
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
        endpoint_backward=endpoint_backward,
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
    endpoint_backward: EndpointBackward = "joint",
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
                    endpoint_backward=endpoint_backward,
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
