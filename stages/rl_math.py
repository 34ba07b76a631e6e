"""The RL maths posttrain owns: advantages, masks, KL estimators, GAE, PPO losses, KL control, and the correction of
samples drawn by a sampler other than the trainer. Design: docs/algorithms.md."""

from __future__ import annotations

import torch

def group_advantages(rewards_G: torch.Tensor, normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """Reward minus the group mean; with ``normalize`` also divided by the group std (+ eps). A group of
    one completion has no baseline: its advantage is 0."""
    rewards_G = rewards_G.float()
    if rewards_G.numel() < 2:
        return torch.zeros_like(rewards_G)
    advantages_G = rewards_G - rewards_G.mean()
    if normalize:
        advantages_G = advantages_G / (rewards_G.std() + eps)
    return advantages_G


def is_zero_variance(rewards_G: torch.Tensor, atol: float = 1e-9) -> bool:
    """True when every completion of the group got the same reward: no within-group signal."""
    return bool((rewards_G.max() - rewards_G.min()).abs() <= atol)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is 1; padding (even NaN there) never leaks in; an all-zero mask gives 0."""
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x))
    count = keep.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum().clamp(min=1.0)
    return total.sum(dim) / count.sum(dim).clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (population variance); padding set to 0. With
    ``shift_mean=False`` the mean is added back: only the scale changes (rewards, whose sign means something)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def kl_estimators(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token KL(p || q) estimators, p the policy that sampled, q the reference: k1 = log p/q (unbiased, can be
    negative); k2 = 0.5 (log p/q)^2 (biased, low variance); k3 = q/p - 1 - log(q/p) (unbiased, never negative)."""
    log_ratio = ref_logprobs - logprobs  # log q/p
    k1 = -log_ratio
    k2 = 0.5 * log_ratio**2
    k3 = torch.expm1(log_ratio) - log_ratio
    return k1, k2, k3


def gae(
    rewards_B_T: torch.Tensor, values_B_T: torch.Tensor, mask_B_T: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over the positions where ``mask`` is 1 (the others skipped, not steps; 0 past
    a row's end): (advantages_B_T, returns_B_T = advantages + values), both 0 where the mask is 0."""
    keep_B_T = mask_B_T.bool()
    mask_B_T = mask_B_T.to(values_B_T.dtype)
    values_B_T = values_B_T * mask_B_T
    rewards_B_T = rewards_B_T * mask_B_T
    n_tokens = rewards_B_T.shape[1]
    running_B = torch.zeros_like(values_B_T[:, 0])  # A, then V, at the next masked-in position
    next_value_B = torch.zeros_like(running_B)
    advantages = [None] * n_tokens
    for t in reversed(range(n_tokens)):
        delta_B = rewards_B_T[:, t] + gamma * next_value_B - values_B_T[:, t]
        here_B = delta_B + gamma * lam * running_B
        running_B = torch.where(keep_B_T[:, t], here_B, running_B)
        next_value_B = torch.where(keep_B_T[:, t], values_B_T[:, t], next_value_B)
        advantages[t] = here_B * mask_B_T[:, t]
    advantages_B_T = torch.stack(advantages, dim=1)
    return advantages_B_T, (advantages_B_T + values_B_T) * mask_B_T


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
    sampler_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate (Schulman et al. 2017, eq. 7), negated, averaged over real tokens, each token's term
    times its ``sampler_weights`` if given. Returns (loss, clip_frac, ratio_mean), the last two detached."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
    surrogate = torch.maximum(unclipped, clipped)
    loss = masked_mean(surrogate if sampler_weights is None else surrogate * sampler_weights, mask)
    clip_frac = masked_mean((clipped > unclipped).to(ratio.dtype), mask).detach()
    return loss, clip_frac, masked_mean(ratio, mask).detach()


def ppo_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped within cliprange_value of the old V. Returns
    (loss, value_clip_frac: the share of tokens where the clipped error was larger)."""
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).to(values.dtype), mask).detach()


def sampler_correction(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       kind: str, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights_B_T, mismatch metrics): pi_trainer / pi_sampler per ``kind`` for samples another sampler drew (a
    NaN sampler log-prob weighs 1); it multiplies the policy-gradient term, never the KL term."""
    mask = mask.to(trainer_logprobs.dtype)
    diff = torch.nan_to_num((trainer_logprobs - sampler_logprobs.to(trainer_logprobs)) * mask, nan=0.0)
    if kind == "token_tis":
        raw = torch.exp(diff)
        weights, clipped = torch.clamp(raw, max=cap), masked_mean((raw > cap).to(mask), mask)
    elif kind == "sequence_mask":
        sequence = torch.exp(diff.sum(-1, keepdim=True))
        kept = (sequence <= cap).to(mask)
        weights = (sequence * kept).expand_as(diff)
        real = (mask.sum(-1) > 0).to(mask)
        clipped = ((1 - kept.squeeze(-1)) * real).sum() / real.sum().clamp(min=1.0)
    elif kind == "none":
        weights, clipped = torch.ones_like(diff), torch.zeros(())
    else:
        raise ValueError(f"unknown correction kind {kind!r}: token_tis, sequence_mask or none")
    weights = weights * mask
    metrics = {"correction/logp_diff_abs_mean": masked_mean(diff.abs(), mask),
               "correction/kl_sampler_trainer": masked_mean(-diff, mask),
               "correction/weight_mean": masked_mean(weights, mask), "correction/clipped_frac": clipped}
    return weights.detach(), {name: float(value) for name, value in metrics.items()}


class FixedKLController:
    """A constant KL coefficient, with the adaptive controller's interface."""

    def __init__(self, beta: float):
        self.value = beta

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019, 2.2: beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon),
    ``n_steps`` the number of samples since the last update."""

    def __init__(self, beta: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be positive")
        self.value = beta
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def token_logprobs(logits_B_T_V: torch.Tensor, ids_B_T: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_B_T_V, dim=-1).gather(-1, ids_B_T.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_B_T_V: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits_B_T_V, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def last_actions(mask_B_T: torch.Tensor) -> torch.Tensor:
    """Each row's last action (an episode's answer turn ends in one)."""
    return mask_B_T.shape[1] - 1 - mask_B_T.flip(-1).argmax(-1)
