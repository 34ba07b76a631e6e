"""Error bars (stages/intervals.py): hand-computed values, and coverage on synthetic eval tables.

The coverage test draws evaluations as the eval stage makes them: prompts of varying
difficulty, k attempts per prompt (so attempts at one prompt are correlated through its
difficulty), two checkpoints on the same prompts with a known true mean difference. A 95%
interval must hold the truth in 93-97% of repetitions; an interval that treated the n x k
attempts as independent would fall short, which the test shows too.
"""

from __future__ import annotations

import math
import random

import pytest

from stages.eval import pass_at_k, per_prompt_scores, standard_errors
from stages.intervals import (
    Z_95,
    clustered_mean_and_se,
    mean_and_se,
    minimum_detectable_difference,
    paired_difference,
    prompt_estimate,
    seed_estimate,
    t_quantile_975,
)


def test_hand_computed_values():
    estimate = prompt_estimate([0.0, 0.5, 1.0, 0.5])
    assert estimate.mean == 0.5
    assert estimate.se == pytest.approx(math.sqrt((0.25 + 0 + 0.25 + 0) / 3 / 4))
    assert estimate.low == pytest.approx(0.5 - Z_95 * estimate.se)
    difference = paired_difference([0.0, 0.5, 1.0], [0.5, 0.5, 1.0])  # differences 0.5, 0, 0
    assert difference.mean == pytest.approx(1 / 6)
    assert difference.se == pytest.approx(math.sqrt(((1 / 3) ** 2 + 2 * (1 / 6) ** 2) / 2 / 3))
    assert difference.within_noise  # 3 prompts know little
    assert not paired_difference([0.0] * 50, [1.0] * 49 + [0.5]).within_noise
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([0.0], [0.0, 1.0])
    assert t_quantile_975(1) == pytest.approx(12.706, abs=2e-3)
    assert t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)
    seeds = seed_estimate([0.30, 0.39, 0.33])
    assert seeds.n == 3 and seeds.high - seeds.mean == pytest.approx(4.303 * seeds.se, rel=1e-3)
    assert math.isinf(seed_estimate([0.3]).high)
    assert minimum_detectable_difference(0.01) == pytest.approx(0.028, abs=1e-3)


def test_a_question_held_twice_is_one_cluster():
    # residuals per question: a +1, b -1; Var = 2/1 * (1 + 1) / 4^2: SE 0.5, not the 0.289 of four independent prompts
    assert clustered_mean_and_se([1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"]) == (0.5, pytest.approx(0.5))
    assert mean_and_se([1.0, 1.0, 0.0, 0.0])[1] == pytest.approx(math.sqrt(1 / 12))
    values = [0.1, 0.7, 0.4, 0.9, 0.3]  # every prompt its own question: the plain SE
    assert clustered_mean_and_se(values, list(range(5)))[1] == pytest.approx(mean_and_se(values)[1])
    assert paired_difference([0.0] * 4, [1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"]).method == \
        "paired z over 4 prompts (2 distinct)"


def test_eval_standard_errors_cluster_attempts_by_prompt():
    # two prompts: one always solved, one never: pass@1 per prompt 1 and 0
    rows = per_prompt_scores([[{"role": "user", "content": "1+1"}], [{"role": "user", "content": "2+2"}]],
                             [{"answer": "2"}, {"answer": "4"}], [True] * 4 + [False] * 4, [1.0] * 4 + [0.0] * 4, 4)
    assert [r["pass_at_1"] for r in rows] == [1.0, 0.0] and rows[0]["prompt"] != rows[1]["prompt"]
    assert [r["index"] for r in rows] == [0, 1]
    se = standard_errors(rows)
    assert se["se/pass_at_1"] == pytest.approx(0.5)  # sd 0.707 over sqrt(2) prompts, not over 8 attempts
    assert se["se/pass_at_4"] == pytest.approx(0.5) and se["se/reward_mean"] == pytest.approx(0.5)


def _eval_table(rng: random.Random, p_correct: list[float], k: int) -> list[float]:
    """Per-prompt pass@1 of one evaluation: k attempts at each prompt's probability."""
    return [pass_at_k(k, sum(rng.random() < p for _ in range(k)), 1) for p in p_correct]


def test_intervals_hold_a_known_difference_in_95_percent_of_repetitions():
    rng = random.Random(67)
    prompts, k, repetitions, true_gain = 200, 8, 2000, 0.05
    paired_hits = single_hits = naive_hits = 0
    for _ in range(repetitions):
        # each repetition draws new prompts: p_a ~ U(0.05, 0.75); p_b = p_a + 0.05 + U(-0.1, 0.1), so
        # E[p_b - p_a] = 0.05 and E[p_a] = 0.4 exactly
        p_a = [rng.uniform(0.05, 0.75) for _ in range(prompts)]
        p_b = [p + true_gain + rng.uniform(-0.1, 0.1) for p in p_a]
        a, b = _eval_table(rng, p_a, k), _eval_table(rng, p_b, k)
        paired_hits += paired_difference(a, b).holds(true_gain)
        single_hits += prompt_estimate(a).holds(0.4)
        # the attempts taken as independent: SE over n x k Bernoulli draws
        mean = sum(a) / prompts
        naive_se = math.sqrt(mean * (1 - mean) / (prompts * k))
        naive_hits += abs(mean - 0.4) <= Z_95 * naive_se
    assert 0.93 <= paired_hits / repetitions <= 0.97
    assert 0.93 <= single_hits / repetitions <= 0.97
    assert naive_hits / repetitions < 0.90  # what clustering by prompt is for
