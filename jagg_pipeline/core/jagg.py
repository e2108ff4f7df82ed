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

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from jagg_pipeline.core.options import (
    ANCHORS,
    DEFAULT_OPTIONS,
    ENDPOINT_BACKWARDS,
    GRAD_MODES,
    Anchors,
    EngineOptions,
    GradMode,
    NoInterpVariant,
    Weights,
)
from jagg_pipeline.core.sde import Velocity, sigma_batch

# (v_k, k) -> scalar loss of trained step k; must depend on parameters only through v_k.
StepLoss = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class WindowStats:
    """What one window cost and contributed.

    ``forward_rows`` counts step evaluations (one per step of the window and sample batch),
    ``network_calls`` velocity calls, ``backward_calls`` backward calls into the network (under
    FSDP2, one reduce-scatter per parameter group each).
    ``loss`` sums the step losses that the mode evaluated (no_interp/drop skips interiors).
    ``reused_rows`` counts interior velocities taken from the rollout instead of a forward,
    ``recomputed_rows`` those a no-grad forward computed.
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
    recomputed_rows: int = 0
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


@dataclass(frozen=True)
class MicroBatch:
    """What one backward consumes: trajectories, their step loss, on the network's device.

    The engines' one input record. ``latents`` [B, T+1, ...] (z_k = latents[:, k]),
    ``sigmas`` [T+1] the schedule, ``cond`` the batched conditioning (tensor, dict/tuple of
    tensors, or None), ``objective`` the per-step loss L_k(v_k). ``velocities``: step -> v_k
    [B, ...] as the current parameters compute it, when known (the rollout's, on the on-policy
    optimizer step); the engines then skip interior forwards. It exists beside
    :class:`~jagg_pipeline.core.sde.Trajectory` (what sampling produces, with log-probs and
    masks, on the sampler's device) and :class:`~jagg_pipeline.io.trajectories.TrajectoryBatch`
    (the on-disk rollout shard: prompts, groups, seeds, images) because it is the subset one
    gradient needs, already on the training device and bound to its loss.
    """

    latents: torch.Tensor
    sigmas: torch.Tensor
    cond: Any
    objective: StepLoss
    velocities: Mapping[int, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.latents.shape[0]

    def evaluate(self, velocity: Velocity, steps: Sequence[int]) -> torch.Tensor:
        """One velocity call over the steps ``steps`` stacked along the batch dimension."""
        batch = self.latents.shape[0]
        z = torch.cat([self.latents[:, k] for k in steps])
        sigma = torch.cat([sigma_batch(self.sigmas, k, batch, self.latents.dtype) for k in steps])
        return velocity(z, sigma, repeat_cond(self.cond, len(steps)))


def interpolation_weights(
    sigmas: torch.Tensor, steps: Sequence[int], weights: Weights = DEFAULT_OPTIONS.weights
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


def _exact(
    velocity: Velocity,
    batch: MicroBatch,
    stats: WindowStats,
    before_backward: Callable[[bool], None],
) -> None:
    """Each step of ``stats.steps``: its forward with grad and its own backward call."""
    for k in stats.steps:
        v = batch.evaluate(velocity, [k])
        loss = batch.objective(v, k)
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


@dataclass
class AnchorLayout:
    """Where one approximated unit evaluates Jacobians, and which signals each of them carries.

    ``anchors``: the steps whose rows run forward and backward with grad, in order;
    ``intervals``: the interpolation spans, each from one anchor to the next;
    ``coefficients[k]``: anchor -> the weight of step k's signal on that anchor's Jacobian.
    """

    anchors: list[int]
    intervals: list[list[int]]
    coefficients: dict[int, dict[int, float]]


def layout_intervals(windows: Sequence[Sequence[int]]) -> list[list[int]]:
    """The interpolation intervals of consecutive windows that share their boundary anchors.

    Window 0's interval is the window itself; each later window's runs from the last step of
    the window before (the shared anchor) through its own steps. One window: itself.
    """
    windows = [list(w) for w in windows]
    return windows[:1] + [[before[-1], *w] for before, w in itertools.pairwise(windows)]


def layout_anchors(intervals: Sequence[Sequence[int]]) -> list[int]:
    """The anchors of a unit's intervals, in order: each interval's two ends, shared ones once."""
    return list(dict.fromkeys(k for interval in intervals for k in (interval[0], interval[-1])))


def anchor_layout(
    sigmas: torch.Tensor,
    windows: Sequence[Sequence[int]],
    mode: str,
    weights: Weights = DEFAULT_OPTIONS.weights,
    no_interp: NoInterpVariant = DEFAULT_OPTIONS.no_interp,
) -> AnchorLayout:
    """The layout of a unit: one window (separate anchors) or a run sharing boundary anchors.

    In each interval a step's Jacobian is interpolated from the interval's two anchors:
    J_k ~ (1 - alpha_k) J_first + alpha_k J_last under ``jagg`` (alpha: t- or index weights),
    or handed to them whole under ``no_interp``. A shared anchor belongs to the interval that
    ends at it, so its own signal is counted once; it also carries the next interval's shares.
    """
    if mode not in ("jagg", "no_interp"):
        raise ValueError(f"an anchor layout approximates 'jagg' or 'no_interp', got {mode!r}")
    intervals = layout_intervals(windows)
    coefficients: dict[int, dict[int, float]] = {}
    for i, interval in enumerate(intervals):
        first, last = interval[0], interval[-1]
        if len(interval) == 1:
            coefficients[first] = {first: 1.0}
            continue
        pairs = _endpoint_weights(mode, interpolation_weights(sigmas, interval, weights), no_interp)
        for j, (k, (w_first, w_last)) in enumerate(zip(interval, pairs, strict=True)):
            if i == 0 or j > 0:  # a shared first anchor is owned by the interval before
                coefficients[k] = {first: w_first, last: w_last}
    return AnchorLayout(layout_anchors(intervals), intervals, coefficients)


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


class _Unit:
    """One approximated unit's per-step signals and interior velocities.

    A unit is one window (``separate`` anchors) or a run of windows whose intervals share
    their boundary anchors (``shared``). ``coefficients[k][a]`` is the weight of step k's
    signal on anchor a's Jacobian. Interior velocities are the stored ones while every anchor
    checked so far agrees with its stored velocity (:meth:`check`), else no-grad forwards
    recompute them (one per interval when stacked). Each step's signal s_k is computed once
    and shared by every anchor sum it enters. Counts go to the window that owns the step.
    """

    def __init__(
        self,
        velocity: Velocity,
        batch: MicroBatch,
        layout: AnchorLayout,
        stats: list[WindowStats],
        stack: bool,
    ) -> None:
        self.velocity, self.batch = velocity, batch
        self.layout, self.stats, self.stack = layout, stats, stack
        self.known = batch.velocities
        self.owners = {k: part for part in stats for k in part.steps}
        anchors = set(layout.anchors)
        self.interior = [
            [k for k in interval if k not in anchors and any(layout.coefficients[k].values())]
            for interval in layout.intervals
        ]
        # Only what the anchors vouch for is used: no stored anchor, no check, no reuse.
        vouched = [*layout.anchors, *(k for group in self.interior for k in group)]
        self.stored = self.known is not None and all(k in self.known for k in vouched)
        self.velocities: dict[int, torch.Tensor] = {}
        self.signals: dict[int, torch.Tensor] = {}
        self.losses: dict[int, float] = {}

    def evaluate(self, group: list[int]) -> torch.Tensor:
        """One velocity call over ``group``, counted on the windows owning its rows."""
        self.owners[group[0]].network_calls += 1
        for k in group:
            self.owners[k].forward_rows += 1
        return self.batch.evaluate(self.velocity, group)

    def check(self, step: int, recomputed: torch.Tensor) -> None:
        """Compare an anchor's recomputed velocity with the stored one; stop reusing if off."""
        if self.known is None or step not in self.known:
            return
        stored = self.known[step]
        deviation = velocity_deviation(recomputed, stored)
        for stats in self.stats:
            stats.reuse_error = max(stats.reuse_error or 0.0, deviation)
        off = deviation > reuse_tolerance(recomputed.dtype) or finer_than(stored, recomputed.dtype)
        if self.stored and off:
            self.stored = False
            for stats in self.stats:
                stats.reuse_rejected = True
                stats.reused_rows = 0
            for k in (k for group in self.interior for k in group):  # taken from storage: redo
                self.velocities.pop(k, None)
                self.signals.pop(k, None)

    def anchor(self, step: int, value: torch.Tensor) -> None:
        self.velocities[step] = value

    def interiors(self, like: torch.Tensor | None = None) -> None:
        """Fill in the interior velocities not known yet.

        The stored ones (cast to ``like``'s device and dtype) while they are trusted, else
        no-grad forwards: one per interval when stacked, one per step otherwise.
        """
        missing = [[k for k in group if k not in self.velocities] for group in self.interior]
        missing = [group for group in missing if group]
        if not missing:
            return
        if self.stored:
            for k in (k for group in missing for k in group):
                self.velocities[k] = self.known[k].to(like.device, like.dtype)
                self.owners[k].reused_rows += 1
            return
        calls = missing if self.stack else [[k] for group in missing for k in group]
        with torch.no_grad():
            for group in calls:
                v = self.evaluate(group)
                self.velocities.update(zip(group, v.chunk(len(group)), strict=True))
                for k in group:
                    self.owners[k].recomputed_rows += 1

    def signal(self, anchor: int, like: torch.Tensor) -> torch.Tensor:
        """sum_k c_ka s_k over the steps known so far: what anchor ``anchor``'s row carries."""
        self.interiors(like)
        total = None
        for k, weights in self.layout.coefficients.items():
            weight = weights.get(anchor, 0.0)
            if k not in self.velocities or weight == 0.0:
                continue
            if k not in self.signals:
                self.signals[k], self.losses[k] = _step_signal(
                    self.batch.objective, self.velocities[k], k
                )
            term = weight * self.signals[k]
            total = term if total is None else total + term
        for stats in self.stats:
            stats.loss = sum(loss for k, loss in self.losses.items() if self.owners[k] is stats)
        return total


def _aggregated(
    velocity: Velocity,
    batch: MicroBatch,
    layout: AnchorLayout,
    stats: list[WindowStats],
    options: EngineOptions,
    before_backward: Callable[[bool], None],
) -> None:
    """An approximated unit: the anchors' forwards and backwards with the summed signals."""
    stack, backward = options.stack_forwards, options.endpoint_backward
    unit = _Unit(velocity, batch, layout, stats, stack)
    anchors, owners = layout.anchors, unit.owners
    if backward == "sequential":
        # One anchor graph alive at a time: its forward, its signal (its own step's plus its
        # intervals' shares), its backward. Exact's activation peak, one backward per anchor.
        # Interiors that must be recomputed are, before any graph exists.
        if not unit.stored:
            unit.interiors()
        for a in anchors:
            out = unit.evaluate([a])
            unit.check(a, out)
            unit.anchor(a, out.detach())
            signal = unit.signal(a, out)
            before_backward(a == anchors[-1])
            out.backward(signal.to(out.dtype))
            owners[a].backward_calls += 1
        return
    # Joint: every anchor graph alive until ONE backward call (one reduce-scatter per
    # parameter group under FSDP2). Stacked: one forward call (fewer launches, bigger
    # batches); unstacked: every call has the rollout's batch composition.
    groups = [list(anchors)] if stack else [[a] for a in anchors]
    outputs = [unit.evaluate(group) for group in groups]
    for a, v in zip(anchors, torch.cat(outputs).detach().chunk(len(anchors)), strict=True):
        unit.check(a, v)
        unit.anchor(a, v)
    signals = [unit.signal(a, outputs[0]) for a in anchors]
    grad_outputs = [torch.cat(signals)] if stack else signals
    before_backward(True)
    torch.autograd.backward(
        outputs, [g.to(out.dtype) for g, out in zip(grad_outputs, outputs, strict=True)]
    )
    owners[anchors[0]].backward_calls += 1


def window_gradient(
    velocity: Velocity,
    batch: MicroBatch,
    steps: Sequence[int],
    mode: GradMode,
    options: EngineOptions = DEFAULT_OPTIONS,
) -> WindowStats:
    """Accumulate into ``param.grad`` the gradient of sum_k L_k(v_k) over one window.

    :func:`unit_gradient` on the one window ``steps`` (its two ends the anchors).
    """
    (stats,) = unit_gradient(velocity, batch, [steps], mode, options)
    return stats


def unit_gradient(
    velocity: Velocity,
    batch: MicroBatch,
    windows: Sequence[Sequence[int]],
    mode: GradMode,
    options: EngineOptions = DEFAULT_OPTIONS,
    before_backward: Callable[[bool], None] | None = None,
) -> list[WindowStats]:
    """Accumulate into ``param.grad`` the gradient of sum_k L_k(v_k) over one unit of ``batch``.

    A unit is one window, or consecutive windows whose intervals share their boundary
    anchors (:func:`anchor_layout`); one :class:`WindowStats` per window, each counting the
    rows of the steps it owns. ``windows``: the trained step indices in order; L_k is
    ``batch.objective``. ``mode``: ``exact`` (a forward and a backward per step), ``jagg``
    (the anchors' forward with grad, the interiors' forward without, one backward),
    ``no_interp`` (anchors only; ``options.no_interp="drop"`` ignores interior signals,
    ``"nearest"`` hands each to the nearer anchor in t, ties split evenly). A one-step unit is
    always exact; a two-step window under ``jagg`` is exact. ``options.stack_forwards=False``
    evaluates each step at the sample batch size (one network call per row, still one
    ``backward`` call over all anchor outputs): slower on accelerators, but recomputed
    log-probs then equal the rollout's bit for bit (ratio == 1 exactly). ``batch.velocities``
    (step -> v_k [B, ...]): interior velocities to use instead of the interior forwards, valid
    only while the parameters are those that produced them (the rollout's, before the round's
    first optimizer step); then a unit costs the anchor rows alone. Exact steps and anchors
    always run the network, and each recomputed anchor is compared with its stored velocity
    (when one is given): beyond :func:`reuse_tolerance`, or stored in a finer precision than
    the network computes in (:func:`finer_than`), the stored interiors are not used
    (``stats.reuse_rejected``). ``options.endpoint_backward``: ``joint`` keeps every anchor
    graph alive until one backward call; ``sequential`` runs each anchor's forward and
    backward on its own (one backward call per anchor, the activation peak of one step, the
    same gradient). ``options.anchors`` is not read here: the caller laid the unit out.
    ``before_backward(last)`` is called before every backward call into the network, ``last``
    True for the unit's last one (FSDP2's gradient-sync switch).
    """
    if mode not in GRAD_MODES:
        raise ValueError(f"gradient mode must be one of {GRAD_MODES}, got {mode!r}")
    if options.endpoint_backward not in ENDPOINT_BACKWARDS:
        raise ValueError(
            f"endpoint_backward must be one of {ENDPOINT_BACKWARDS}, "
            f"got {options.endpoint_backward!r}"
        )
    if not windows or not all(windows):
        raise ValueError("a window needs at least one step")
    before_backward = before_backward or (lambda last: None)
    unit_mode = mode if sum(len(w) for w in windows) > 1 else "exact"
    stats = [WindowStats(steps=list(w), mode=unit_mode) for w in windows]
    if unit_mode == "exact":
        for i, part in enumerate(stats):
            last_window = i == len(stats) - 1
            _exact(
                velocity,
                batch,
                part,
                lambda last, last_window=last_window: before_backward(last and last_window),
            )
        return stats
    layout = anchor_layout(batch.sigmas, windows, unit_mode, options.weights, options.no_interp)
    _aggregated(velocity, batch, layout, stats, options, before_backward)
    return stats


def split_windows(
    steps: Sequence[int], window: int, anchors: Anchors = DEFAULT_OPTIONS.anchors
) -> list[list[int]]:
    """The trained steps each window owns, in order; the last window may be shorter (ragged).

    ``separate``: consecutive chunks of ``window`` steps. ``shared``: the first window owns
    ``window`` steps and every later one ``window - 1``, because its interval starts at the
    last step of the window before (the shared anchor): every interval spans ``window`` steps.
    """
    if anchors not in ANCHORS:
        raise ValueError(f"anchors must be one of {ANCHORS}, got {anchors!r}")
    minimum = 2 if anchors == "shared" else 1
    if window < minimum:
        raise ValueError(f"window must be >= {minimum} with {anchors} anchors, got {window}")
    steps = list(steps)
    if anchors == "separate":
        return [steps[i : i + window] for i in range(0, len(steps), window)]
    rest = steps[window:]
    return [steps[:window]] + [rest[i : i + window - 1] for i in range(0, len(rest), window - 1)]


def route_windows(n_windows: int, jagg_frac: float) -> list[bool]:
    """True for the first round(f * n) windows (highest noise first): the approximated ones."""
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be in [0, 1], got {jagg_frac}")
    n_routed = math.floor(jagg_frac * n_windows + 0.5)
    return [i < n_routed for i in range(n_windows)]


def approximated_units(
    routed: Sequence[bool], anchors: Anchors = DEFAULT_OPTIONS.anchors
) -> list[list[int]]:
    """The window indices of each approximated unit.

    Every routed window alone (separate), or each run of consecutive routed windows (shared:
    they share their boundary anchors).
    """
    units: list[list[int]] = []
    for w, approx in enumerate(routed):
        if not approx:
            continue
        if anchors == "shared" and units and units[-1][-1] == w - 1:
            units[-1].append(w)
        else:
            units.append([w])
    return units


def reusable_steps(
    trained_steps: Sequence[int],
    window: int,
    routed: Sequence[bool] | None,
    mode: str,
    no_interp: NoInterpVariant = DEFAULT_OPTIONS.no_interp,
    anchors: Anchors = DEFAULT_OPTIONS.anchors,
) -> list[int]:
    """The trained steps whose sampled velocities an on-policy JAGG step can reuse.

    Every step of each approximated unit that has interiors to fill in: the interiors are
    reused, the anchors are what the reuse is checked against (:class:`_Unit`). None for
    ``exact``, for ``no_interp`` with ``drop`` (interior signals unused), for intervals of two
    steps and for windows routed to the exact engine. ``routed`` None: any window may be
    routed (routing decided later, e.g. probed).
    """
    if mode == "exact" or (mode == "no_interp" and no_interp == "drop"):
        return []
    windows = split_windows(trained_steps, window, anchors)
    routed = [True] * len(windows) if routed is None else list(routed)
    steps: list[int] = []
    for unit in approximated_units(routed, anchors):
        chunks = [windows[w] for w in unit]
        if any(len(interval) > 2 for interval in layout_intervals(chunks)):
            steps.extend(k for chunk in chunks for k in chunk)
    return steps


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


def _merge(into: WindowStats, part: WindowStats) -> None:
    """Add one unit's share of a window's work to the window's statistics."""
    into.loss += part.loss
    into.forward_rows += part.forward_rows
    into.network_calls += part.network_calls
    into.backward_calls += part.backward_calls
    into.reused_rows += part.reused_rows
    into.recomputed_rows += part.recomputed_rows
    into.reuse_rejected |= part.reuse_rejected
    if part.reuse_error is not None:
        into.reuse_error = max(into.reuse_error or 0.0, part.reuse_error)


def accumulate_gradient(
    velocity: Velocity,
    micro_batches: Sequence[MicroBatch],
    windows: Sequence[Sequence[int]],
    routed: Sequence[bool],
    mode: GradMode,
    options: EngineOptions = DEFAULT_OPTIONS,
    set_sync: Callable[[bool], None] | None = None,
) -> list[list[WindowStats]]:
    """Accumulate one optimizer step's gradient; ``stats[micro_batch][window]``.

    THE accumulation loop: training and the gradient diagnostic both run it, so the backward
    calls they report are the same thing. Windows with ``routed`` True use ``mode``, the others
    are exact. Work is grouped into units: one per approximated unit (a window, or under
    ``options.anchors="shared"`` a run of consecutive routed windows, see
    :func:`split_windows`) and one per step of an exact window (an exact window IS W
    single-step backward calls, so splitting it computes exactly the same thing).
    ``set_sync(on)`` (FSDP2's gradient sync) is called before each backward call with on for
    the last one only: FSDP2 then accumulates the unsharded gradients locally and reduces each
    parameter group ONCE per optimizer step instead of once per backward call (fewer
    collectives, at the memory cost of holding the unsharded gradients of the step).
    """
    if len(routed) != len(windows):
        raise ValueError(f"routing has {len(routed)} entries for {len(windows)} windows")
    approximated = approximated_units(routed, options.anchors) if mode != "exact" else []
    first_of = {unit[0]: unit for unit in approximated}
    covered = {w for unit in approximated for w in unit}
    per_batch: list[tuple[list[int], list[list[int]], str]] = []
    for w, chunk in enumerate(windows):
        if w in first_of:
            per_batch.append((first_of[w], [list(windows[i]) for i in first_of[w]], mode))
        elif w not in covered:
            per_batch.extend(([w], [[k]], "exact") for k in chunk)
    units = [(m, *unit) for m in range(len(micro_batches)) for unit in per_batch]
    stats = [[WindowStats(steps=list(c), mode="exact") for c in windows] for _ in micro_batches]
    for index, (m, window_indices, chunks, unit_mode) in enumerate(units):
        last_unit = index == len(units) - 1

        def before_backward(last: bool, last_unit: bool = last_unit) -> None:
            if set_sync is not None:
                set_sync(last_unit and last)

        results = unit_gradient(
            velocity, micro_batches[m], chunks, unit_mode, options, before_backward
        )
        for w, result in zip(window_indices, results, strict=True):
            if unit_mode != "exact":
                stats[m][w].mode = result.mode
            _merge(stats[m][w], result)
    return stats


def trajectory_gradient(
    velocity: Velocity,
    batch: MicroBatch,
    steps: Sequence[int],
    *,
    window: int,
    mode: GradMode,
    options: EngineOptions = DEFAULT_OPTIONS,
    jagg_frac: float = 1.0,
    routing: Sequence[bool] | None = None,
) -> TrajectoryStats:
    """Accumulate the gradient over all trained ``steps`` of one batch, windowed and routed.

    :func:`accumulate_gradient` on a single micro-batch: windows (laid out by
    ``options.anchors``) routed by ``jagg_frac`` (or an explicit per-window ``routing``) use
    ``mode``; the others are exact. With ``mode="exact"`` every window is exact whatever the
    routing. ``batch.velocities``: see :func:`unit_gradient`.
    """
    windows = split_windows(steps, window, options.anchors)
    if routing is None:
        routing = route_windows(len(windows), jagg_frac)
    (stats,) = accumulate_gradient(velocity, [batch], windows, routing, mode, options)
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
    """Agreement of each approximate mode with the exact gradient on one window.

    ``steps``: the trained steps the window owns; ``interval``: its interpolation span, from
    anchor to anchor (under shared anchors it starts at the window before's last step).
    """

    index: int
    steps: list[int]
    interval: list[int]
    sigma_start: float
    sigma_end: float
    jagg: Agreement
    no_interp: Agreement

    def to_dict(self) -> dict[str, Any]:
        """The record every report uses: gradcheck's JSON, train metrics and checkpoints."""
        return asdict(self)


def _owned_only(step_loss: StepLoss, owned: Sequence[int]) -> StepLoss:
    """``step_loss`` on the steps ``owned``, zero (with a zero signal) on the others."""
    owned = set(owned)

    def loss(v: torch.Tensor, k: int) -> torch.Tensor:
        return step_loss(v, k) if k in owned else (v * 0).sum()

    return loss


def probe_windows(
    params: Iterable[torch.nn.Parameter],
    velocity: Velocity,
    batch: MicroBatch,
    steps: Sequence[int],
    *,
    window: int,
    options: EngineOptions = DEFAULT_OPTIONS,
) -> list[WindowProbe]:
    """Per window, cos-sim and relative error of the jagg and no_interp gradients vs exact.

    The gradient of the steps a window owns, as the layout ``options.anchors`` computes it with
    every window approximated: under shared anchors a window's interval borrows the anchor
    before it, whose own step's signal (owned by the window before) is left out here. Every
    velocity is recomputed (``batch.velocities`` unused): the probe measures the
    approximation, not the reuse. What ``jagg_frac: auto`` routes on; leaves the parameters'
    ``.grad`` as it found them.
    """
    params = [p for p in params if p.requires_grad]
    windows = split_windows(steps, window, options.anchors)
    probes = []
    for index, (chunk, interval) in enumerate(zip(windows, layout_intervals(windows), strict=True)):
        borrowed = interval[: len(interval) - len(chunk)] if options.anchors == "shared" else []
        owned = replace(batch, objective=_owned_only(batch.objective, chunk), velocities=None)
        approximated = [borrowed, chunk] if borrowed else [chunk]
        grads = {}
        for mode in GRAD_MODES:
            unit = [chunk] if mode == "exact" else approximated
            grads[mode] = collect_gradient(
                params,
                functools.partial(unit_gradient, velocity, owned, unit, mode, options),
            )
        span = interval if options.anchors == "shared" else chunk
        probes.append(
            WindowProbe(
                index=index,
                steps=chunk,
                interval=span,
                sigma_start=float(batch.sigmas[span[0]]),
                sigma_end=float(batch.sigmas[span[-1]]),
                jagg=agreement(grads["jagg"], grads["exact"]),
                no_interp=agreement(grads["no_interp"], grads["exact"]),
            )
        )
    return probes
