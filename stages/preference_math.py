"""The maths of preference learning, as small functions checked against hand computations (docs/algorithms.md)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def bradley_terry_loss(rewards_chosen_B: torch.Tensor, rewards_rejected_B: torch.Tensor,
                       margin_B: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of -log sigmoid(r_c - r_r - margin) over B pairs."""
    delta_B = rewards_chosen_B - rewards_rejected_B
    if margin_B is not None:
        delta_B = delta_B - margin_B
    return -F.logsigmoid(delta_B).mean()


def pairwise_accuracy(rewards_chosen_B: torch.Tensor, rewards_rejected_B: torch.Tensor) -> float:
    """Share of pairs whose chosen reply scores strictly higher (a tie counts as wrong)."""
    return float((rewards_chosen_B > rewards_rejected_B).float().mean())


def dpo_implicit_rewards(policy_logps_B: torch.Tensor, reference_logps_B: torch.Tensor, beta: float) -> torch.Tensor:
    """beta * (log pi(y|x) - log pi_ref(y|x)) per sequence."""
    return beta * (policy_logps_B - reference_logps_B)


def dpo_loss(policy_chosen_logps_B: torch.Tensor, policy_rejected_logps_B: torch.Tensor,
             reference_chosen_logps_B: torch.Tensor, reference_rejected_logps_B: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, chosen rewards B, rejected rewards B) of the sigmoid DPO loss."""
    chosen_B = dpo_implicit_rewards(policy_chosen_logps_B, reference_chosen_logps_B, beta)
    rejected_B = dpo_implicit_rewards(policy_rejected_logps_B, reference_rejected_logps_B, beta)
    return -F.logsigmoid(chosen_B - rejected_B).mean(), chosen_B, rejected_B


def best_of_n(scores_P_K: list[list[float]]) -> list[int]:
    """Per prompt, the index of the highest-scoring attempt (the first one on ties)."""
    return [max(range(len(row)), key=lambda k: (row[k], -k)) for row in scores_P_K]


def best_of_n_accuracy(scores_P_K: list[list[float]], correct_P_K: list[list[bool]]) -> float:
    """Share of prompts whose best-of-N pick (by ``scores``) is correct."""
    picks = best_of_n(scores_P_K)
    return sum(bool(correct_P_K[p][k]) for p, k in enumerate(picks)) / len(picks)


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson correlation; None when either side has no variance (it is undefined there)."""
    n = len(xs)
    if n < 2 or n != len(ys):
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0 or syy <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


class RunningMeanStd:
    """Mean and standard deviation of every score seen so far (Chan et al.'s parallel update)."""

    def __init__(self, epsilon: float = 1e-6):
        self.count, self.mean, self.m2, self.epsilon = 0, 0.0, 0.0, epsilon

    def update(self, values: list[float]) -> None:
        if not values:
            return
        n = len(values)
        batch_mean = sum(values) / n
        batch_m2 = sum((v - batch_mean) ** 2 for v in values)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta ** 2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def normalise(self, values: list[float]) -> list[float]:
        """Update with ``values``, then return them as (value - mean) / std."""
        self.update(values)
        scale = max(self.std, self.epsilon)
        return [(v - self.mean) / scale for v in values]


def best_worst_pairs(scores_P_K: list[list[float]]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Online DPO's ``([(prompt, chosen, rejected)], [tied prompts])`` from P x K scores: chosen the highest (first
    on ties), rejected the lowest (last on ties); a prompt whose samples all score the same is skipped."""
    pairs, ties = [], []
    for p, row in enumerate(scores_P_K):
        if len(row) < 2:
            raise ValueError(f"prompt {p} has {len(row)} scored sample(s); a pair needs at least 2")
        best = max(range(len(row)), key=lambda k: (row[k], -k))
        worst = min(range(len(row)), key=lambda k: (row[k], -k))
        if row[best] == row[worst]:
            ties.append(p)
        else:
            pairs.append((p, best, worst))
    return pairs, ties
