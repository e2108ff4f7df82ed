import math

import pytest
import torch

from jagg_pipeline.core import sde


def test_static_shift_matches_formula_and_endpoints():
    sig = sde.static_shift_sigmas(8, 3.0)
    u = torch.linspace(1, 0, 9, dtype=torch.float64)
    assert torch.allclose(sig, 3 * u / (1 + 2 * u))
    assert sig[0] == 1 and sig[-1] == 0
    assert torch.all(sig[1:] < sig[:-1])
    assert torch.equal(sde.static_shift_sigmas(8, 1.0), u)


def _velocity_and_state(gen, shape=(3, 2, 4, 4)):
    return torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(
        shape, generator=gen, dtype=torch.float64
    )


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo", "cps"])
def test_log_prob_equals_torch_normal_mean_over_elements(kind):
    gen = torch.Generator().manual_seed(0)
    v, x = _velocity_and_state(gen)
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    coeffs = sde.StepCoefficients(kind, 0.7)
    out = sde.step(v, x, 0.6, 0.45, noise, coeffs)
    lp = sde.log_prob(out.x_next, out.mean, out.std, kind)
    if kind == "cps":
        reference = -((out.x_next - out.mean) ** 2).flatten(1).mean(1)
    else:
        normal = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean))
        reference = normal.log_prob(out.x_next).flatten(1).mean(1)
    assert lp.shape == (3,)
    assert torch.allclose(lp, reference, rtol=1e-12, atol=1e-12)


def test_zero_noise_coefficient_is_the_euler_step():
    gen = torch.Generator().manual_seed(1)
    v, x = _velocity_and_state(gen)
    for coeffs in (sde.StepCoefficients("ode", 0.0), sde.StepCoefficients("dance_grpo", 0.0)):
        out = sde.step(v, x, 0.8, 0.7, torch.randn_like(x), coeffs)
        assert torch.allclose(out.mean, x + (0.7 - 0.8) * v, rtol=0, atol=1e-15)
        assert torch.equal(out.x_next, out.mean)
        assert float(out.std) == 0.0


def test_flow_grpo_coefficients_match_the_closed_form():
    gen = torch.Generator().manual_seed(2)
    v, x = _velocity_and_state(gen)
    s, s_next, a = 0.6, 0.45, 0.7
    out = sde.step(v, x, s, s_next, None, sde.StepCoefficients("flow_grpo", a))
    g = a * math.sqrt(s / (1 - s))
    dt = s_next - s
    # The reference implementation's algebraic form of the same mean.
    mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
    assert torch.allclose(out.mean, mean, rtol=0, atol=1e-14)
    assert float(out.std) == pytest.approx(g * math.sqrt(-dt), rel=1e-14)
    # At sigma = 1 the denominator takes the schedule's second sigma.
    first = sde.step(v, x, 1.0, 0.9, None, sde.StepCoefficients("flow_grpo", a), 0.9)
    assert float(first.std) == pytest.approx(a * math.sqrt(1.0 / 0.1) * math.sqrt(0.1))


def test_cps_step_preserves_the_sigma_next_marginal_coefficients():
    gen = torch.Generator().manual_seed(3)
    v, x = _velocity_and_state(gen)
    s, s_next, a = 0.6, 0.45, 0.5
    out = sde.step(v, x, s, s_next, None, sde.StepCoefficients("cps", a))
    std = s_next * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = x - s * v, x + (1 - s) * v
    expected = (1 - s_next) * x0_hat + math.sqrt(s_next**2 - std**2) * eps_hat
    assert torch.allclose(out.mean, expected, rtol=0, atol=1e-14)
    assert float(out.std) == pytest.approx(std)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance_grpo", "cps"])
def test_many_steps_have_the_stated_mean_and_std(kind):
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(1, 6, generator=gen, dtype=torch.float64).expand(200_000, 6)
    x = torch.randn(1, 6, generator=gen, dtype=torch.float64).expand(200_000, 6)
    noise = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    out = sde.step(v, x, 0.7, 0.5, noise, sde.StepCoefficients(kind, 0.8))
    std = float(out.std)
    n = v.shape[0]
    # 5-sigma bounds of the sample mean and of the sample std.
    assert torch.allclose(out.x_next.mean(0), out.mean[0], atol=5 * std / math.sqrt(n))
    assert torch.allclose(
        out.x_next.std(0),
        torch.full((6,), std, dtype=torch.float64),
        atol=5 * std / math.sqrt(2 * n),
    )


def test_per_sample_sigmas_equal_scalar_sigmas_row_by_row():
    gen = torch.Generator().manual_seed(5)
    v, x = _velocity_and_state(gen)
    sig = torch.tensor([0.9, 0.6, 0.3], dtype=torch.float64)
    nxt = sig - 0.1
    coeffs = sde.StepCoefficients("flow_grpo", 0.7)
    batched = sde.step(v, x, sig, nxt, None, coeffs)
    for i in range(3):
        row = sde.step(v[i : i + 1], x[i : i + 1], float(sig[i]), float(nxt[i]), None, coeffs)
        assert torch.equal(batched.mean[i : i + 1], row.mean)


def test_full_trajectory_masks_exclude_the_last_step():
    masks = sde.full_trajectory_masks(10)
    assert masks.sde.all()
    assert masks.trained_indices == list(range(9))
    gen = torch.Generator().manual_seed(0)
    part = sde.full_trajectory_masks(10, trained_fraction=0.5, generator=gen)
    assert len(part.trained_indices) == 4 or len(part.trained_indices) == 5
    assert 9 not in part.trained_indices
    again = sde.full_trajectory_masks(10, 0.5, torch.Generator().manual_seed(0))
    assert part.trained_indices == again.trained_indices


def test_segment_masks_draw_the_start_in_range():
    starts = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        masks = sde.segment_masks(10, 3, (0, 4), gen)
        idx = masks.trained_indices
        assert len(idx) == 3 and idx == list(range(idx[0], idx[0] + 3))
        assert torch.equal(masks.sde, masks.train)
        starts.add(idx[0])
    assert starts == {0, 1, 2, 3, 4}
    last = sde.segment_masks(10, 3, (7, 7))
    assert last.trained_indices == [7, 8] and bool(last.sde[9])
    with pytest.raises(ValueError, match="does not fit"):
        sde.segment_masks(10, 3, (0, 8))


def test_per_sample_generators_make_each_sample_independent_of_its_batch():
    def velocity(z, sigma, cond):
        return -z * sigma.view(-1, 1, 1, 1)

    sigmas = sde.static_shift_sigmas(6, 3.0)
    masks = sde.full_trajectory_masks(6)
    coeffs = sde.StepCoefficients("flow_grpo", 0.7)
    x = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    seeds = [11, 12, 13, 14]
    whole = sde.sample(
        velocity, None, x, sigmas, masks, coeffs, [torch.Generator().manual_seed(s) for s in seeds]
    )
    half = sde.sample(
        velocity,
        None,
        x[2:],
        sigmas,
        masks,
        coeffs,
        [torch.Generator().manual_seed(s) for s in seeds[2:]],
    )
    assert torch.equal(whole.latents[2:], half.latents)
    assert torch.equal(whole.log_probs[2:], half.log_probs)
    with pytest.raises(ValueError, match="3 generators for a batch of 4"):
        sde.draw_noise((4, 2), [torch.Generator()] * 3, torch.float32)
