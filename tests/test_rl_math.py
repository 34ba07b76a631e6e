"""stages/rl_math.py against numbers worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest
import torch

from stages.rl_math import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    group_advantages,
    is_zero_variance,
    kl_estimators,
    masked_mean,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    sampler_correction,
)


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32),
                          torch.as_tensor(expected, dtype=torch.float32), atol=tol), (actual, expected)


# ---------------------------------------------------------------- group advantages (the seeds' example)


def test_group_centred_advantages_match_the_seed_example():
    # mean 0.25: 0 - 0.25 = -0.25, 1 - 0.25 = 0.75
    close(group_advantages(torch.tensor([0.0, 0, 0, 1]), normalize=False), [-0.25, -0.25, -0.25, 0.75])
    # mean 0.5: +-0.5
    close(group_advantages(torch.tensor([1.0, 1, 0, 0]), normalize=False), [0.5, 0.5, -0.5, -0.5])
    # mean 1: every advantage is 0, and the group is counted as zero-variance
    close(group_advantages(torch.tensor([1.0, 1, 1, 1]), normalize=False), [0, 0, 0, 0])
    assert is_zero_variance(torch.tensor([1.0, 1, 1, 1]))
    assert is_zero_variance(torch.tensor([0.0, 0, 0, 0]))
    assert not is_zero_variance(torch.tensor([0.0, 0, 0, 1]))


def test_group_normalized_advantages_divide_by_the_unbiased_std():
    # [1,1,0,0]: centred +-0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735; 0.5 / 0.57735 = 0.866025
    close(group_advantages(torch.tensor([1.0, 1, 0, 0]), normalize=True), [0.866025, 0.866025, -0.866025, -0.866025])
    # zero variance: 0 / (0 + eps) = 0, never NaN
    close(group_advantages(torch.tensor([1.0, 1, 1, 1]), normalize=True), [0, 0, 0, 0])
    # a group of one has no baseline
    close(group_advantages(torch.tensor([3.0]), normalize=True), [0.0])


# ---------------------------------------------------------------- masks


def test_masked_mean_ignores_padding_even_nan():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 7 / 3)  # (1 + 2 + 4) / 3
    close(masked_mean(x, mask, dim=1), [1.5, 4.0])  # (1 + 2) / 2, 4 / 1
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # nothing to average: 0, not NaN


def test_masked_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean 2, population var (1 + 0 + 1) / 3 = 2/3, std 0.816497; (1 - 2) / 0.816497 = -1.224745
    close(masked_whiten(x, mask), [-1.224745, 0.0, 1.224745, 0.0])
    # shift_mean=False adds the mean 2 back: 0.775255, 2, 3.224745
    close(masked_whiten(x, mask, shift_mean=False), [0.775255, 2.0, 3.224745, 0.0])


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    # p = 0.5, q = 0.25: log q/p = -0.693147
    #   k1 = 0.693147, k2 = 0.5 * 0.480453 = 0.240227, k3 = 0.5 - 1 + 0.693147 = 0.193147
    # p = 0.25, q = 0.5: log q/p = +0.693147
    #   k1 = -0.693147, k2 = 0.240227, k3 = 2 - 1 - 0.693147 = 0.306853
    # p = q: all three are 0
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    logq = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    k1, k2, k3 = kl_estimators(logp, logq)
    close(k1, [0.693147, -0.693147, 0.0])
    close(k2, [0.240227, 0.240227, 0.0])
    close(k3, [0.193147, 0.306853, 0.0])


def test_k1_and_k3_are_unbiased_under_the_policy():
    # p = [0.5, 0.5], q = [0.25, 0.75]: KL(p||q) = 0.5 ln 2 + 0.5 ln(2/3) = 0.346574 - 0.202733 = 0.143841
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.75])
    k1, k2, k3 = kl_estimators(p.log(), q.log())
    close((p * k1).sum(), 0.143841)
    close((p * k3).sum(), 0.143841)  # sum(q) - 1 + KL = KL
    assert (p * k2).sum() > 0.143841  # k2 is biased upward here


# ---------------------------------------------------------------- GAE


def test_gae_gamma_1_lambda_095():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    # deltas: t2 = 1 + 0 - 0.7 = 0.3; t1 = 0 + 0.7 - 0.6 = 0.1; t0 = 0 + 0.6 - 0.5 = 0.1
    # A2 = 0.3; A1 = 0.1 + 0.95 * 0.3 = 0.385; A0 = 0.1 + 0.95 * 0.385 = 0.46575
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.95)
    close(advantages, [[0.46575, 0.385, 0.3]])
    close(returns, [[0.96575, 0.985, 1.0]])  # A + V


def test_gae_gamma_09_lambda_1_is_discounted_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    # deltas: t2 = 1 - 0.7 = 0.3; t1 = 0.9 * 0.7 - 0.6 = 0.03; t0 = 0.9 * 0.6 - 0.5 = 0.04
    # A2 = 0.3; A1 = 0.03 + 0.9 * 0.3 = 0.3; A0 = 0.04 + 0.9 * 0.3 = 0.31
    # (lambda = 1: A_t = gamma^(2-t) * 1 - V_t: 0.81 - 0.5, 0.9 - 0.6, 1 - 0.7)
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=1.0)
    close(advantages, [[0.31, 0.3, 0.3]])
    close(returns, [[0.81, 0.9, 1.0]])


def test_gae_padding_contributes_nothing():
    # row 0: the 3-token sequence above followed by 2 padded tokens with garbage rewards/values
    # row 1: 2 real tokens, rewards [0, 1], values [0.5, 0.6]:
    #   t1 = 1 + 0 - 0.6 = 0.4 (value after the last real token is 0, not the padded 9)
    #   t0 = 0 + 0.6 - 0.5 + 0.95 * 0.4 = 0.48
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0, 7.0], [0.0, 1.0, 3.0, 3.0, 3.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0, 9.0], [0.5, 0.6, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    close(advantages, [[0.46575, 0.385, 0.3, 0, 0], [0.48, 0.4, 0, 0, 0]])
    close(returns, [[0.96575, 0.985, 1.0, 0, 0], [0.98, 1.0, 0, 0, 0]])


def test_gae_skips_observation_tokens_between_turns():
    # a model turn (t0, t1), two observation tokens (t2, t3: garbage rewards and values), the answer (t4), padding:
    # GAE over the model tokens alone, gamma 0.9, lambda 0.5, values [0.5, 0.6, 0.7] at t0, t1, t4:
    #   t4 = 1 - 0.7 = 0.3; t1 = 0.9 * 0.7 - 0.6 + 0.45 * 0.3 = 0.165 (bootstraps from t4, one discount)
    #   t0 = 0.9 * 0.6 - 0.5 + 0.45 * 0.165 = 0.11425
    rewards = torch.tensor([[0.0, 0.0, 8.0, 8.0, 1.0, 4.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(advantages, [[0.11425, 0.165, 0, 0, 0.3, 0]])
    close(returns, [[0.61425, 0.765, 0, 0, 1.0, 0]])
    dropped, _ = gae(rewards[:, [0, 1, 4]], values[:, [0, 1, 4]], torch.ones(1, 3), gamma=0.9, lam=0.5)
    close(advantages[:, [0, 1, 4]], dropped.tolist())


# ---------------------------------------------------------------- PPO losses


def test_ppo_policy_loss_clips_and_counts():
    eps = 0.2
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.0, 3.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 2.0, 10.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -1.0]])
    logprobs = (old + ratio.log()).requires_grad_()
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r 1.5, A +1: max(-1.5, -1.2) = -1.2  clipped term active (too far up on a good token)
    #   r 0.5, A +1: max(-0.5, -0.8) = -0.5  unclipped (pessimistic bound keeps the loss)
    #   r 0.5, A -1: max( 0.5,  0.8) =  0.8  clipped term active
    #   r 1.0, A +2: max(-2.0, -2.0) = -2.0  not clipped
    #   padded token: ignored
    # loss = (-1.2 - 0.5 + 0.8 - 2.0) / 4 = -0.725; clip_frac 2/4; ratio mean (1.5 + 0.5 + 0.5 + 1) / 4 = 0.875
    loss, clip_frac, ratio_mean = ppo_policy_loss(logprobs, old, advantages, mask, eps)
    close(loss, -0.725)
    close(clip_frac, 0.5)
    close(ratio_mean, 0.875)
    # gradient flows only through unclipped real tokens: d/dlogp (-A r / 4) = -A r / 4
    loss.backward()
    close(logprobs.grad, [[0.0, -0.125, 0.0, -0.5, 0.0]])


def test_ppo_value_loss_clips_and_counts():
    old = torch.tensor([0.5, 0.5, 0.0, 0.0])
    values = torch.tensor([1.0, 0.6, -0.5, 50.0])
    returns = torch.tensor([1.0, 1.0, 0.5, 0.0])
    mask = torch.tensor([1, 1, 1, 0])
    # token 0: unclipped (1.0 - 1)^2 = 0; clipped V = 0.7, (0.7 - 1)^2 = 0.09 -> 0.09, clipped counted
    # token 1: both (0.6 - 1)^2 = 0.16 -> 0.16, not counted (not strictly larger)
    # token 2: unclipped (-0.5 - 0.5)^2 = 1.0; clipped V = -0.2, (-0.7)^2 = 0.49 -> 1.0
    # loss = 0.5 * (0.09 + 0.16 + 1.0) / 3 = 0.208333; value_clip_frac = 1/3
    loss, clip_frac = ppo_value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.208333)
    close(clip_frac, 1 / 3)


# ---------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_follows_ziegler():
    # kl 9, target 6: 9/6 - 1 = 0.5, clipped to 0.2; beta = 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    controller.update(9.0, n_steps=256)
    assert controller.value == pytest.approx(0.100512)
    # kl 5.4: 5.4/6 - 1 = -0.1; beta = 0.1 * (1 - 0.1 * 256 / 10000) = 0.099744
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    controller.update(5.4, n_steps=256)
    assert controller.value == pytest.approx(0.099744)
    # kl 0: -1 clipped to -0.2; beta = 0.1 * (1 - 0.00512) = 0.099488
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    controller.update(0.0, n_steps=256)
    assert controller.value == pytest.approx(0.099488)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(100.0, n_steps=1000)
    assert controller.value == 0.05


# ---------------------------------------------------------------- a sampler other than the trainer


def test_token_tis_weights_each_token_by_trainer_over_sampler_truncated_at_the_cap():
    import math

    # log-prob differences trainer - sampler: 0, ln 2, ln 4, -ln 2 (and a padded token, and a NaN the sampler
    # could not give): weights 1, 2, min(4, 3) = 3, 0.5; the NaN token weighs 1; padding 0
    sampler = torch.tensor([[-1.0, -2.0, -3.0, -1.0, float("nan"), -9.0]])
    trainer = sampler + torch.tensor([[0.0, math.log(2), math.log(4), -math.log(2), 0.0, 5.0]])
    trainer[0, 4] = -1.0
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    weights, metrics = sampler_correction(trainer, sampler, mask, "token_tis", 3.0)
    close(weights, [[1.0, 2.0, 3.0, 0.5, 1.0, 0.0]])
    close(metrics["correction/clipped_frac"], 1 / 5)  # one real token of five above the cap
    close(metrics["correction/weight_mean"], (1 + 2 + 3 + 0.5 + 1) / 5)
    ln2 = math.log(2)
    close(metrics["correction/logp_diff_abs_mean"], (0 + ln2 + 2 * ln2 + ln2 + 0) / 5)
    close(metrics["correction/kl_sampler_trainer"], -(0 + ln2 + 2 * ln2 - ln2 + 0) / 5)  # sampler - trainer


def test_sequence_mask_drops_a_sequence_whose_ratio_product_passes_the_cap():
    import math

    sampler = torch.zeros(3, 2)
    # sequence ratios: exp(0.5 + 0.5) = e (kept at cap 3), exp(1 + 1) = e^2 (dropped), exp(-1) (kept)
    trainer = torch.tensor([[0.5, 0.5], [1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])  # the last token of row 3 is padding
    weights, metrics = sampler_correction(trainer, sampler, mask, "sequence_mask", 3.0)
    close(weights, [[math.e, math.e], [0.0, 0.0], [math.exp(-1), 0.0]])
    close(metrics["correction/clipped_frac"], 1 / 3)  # one sequence of three dropped


def test_no_correction_weighs_one_and_still_measures_the_mismatch():
    trainer, sampler = torch.tensor([[-1.0, -1.5]]), torch.tensor([[-1.2, -1.5]])
    weights, metrics = sampler_correction(trainer, sampler, torch.ones(1, 2), "none", 3.0)
    close(weights, [[1.0, 1.0]])
    close(metrics["correction/logp_diff_abs_mean"], 0.1)
    close(metrics["correction/clipped_frac"], 0.0)
    with pytest.raises(ValueError, match="unknown correction kind"):
        sampler_correction(trainer, sampler, torch.ones(1, 2), "icepop", 3.0)


def test_ppo_policy_loss_weights_each_token_term_by_its_sampler_weight():
    # the clipped-surrogate example above, one token at a time: terms -1.2, -0.5, 0.8, -2.0 weighted by
    # 0.5, 2, 1, 0 -> (-0.6 - 1.0 + 0.8 + 0) / 4 = -0.2; the gradient of a weighted token scales with it
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5]])
    logprobs = (old + ratio.log()).requires_grad_()
    loss, _, _ = ppo_policy_loss(logprobs, old, advantages, torch.ones(1, 4), 0.2, torch.tensor([[0.5, 2.0, 1.0, 0.0]]))
    close(loss, -0.2)
    loss.backward()
    close(logprobs.grad, [[0.0, -0.25, 0.0, 0.0]])  # token 2: -A r w / 4 = -1 * 0.5 * 2 / 4
