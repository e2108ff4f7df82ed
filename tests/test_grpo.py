import numpy as np
import pytest
import torch

from jagg_pipeline.core import grpo


def test_group_advantages_match_a_brute_force_loop():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=gen, dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 3, 9, 9, 9, 9, 9])
    adv = grpo.group_advantages(rewards, groups, eps=1e-6, clip=None)
    expected = torch.empty_like(rewards)
    for g in groups.unique():
        members = rewards[groups == g].numpy()
        expected[groups == g] = torch.from_numpy(
            (members - members.mean()) / (members.std() + 1e-6)
        )
    assert torch.allclose(adv.values, expected, rtol=1e-12)
    assert adv.zero_std_groups == 0


def test_global_std_and_clipping_and_zero_std_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2, 2])
    adv = grpo.group_advantages(rewards, groups, std_mode="global", eps=0.0, clip=None)
    global_std = np.std(rewards.numpy())
    assert adv.values[3] == pytest.approx(5.0 / global_std)
    assert adv.zero_std_groups == 2
    assert torch.equal(adv.values[[0, 1, 4, 5, 6, 7]], torch.zeros(6, dtype=torch.float64))
    clipped = grpo.group_advantages(torch.tensor([0.0] * 99 + [1.0]), torch.zeros(100), clip=5.0)
    assert float(clipped.values.max()) == 5.0


def test_ppo_clip_loss_against_elementwise_reference():
    logp_old = torch.zeros(6, dtype=torch.float64)
    logp_new = torch.log(torch.tensor([0.5, 0.95, 1.0, 1.05, 1.5, 1.5], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    e = 0.1
    per = grpo.ppo_clip_loss(logp_new, logp_old, adv, e, reduction="none")
    ratio = torch.exp(logp_new)
    expected = [
        max(-a * r, -a * min(max(r, 1 - e), 1 + e))
        for a, r in zip(adv.tolist(), ratio.tolist(), strict=True)
    ]
    assert torch.allclose(per, torch.tensor(expected, dtype=torch.float64))
    assert grpo.ppo_clip_loss(logp_new, logp_old, adv, e, "sum") == pytest.approx(sum(expected))
    assert grpo.ppo_clip_loss(logp_new, logp_old, adv, e) == pytest.approx(sum(expected) / 6)
    with pytest.raises(ValueError, match="reduction"):
        grpo.ppo_clip_loss(logp_new, logp_old, adv, e, "avg")


def test_ppo_clip_gradient_vanishes_outside_the_trust_region():
    logp_new = torch.log(torch.tensor([1.5, 1.01], dtype=torch.float64)).requires_grad_(True)
    loss = grpo.ppo_clip_loss(
        logp_new,
        torch.zeros(2, dtype=torch.float64),
        torch.tensor([1.0, 1.0], dtype=torch.float64),
        0.1,
        "sum",
    )
    loss.backward()
    assert logp_new.grad[0] == 0.0
    assert logp_new.grad[1] == pytest.approx(-1.01)


def test_kl_to_reference_is_the_gaussian_kl():
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    ref = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    std = torch.tensor([0.3, 0.5, 0.7], dtype=torch.float64)
    kl = grpo.kl_to_reference(mean, ref, std, beta=1.0, reduction="none")
    for i in range(3):
        p = torch.distributions.Normal(mean[i], std[i])
        q = torch.distributions.Normal(ref[i], std[i])
        assert kl[i] == pytest.approx(float(torch.distributions.kl_divergence(p, q).mean()))


def test_diagnostics():
    new = torch.tensor([0.0, 0.2, -0.2, 0.01])
    old = torch.zeros(4)
    assert float(grpo.clip_fraction(new, old, 0.1)) == 0.5
    assert float(grpo.approx_kl(new, old)) == pytest.approx(0.5 * (0.04 + 0.04 + 0.0001) / 4)
