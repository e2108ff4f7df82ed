import torch

from jagg_pipeline.backbones import build_analytic
from jagg_pipeline.bench.gradcheck import GradcheckConfig, build_problem
from jagg_pipeline.core import grpo, sde
from jagg_pipeline.core.objective import GRPOStepLoss


def test_step_loss_sums_to_the_mean_ppo_loss_over_samples_and_steps():
    p = build_problem(GradcheckConfig(backbone="mlp-dit", trajectory="sde", batch=3))
    objective = p.objective()
    batch = p.latents.shape[0]
    total, per_sample = 0.0, []
    for k in p.steps:
        sigma = sde.sigma_batch(p.sigmas, k, batch, p.latents.dtype)
        v = p.velocity(p.latents[:, k], sigma, p.cond).detach()
        total += float(objective(v, k))
        gaussian = sde.step(v, p.latents[:, k], p.sigmas[k], p.sigmas[k + 1], None, p.coeffs)
        logp = sde.log_prob(p.latents[:, k + 1], gaussian.mean, gaussian.std)
        per_sample.append(
            grpo.ppo_clip_loss(logp, p.old_log_probs[:, k], p.advantages, 1e-4, "none")
        )
    assert abs(total - float(torch.stack(per_sample).mean())) < 1e-12


def test_kl_term_vanishes_at_the_reference_and_adds_the_gaussian_kl_elsewhere():
    p = build_problem(GradcheckConfig(backbone="mlp-dit", trajectory="sde", batch=2))
    other = build_analytic("mlp-dit", dtype=torch.float64, seed=7).module
    args = (p.latents, p.sigmas, p.old_log_probs, p.advantages, p.steps, p.coeffs, 1e-4)
    plain = GRPOStepLoss(*args)
    same = GRPOStepLoss(*args, kl_beta=0.5, reference=p.velocity, cond=p.cond)
    different = GRPOStepLoss(*args, kl_beta=0.5, reference=other, cond=p.cond)
    k = p.steps[2]
    sigma = sde.sigma_batch(p.sigmas, k, 2, p.latents.dtype)
    v = p.velocity(p.latents[:, k], sigma, p.cond).detach()
    assert torch.equal(same(v, k), plain(v, k))
    mean = sde.step(v, p.latents[:, k], p.sigmas[k], p.sigmas[k + 1], None, p.coeffs)
    ref_v = other(p.latents[:, k], sigma, p.cond).detach()
    ref = sde.step(ref_v, p.latents[:, k], p.sigmas[k], p.sigmas[k + 1], None, p.coeffs)
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean.mean, mean.std),
        torch.distributions.Normal(ref.mean, ref.std),
    )
    expected_extra = 0.5 * kl.flatten(1).mean(1).sum() / plain.normalizer
    assert torch.allclose(different(v, k) - plain(v, k), expected_extra, rtol=1e-10)
