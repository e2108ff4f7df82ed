"""The gradient engines against exact gradients, explicit Jacobians and finite differences."""

import itertools

import pytest
import torch
from torch.func import functional_call, jacrev

from jagg_pipeline.bench.gradcheck import GradcheckConfig, build_problem
from jagg_pipeline.core import jagg, sde
from jagg_pipeline.core.objective import recompute_log_probs
from jagg_pipeline.core.options import EngineOptions


def problem(**kw):
    settings = dict(dtype="float64", num_steps=12, batch=3)
    settings.update(kw)
    return build_problem(GradcheckConfig(**settings))


def window_grads(p, steps, mode, **options):
    return jagg.collect_gradient(
        p.params,
        lambda: jagg.window_gradient(p.velocity, p.batch(), steps, mode, EngineOptions(**options)),
    )


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# 1. exactness conditions -------------------------------------------------------------------


@pytest.mark.parametrize("window", [3, 4, 5])
def test_jagg_is_exact_for_affine_field_on_the_chord_with_time_weights(window):
    p = problem(backbone="affine", trajectory="chord", window=window)
    probes = p.probe()
    assert len(probes) == -(-len(p.steps) // window)
    for probe in probes:
        assert probe.jagg.rel_err < 1e-10, probe
    full_exact, _ = p.gradient("exact")
    full_jagg, _ = p.gradient("jagg")
    assert rel_err(full_jagg, full_exact) < 1e-10
    assert full_exact.norm() > 0


def test_sde_noise_breaks_exactness_for_the_affine_field():
    p = problem(backbone="affine", trajectory="sde", window=4)
    probes = p.probe()
    assert max(pr.jagg.rel_err for pr in probes) > 1e-6


def test_index_weights_break_exactness_under_a_shifted_schedule():
    p = problem(backbone="affine", trajectory="chord", window=4, weights="index")
    probes = p.probe()
    assert max(pr.jagg.rel_err for pr in probes) > 1e-6
    # ... while an unshifted (uniform) schedule makes index and time weights coincide.
    uniform = problem(backbone="affine", trajectory="chord", window=4, shift=1.0)
    a = window_grads(uniform, uniform.steps[:4], "jagg", weights="index")
    b = window_grads(uniform, uniform.steps[:4], "exact")
    assert rel_err(a, b) < 1e-10


def test_jagg_matches_explicit_jacobian_interpolation_on_a_nonlinear_model():
    """Independent reference: form J_0 and J_{W-1} explicitly and interpolate them."""
    p = problem(backbone="mlp-dit", trajectory="sde", window=4, batch=2)
    module = p.backbone.module
    names = [n for n, _ in module.named_parameters()]
    params = {n: q.detach() for n, q in module.named_parameters()}
    steps = p.steps[1:5]
    batch = p.latents.shape[0]

    def velocity_of(theta, k):
        sigma = sde.sigma_batch(p.sigmas, k, batch, p.latents.dtype)
        return functional_call(module, theta, (p.latents[:, k], sigma, p.cond))

    objective = p.objective()
    signals = []
    for k in steps:
        v = velocity_of(params, k).requires_grad_(True)
        (s,) = torch.autograd.grad(objective(v, k), v)
        signals.append(s)
    jac = {k: jacrev(velocity_of)(params, k) for k in (steps[0], steps[-1])}
    t = [float(p.sigmas[k]) for k in steps]
    alphas = [(t[0] - tj) / (t[0] - t[-1]) for tj in t]
    out_dims = signals[0].dim()
    expected = []
    for name in names:
        total = torch.zeros_like(params[name])
        for a, s in zip(alphas, signals, strict=True):
            jj = (1 - a) * jac[steps[0]][name] + a * jac[steps[-1]][name]
            total += torch.tensordot(s, jj, dims=out_dims)
        expected.append(total.flatten())
    expected = torch.cat(expected)
    got = window_grads(p, steps, "jagg")
    assert rel_err(got, expected) < 1e-10
    assert rel_err(got, window_grads(p, steps, "exact")) > 1e-6


# 2. W = 2 and jagg_frac = 0 ----------------------------------------------------------------


def test_window_of_two_is_exact_for_a_nonlinear_model():
    p = problem(backbone="mlp-dit", trajectory="sde", window=2)
    exact, _ = p.gradient("exact")
    approx, stats = p.gradient("jagg", endpoint_backward="joint")
    assert rel_err(approx, exact) < 1e-12
    assert stats.backward_calls == len(stats.windows)
    sequential, _ = p.gradient("jagg", endpoint_backward="sequential")
    assert rel_err(sequential, exact) < 1e-12


@pytest.mark.parametrize("mode", ["jagg", "no_interp"])
def test_jagg_frac_zero_is_identical_to_exact(mode):
    p = problem(backbone="mlp-dit", trajectory="sde", window=4, dtype="float32")
    exact, _ = p.gradient("exact")
    routed, stats = p.gradient(mode, jagg_frac=0.0)
    assert torch.equal(routed, exact)
    assert all(w.mode == "exact" for w in stats.windows)


def test_routing_sends_the_high_noise_windows_to_jagg():
    assert jagg.route_windows(5, 0.6) == [True, True, True, False, False]
    assert jagg.route_windows(4, 0.5) == [True, True, False, False]
    assert jagg.route_windows(3, 0.0) == [False] * 3
    assert jagg.route_windows(3, 1.0) == [True] * 3
    with pytest.raises(ValueError, match="jagg_frac"):
        jagg.route_windows(3, 1.5)
    p = problem(backbone="mlp-dit", trajectory="sde", window=3)
    _, stats = p.gradient("jagg", jagg_frac=0.5)
    assert [w.mode for w in stats.windows] == ["jagg", "jagg", "exact", "exact"]


def test_ragged_windows_and_uneven_splits():
    assert jagg.split_windows(range(11), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    p = problem(backbone="affine", trajectory="chord", window=5)  # 11 trained steps: 5, 5, 1
    exact, _ = p.gradient("exact")
    approx, stats = p.gradient("jagg")
    assert [len(w.steps) for w in stats.windows] == [5, 5, 1]
    assert [w.mode for w in stats.windows] == ["jagg", "jagg", "exact"]
    assert rel_err(approx, exact) < 1e-10


def test_gradient_does_not_depend_on_how_steps_are_grouped_into_backward_calls():
    p = problem(backbone="mlp-dit", trajectory="sde")
    by_window = [p.gradient("exact", window=w)[0] for w in (1, 3, 11)]

    def one_graph():
        objective = p.objective()
        batch = p.latents.shape[0]
        total = sum(
            objective(
                p.velocity(
                    p.latents[:, k], sde.sigma_batch(p.sigmas, k, batch, p.latents.dtype), p.cond
                ),
                k,
            )
            for k in p.steps
        )
        total.backward()

    reference = jagg.collect_gradient(p.params, one_graph)
    for g in by_window:
        assert rel_err(g, reference) < 1e-12


# 3. counting forwards and backwards through a wrapper ---------------------------------------


class _CountBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counter):
        ctx.counter = counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.backward_calls += 1
        return grad, None


class Counting(torch.nn.Module):
    """Counts network calls, evaluated rows (in units of the sample batch) and backward passes."""

    def __init__(self, net, batch):
        super().__init__()
        self.net, self.batch = net, batch
        self.calls = self.rows = self.backward_calls = 0

    def forward(self, z, sigma, cond):
        self.calls += 1
        self.rows += z.shape[0] // self.batch
        out = self.net(z, sigma, cond)
        return _CountBackward.apply(out, self) if out.requires_grad else out


@pytest.mark.parametrize("window", [2, 4, 6])
def test_exact_and_jagg_forward_and_backward_counts(window):
    p = problem(backbone="mlp-dit", trajectory="sde", window=window)
    steps = p.steps[:window]
    expected = {
        "exact": dict(calls=window, rows=window, backward_calls=window),
        "jagg": dict(calls=1 if window == 2 else 2, rows=window, backward_calls=1),
        "no_interp": dict(calls=1, rows=2, backward_calls=1),
    }
    for mode, counts in expected.items():
        net = Counting(p.backbone.module, p.latents.shape[0])
        # The joint endpoint backward's counts (the sequential one's: below).
        stats = jagg.window_gradient(
            net, p.batch(), steps, mode, EngineOptions(endpoint_backward="joint")
        )
        assert dict(calls=net.calls, rows=net.rows, backward_calls=net.backward_calls) == counts
        assert (stats.network_calls, stats.forward_rows, stats.backward_calls) == (
            counts["calls"],
            counts["rows"],
            counts["backward_calls"],
        )
        p.backbone.module.zero_grad()


# 4. the signals s_j ------------------------------------------------------------------------


def test_step_signal_matches_central_finite_differences():
    p = problem(backbone="mlp-dit", trajectory="sde", batch=2)
    objective = p.objective()
    k = p.steps[3]
    batch = p.latents.shape[0]
    with torch.no_grad():
        v = p.velocity(
            p.latents[:, k], sde.sigma_batch(p.sigmas, k, batch, p.latents.dtype), p.cond
        )
    signal, _ = jagg._step_signal(objective, v, k)
    h = 1e-6
    flat_v = v.reshape(-1)
    flat_fd = torch.zeros_like(flat_v)
    for i in range(flat_v.numel()):
        plus, minus = flat_v.clone(), flat_v.clone()
        plus[i] += h
        minus[i] -= h
        flat_fd[i] = (objective(plus.view_as(v), k) - objective(minus.view_as(v), k)) / (2 * h)
    assert signal.abs().max() > 0
    assert torch.allclose(signal, flat_fd.view_as(v), rtol=1e-6, atol=1e-9)


# 5. no_interp ------------------------------------------------------------------------------


def test_no_interp_differs_from_jagg_on_a_nonlinear_model():
    p = problem(backbone="mlp-dit", trajectory="sde", window=4)
    steps = p.steps[:4]
    exact = window_grads(p, steps, "exact")
    approx = window_grads(p, steps, "jagg")
    ablation = window_grads(p, steps, "no_interp")
    assert rel_err(ablation, approx) > 1e-3
    assert rel_err(approx, exact) < rel_err(ablation, exact)


def _reference_assignment(p, steps, assign):
    """sum_j (w0_j J_0 + w1_j J_{W-1})^T s_j with per-step forwards (no stacking, no proxy)."""
    batch = p.latents.shape[0]
    objective = p.objective()

    def velocity(k):
        return p.velocity(
            p.latents[:, k], sde.sigma_batch(p.sigmas, k, batch, p.latents.dtype), p.cond
        )

    def run():
        signals = []
        for k in steps:
            v = velocity(k).detach().requires_grad_(True)
            (s,) = torch.autograd.grad(objective(v, k), v)
            signals.append(s)
        s_start = sum(w0 * s for (w0, _), s in zip(assign, signals, strict=True))
        s_end = sum(w1 * s for (_, w1), s in zip(assign, signals, strict=True))
        surrogate = (velocity(steps[0]) * s_start).sum() + (velocity(steps[-1]) * s_end).sum()
        surrogate.backward()

    return jagg.collect_gradient(p.params, run)


def test_no_interp_drop_uses_only_the_endpoint_signals():
    p = problem(backbone="mlp-dit", trajectory="sde", window=4)
    steps = p.steps[:4]
    got = window_grads(p, steps, "no_interp", no_interp="drop")
    expected = _reference_assignment(p, steps, [(1, 0), (0, 0), (0, 0), (0, 1)])
    assert rel_err(got, expected) < 1e-12
    # ... which is the exact gradient of the two endpoint steps alone.
    endpoints = window_grads(p, [steps[0]], "exact") + window_grads(p, [steps[-1]], "exact")
    assert rel_err(got, endpoints) < 1e-12


def test_no_interp_nearest_hands_interior_signals_to_the_nearer_endpoint():
    p = problem(backbone="mlp-dit", trajectory="sde", window=5)
    steps = p.steps[:5]
    alphas = jagg.interpolation_weights(p.sigmas, steps)
    assign = [(1, 0) if a < 0.5 else (0, 1) if a > 0.5 else (0.5, 0.5) for a in alphas]
    assert (1, 0) in assign[1:-1] and (0, 1) in assign[1:-1]  # both sides get interior steps
    got = window_grads(p, steps, "no_interp", no_interp="nearest")
    assert rel_err(got, _reference_assignment(p, steps, assign)) < 1e-12
    dropped = window_grads(p, steps, "no_interp", no_interp="drop")
    assert rel_err(got, dropped) > 1e-3


# 7. on-policy: the training path recomputes the sampler's log-probs ------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rollout_log_probs_recomputed_give_ratio_exactly_one(dtype):
    p = problem(backbone="mlp-dit", trajectory="sde", dtype=dtype)
    recomputed = recompute_log_probs(p.velocity, p.latents, p.sigmas, p.cond, p.steps, p.coeffs)
    assert torch.equal(recomputed, p.old_log_probs[:, p.steps])
    objective = p.objective()
    p.gradient("exact")  # fresh objectives inside; run one here to inspect what it saw
    batch = jagg.MicroBatch(p.latents, p.sigmas, p.cond, objective)
    jagg.trajectory_gradient(p.velocity, batch, p.steps, window=4, mode="exact")
    for k in p.steps:
        assert torch.equal(objective.seen[k], p.old_log_probs[:, k])
    assert objective.diagnostics() == {"clipfrac": 0.0, "approx_kl": 0.0, "max_ratio_dev": 0.0}


def test_engine_errors_name_the_problem():
    p = problem(backbone="affine")
    with pytest.raises(ValueError, match="gradient mode"):
        jagg.window_gradient(p.velocity, p.batch(), [0, 1], "fast")
    with pytest.raises(ValueError, match="routing has 1 entries for 3 windows"):
        jagg.trajectory_gradient(
            p.velocity, p.batch(), p.steps, window=4, mode="jagg", routing=[True]
        )
    with pytest.raises(ValueError, match="equal endpoint sigmas"):
        jagg.interpolation_weights(torch.tensor([0.5, 0.5]), [0, 1])


def test_repeat_cond_stacks_nested_conditions():
    c = {"a": torch.ones(2, 3), "b": (torch.zeros(2), None), "scale": 4.0}
    out = jagg.repeat_cond(c, 3)
    assert out["a"].shape == (6, 3) and out["b"][0].shape == (6,) and out["b"][1] is None
    assert out["scale"] == 4.0


def test_unstacked_forwards_keep_ratio_exactly_one_and_the_same_gradient():
    p = problem(backbone="mlp-dit", trajectory="sde", dtype="float32", window=4)
    stacked, _ = p.gradient("jagg")
    objective = p.objective()
    net = Counting(p.backbone.module, p.latents.shape[0])
    stats = jagg.trajectory_gradient(
        net,
        jagg.MicroBatch(p.latents, p.sigmas, p.cond, objective),
        p.steps,
        window=4,
        mode="jagg",
        options=EngineOptions(stack_forwards=False, endpoint_backward="joint"),
    )
    for k in p.steps:
        assert torch.equal(objective.seen[k], p.old_log_probs[:, k])
    # One backward call per window, traversing the network once per endpoint output.
    assert stats.backward_calls == len(stats.windows) == 3
    assert net.backward_calls == 2 + 2 + 2  # windows of 4, 4, 3 steps
    assert net.calls == stats.network_calls == 4 + 4 + 3
    p.backbone.module.zero_grad()
    unstacked, _ = p.gradient("jagg", stack_forwards=False)
    assert rel_err(unstacked, stacked) < 1e-5


# 6. reusing the rollout's velocities on the on-policy step ----------------------------------


@pytest.mark.parametrize(
    ("backbone", "dtype", "tolerance"),
    [
        ("mlp-dit", "float64", 1e-12),
        ("tiny-flux", "float64", 1e-12),
        ("tiny-flux", "float32", 1e-5),
    ],
)
def test_reused_rollout_velocities_give_the_recomputed_gradient(backbone, dtype, tolerance):
    """The sampler's own v_k are what the interior forward recomputes at unchanged weights.

    The same gradient up to the batch composition of the stacked forwards, with no interior
    forward: measured 0.0 (bit for bit) on CPU for every backbone in float32 and float64;
    kernels that depend on the batch size (GPUs) may round differently.
    """
    p = problem(backbone=backbone, trajectory="sde", window=4, dtype=dtype, batch=4)
    for mode, variant in [("jagg", "drop"), ("no_interp", "nearest")]:
        recomputed, plain = p.gradient(mode, no_interp=variant)
        reused, fast = p.gradient(mode, no_interp=variant, known_velocities=p.velocities)
        assert rel_err(reused, recomputed) < tolerance, (mode, rel_err(reused, recomputed))
        # Two interior steps per window of 4 (the ragged last window of 2 has none).
        windows = jagg.split_windows(p.steps, 4)
        assert fast.reused_rows == sum(max(len(w) - 2, 0) for w in windows)
        assert plain.reused_rows == 0
        assert fast.network_calls == plain.network_calls - sum(len(w) > 2 for w in windows)
        assert fast.backward_calls == plain.backward_calls
    # Exact windows never take them: the same computation, bit for bit.
    exact, _ = p.gradient("exact")
    also_exact, stats = p.gradient("exact", known_velocities=p.velocities)
    assert torch.equal(exact, also_exact) and stats.reused_rows == 0


@pytest.mark.parametrize("endpoint_backward", ["joint", "sequential"])
@pytest.mark.parametrize("backbone", ["mlp-dit", "tiny-flux"])
def test_stale_stored_velocities_are_detected_and_recomputed(backbone, endpoint_backward):
    """Stored velocities 1e-3 off (other weights, dropout, another base): the recomputed
    endpoints disagree beyond rounding, so the interiors are recomputed and the gradient is
    the recomputed one; the window's record says so. Unchanged ones pass the check."""
    p = problem(backbone=backbone, trajectory="sde", window=4, batch=4)
    options = dict(endpoint_backward=endpoint_backward)
    recomputed, _ = p.gradient("jagg", **options)
    stale = {k: v * (1 + 1e-3) for k, v in p.velocities.items()}
    checked, stats = p.gradient("jagg", known_velocities=stale, **options)
    assert rel_err(checked, recomputed) < 1e-12
    approximated = [w for w in stats.windows if len(w.steps) > 2]
    assert approximated and all(w.reuse_rejected and w.reused_rows == 0 for w in approximated)
    assert all(w.reuse_error == pytest.approx(1e-3 / (1 + 1e-3)) for w in approximated)
    _, fresh = p.gradient("jagg", known_velocities=p.velocities, **options)
    assert not any(w.reuse_rejected for w in fresh.windows)
    assert all(w.reuse_error < jagg.reuse_tolerance(torch.float64) for w in fresh.windows)
    assert fresh.reused_rows == sum(len(w.steps) - 2 for w in approximated)


# 7. the endpoint backward schedule: joint (one backward) or sequential (exact's memory) -----


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("backbone", ["mlp-dit", "tiny-flux"])
def test_sequential_endpoint_backward_gives_the_joint_gradient(backbone, reuse):
    p = problem(backbone=backbone, trajectory="sde", window=4, batch=3)
    known = p.velocities if reuse else None
    for mode, variant in [("jagg", "drop"), ("no_interp", "drop"), ("no_interp", "nearest")]:
        joint, joint_stats = p.gradient(
            mode, no_interp=variant, known_velocities=known, endpoint_backward="joint"
        )
        seq, seq_stats = p.gradient(
            mode, no_interp=variant, known_velocities=known, endpoint_backward="sequential"
        )
        assert rel_err(seq, joint) < 1e-12, (mode, variant)
        assert seq_stats.loss == pytest.approx(joint_stats.loss, rel=1e-12)
        assert seq_stats.reused_rows == joint_stats.reused_rows
        # Two backward calls per approximated window instead of one; no extra forward rows.
        approximated = sum(len(w.steps) > 1 for w in joint_stats.windows)
        assert seq_stats.backward_calls == joint_stats.backward_calls + approximated
        assert seq_stats.forward_rows == joint_stats.forward_rows


@pytest.mark.parametrize("window", [3, 4])
def test_sequential_endpoint_backward_is_exact_on_the_chord(window):
    p = problem(backbone="affine", trajectory="chord", window=window)
    exact, _ = p.gradient("exact")
    seq, _ = p.gradient("jagg", endpoint_backward="sequential")
    assert rel_err(seq, exact) < 1e-12


def test_sequential_endpoint_backward_holds_one_endpoint_graph_at_a_time():
    """Peak bytes saved for backward: sequential about exact's, joint about twice."""
    from jagg_pipeline.bench.measure import SavedActivations

    p = problem(backbone="tiny-flux", trajectory="sde", window=4, dtype="float32", batch=4)
    peaks = {}
    for name, mode, options in [
        ("exact", "exact", {}),
        ("joint", "jagg", {"endpoint_backward": "joint"}),
        ("sequential", "jagg", {"endpoint_backward": "sequential"}),
    ]:
        with SavedActivations(p.params).measure() as meter:
            p.gradient(mode, known_velocities=p.velocities, **options)
        peaks[name] = meter.peak
    assert peaks["sequential"] <= 1.1 * peaks["exact"], peaks
    assert peaks["joint"] >= 1.8 * peaks["exact"], peaks


def test_gradient_sync_is_on_for_the_last_backward_call_of_the_step_only():
    """FSDP2 reduces once per optimizer step: every backward call but the last runs unsynced,
    whichever endpoint schedule (sequential makes two calls per window)."""
    p = problem(backbone="mlp-dit", trajectory="sde", window=4)
    windows = jagg.split_windows(p.steps, 4)
    for endpoint_backward, calls in [("joint", 3), ("sequential", 6)]:
        switches = []
        batch = p.batch()
        jagg.accumulate_gradient(
            p.velocity,
            [batch, batch],
            windows,
            [True] * len(windows),
            "jagg",
            EngineOptions(endpoint_backward=endpoint_backward),
            switches.append,
        )
        assert switches == [False] * (2 * calls - 1) + [True], endpoint_backward


def test_velocities_stored_in_a_finer_precision_than_training_computes_are_refused():
    """A float32 rollout under bf16 training (what mixed precision did before the rollout
    computed in bf16 too): the values are within bf16's tolerance, but bf16 cannot hold them,
    so they were not computed the way training computes; the same values rounded to bf16 pass."""
    p = problem(backbone="tiny-flux", trajectory="sde", window=4, dtype="float32", batch=4)

    def bf16_output(z, sigma, cond):
        return p.velocity(z, sigma, cond).to(torch.bfloat16)

    def run(known):
        return p.gradient("jagg", network=bf16_output, known_velocities=known)[1]

    approximated = [w for w in run(p.velocities).windows if len(w.steps) > 2]
    assert all(w.reuse_rejected and w.reuse_error < 8 * 2**-7 for w in approximated)
    rounded = {k: v.to(torch.bfloat16).float() for k, v in p.velocities.items()}
    kept = [w for w in run(rounded).windows if len(w.steps) > 2]
    assert not any(w.reuse_rejected for w in kept)
    assert all(w.reused_rows == len(w.steps) - 2 for w in kept)


@pytest.mark.parametrize(
    ("window", "routed", "mode", "no_interp", "expected"),
    [
        (4, None, "jagg", "drop", list(range(8))),  # windows 0-3, 4-7, 8-9: the last has none
        (4, [True, False, True], "jagg", "drop", [0, 1, 2, 3]),
        (4, [False, True, True], "no_interp", "nearest", [4, 5, 6, 7]),
        (4, None, "no_interp", "drop", []),  # interior signals dropped: no interior forwards
        (4, None, "exact", "drop", []),
        (2, None, "jagg", "drop", []),  # windows of two steps have no interiors
        (3, [True, True, True, False], "jagg", "drop", list(range(9))),
    ],
)
def test_reusable_steps_are_the_approximated_windows_with_interiors(
    window, routed, mode, no_interp, expected
):
    steps = list(range(10))
    got = jagg.reusable_steps(steps, window, routed, mode, no_interp)
    # Brute force: a step is kept when its window is approximated, has an interior step that
    # the mode uses, and so needs the endpoints that vouch for the interiors.
    windows = [steps[i : i + window] for i in range(0, 10, window)]
    flags = routed or [True] * len(windows)
    uses_interiors = mode == "jagg" or (mode == "no_interp" and no_interp == "nearest")
    pairs = zip(windows, flags, strict=True)
    brute = [k for w, r in pairs if r and uses_interiors and len(w) >= 3 for k in w]
    assert got == brute == expected


# 8. shared anchors: adjacent windows share their boundary step ------------------------------


def test_shared_windows_own_w_minus_one_steps_after_the_first():
    assert jagg.split_windows(range(12), 4, "shared") == [
        [0, 1, 2, 3],
        [4, 5, 6],
        [7, 8, 9],
        [10, 11],
    ]
    assert jagg.layout_intervals([[0, 1, 2, 3], [4, 5, 6], [7]]) == [
        [0, 1, 2, 3],
        [3, 4, 5, 6],
        [6, 7],
    ]
    assert jagg.approximated_units([True, True, False, True, True], "shared") == [[0, 1], [3, 4]]
    assert jagg.approximated_units([True, True, False], "separate") == [[0], [1]]
    with pytest.raises(ValueError, match="window must be >= 2 with shared"):
        jagg.split_windows(range(5), 1, "shared")
    with pytest.raises(ValueError, match="anchors must be one of"):
        jagg.split_windows(range(5), 3, "overlapping")


@pytest.mark.parametrize("window", [3, 4, 5])
def test_shared_anchors_are_exact_for_affine_field_on_the_chord(window):
    p = problem(backbone="affine", trajectory="chord", window=window, num_steps=17)
    exact, _ = p.gradient("exact")
    for backward in ("joint", "sequential"):
        shared, stats = p.gradient("jagg", anchors="shared", endpoint_backward=backward)
        assert rel_err(shared, exact) < 1e-12, backward
    assert all(probe.jagg.rel_err < 1e-12 for probe in p.probe("shared"))
    assert exact.norm() > 0
    # ... and really shares: one row per W - 1 steps after the first anchor.
    assert stats.forward_rows == len(p.steps)  # anchors and interiors, each once
    assert stats.backward_calls == 1 + -(-(len(p.steps) - 1) // (window - 1))


def test_shared_anchors_with_spacing_one_are_exact_on_a_nonlinear_model():
    """W = 2: every step is an anchor, so nothing is interpolated."""
    p = problem(backbone="mlp-dit", trajectory="sde", window=2)
    exact, _ = p.gradient("exact")
    for backward in ("joint", "sequential"):
        shared, stats = p.gradient("jagg", anchors="shared", endpoint_backward=backward)
        assert rel_err(shared, exact) < 1e-12
        assert stats.forward_rows == len(p.steps)


def test_shared_anchors_match_explicit_jacobian_interpolation_on_a_nonlinear_model():
    """Independent reference: form every anchor's Jacobian explicitly, interpolate it on each
    interval, and sum J_k^T s_k over every step of the run (each counted once)."""
    p = problem(backbone="mlp-dit", trajectory="sde", batch=2)
    module = p.backbone.module
    params = {n: q.detach() for n, q in module.named_parameters()}
    windows = jagg.split_windows(p.steps[:10], 4, "shared")  # intervals 0-3, 3-6, 6-9
    steps = [k for w in windows for k in w]
    batch = p.latents.shape[0]

    def velocity_of(theta, k):
        sigma = sde.sigma_batch(p.sigmas, k, batch, p.latents.dtype)
        return functional_call(module, theta, (p.latents[:, k], sigma, p.cond))

    objective = p.objective()
    signals = {}
    for k in steps:
        v = velocity_of(params, k).requires_grad_(True)
        (signals[k],) = torch.autograd.grad(objective(v, k), v)
    anchors = [steps[0]] + [w[-1] for w in windows]
    jac = {a: jacrev(velocity_of)(params, a) for a in anchors}
    t = {k: float(p.sigmas[k]) for k in steps}
    interpolated = {}
    for left, right in itertools.pairwise(anchors):
        for k in range(left, right + 1):
            a = (t[left] - t[k]) / (t[left] - t[right])
            interpolated[k] = {n: (1 - a) * jac[left][n] + a * jac[right][n] for n in params}
    out_dims = signals[steps[0]].dim()
    expected = torch.cat(
        [
            sum(
                torch.tensordot(signals[k], interpolated[k][n], dims=out_dims) for k in steps
            ).flatten()
            for n in params
        ]
    )
    for backward in ("joint", "sequential"):
        got = jagg.collect_gradient(
            p.params,
            lambda backward=backward: jagg.unit_gradient(
                p.velocity, p.batch(), windows, "jagg", EngineOptions(endpoint_backward=backward)
            ),
        )
        assert rel_err(got, expected) < 1e-12, backward
    separate = sum(window_grads(p, w, "jagg") for w in jagg.split_windows(steps, 4))
    assert rel_err(got, separate) > 1e-6  # another approximation, not the same one


@pytest.mark.parametrize(
    ("trained", "rows"),
    [
        (12, {"exact": 12, "separate": 6, "shared": 5}),
        (16, {"exact": 16, "separate": 8, "shared": 6}),
    ],
)
def test_shared_anchors_need_fewer_rows_with_reuse(trained, rows):
    """Over 12 trained steps at W = 4: 5 anchor rows against 6 (separate) and 12 (exact);
    over 16: 6 against 8 and 16. With the rollout's velocities, no interior forward."""
    p = problem(backbone="mlp-dit", trajectory="sde", window=4, num_steps=trained + 1)
    assert len(p.steps) == trained
    batch = p.latents.shape[0]
    exact, _ = p.gradient("exact")
    joint_calls = {"separate": rows["separate"] // 2, "shared": 1}
    for layout in ("separate", "shared"):
        for backward in ("joint", "sequential"):
            net = Counting(p.backbone.module, batch)
            grads, _ = p.gradient(
                "jagg",
                network=net,
                anchors=layout,
                known_velocities=p.velocities,
                endpoint_backward=backward,
            )
            assert net.rows == rows[layout], (layout, backward)
            calls = joint_calls[layout] if backward == "joint" else rows[layout]
            assert net.backward_calls == calls, (layout, backward)
            assert rel_err(grads, exact) < 0.5  # an approximation of the same gradient


@pytest.mark.parametrize("endpoint_backward", ["joint", "sequential"])
@pytest.mark.parametrize("backbone", ["mlp-dit", "tiny-flux"])
def test_shared_anchors_reuse_stored_velocities_and_notice_stale_ones(backbone, endpoint_backward):
    p = problem(backbone=backbone, trajectory="sde", window=4, batch=3)
    options = dict(anchors="shared", endpoint_backward=endpoint_backward)
    for mode, variant in [("jagg", "drop"), ("no_interp", "nearest")]:
        recomputed, plain = p.gradient(mode, no_interp=variant, **options)
        reused, fast = p.gradient(mode, no_interp=variant, known_velocities=p.velocities, **options)
        assert rel_err(reused, recomputed) < 1e-12, mode
        assert plain.forward_rows == len(p.steps) and plain.reused_rows == 0
        assert fast.reused_rows > 0 and fast.forward_rows + fast.reused_rows == len(p.steps)
    recomputed, _ = p.gradient("jagg", **options)
    stale = {k: v * (1 + 1e-3) for k, v in p.velocities.items()}
    checked, stats = p.gradient("jagg", known_velocities=stale, **options)
    assert rel_err(checked, recomputed) < 1e-12
    assert all(w.reuse_rejected and w.reused_rows == 0 for w in stats.windows)
    # The per-window records add up to the unit's work: every interior once, every anchor once.
    _, fresh = p.gradient("jagg", known_velocities=p.velocities, **options)
    assert fresh.forward_rows + fresh.reused_rows == len(p.steps)
    assert not any(w.reuse_rejected for w in fresh.windows)


def test_shared_anchors_follow_the_routing():
    """jagg_frac routes whole windows: a run of routed windows shares anchors, the rest is
    exact; a gap in the routing starts a new run."""
    p = problem(backbone="mlp-dit", trajectory="sde", window=3, num_steps=13)
    windows = jagg.split_windows(p.steps, 3, "shared")  # 0-2, 3-4, 5-6, 7-8, 9-10, 11
    assert len(windows) == 6
    routing = [True, True, False, True, True, False]
    got, stats = p.gradient("jagg", anchors="shared", routing=routing)
    assert [w.mode for w in stats.windows] == ["jagg", "jagg", "exact", "jagg", "jagg", "exact"]
    expected = (
        jagg.collect_gradient(
            p.params,
            lambda: jagg.unit_gradient(p.velocity, p.batch(), windows[:2], "jagg"),
        )
        + jagg.collect_gradient(
            p.params,
            lambda: jagg.unit_gradient(p.velocity, p.batch(), windows[3:5], "jagg"),
        )
        + window_grads(p, windows[2], "exact")
        + window_grads(p, windows[5], "exact")
    )
    assert rel_err(got, expected) < 1e-12
    exact, _ = p.gradient("exact")
    none_routed, _ = p.gradient("jagg", anchors="shared", jagg_frac=0.0)
    assert torch.equal(none_routed, exact)


@pytest.mark.parametrize(
    ("routed", "expected"),
    [
        (None, list(range(11))),  # intervals 0-3, 3-6, 6-9, 9-10: one unit with interiors
        ([True, False, False, False], [0, 1, 2, 3]),
        ([False, False, True, True], [7, 8, 9, 10]),  # intervals 7-9 (a run's first), 9-10
        ([False, False, False, True], []),  # a lone one-step window: nothing to fill in
    ],
)
def test_reusable_steps_follow_the_shared_layout(routed, expected):
    assert jagg.reusable_steps(range(11), 4, routed, "jagg", anchors="shared") == expected
