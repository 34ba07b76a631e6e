"""pass@k and the eval summary, against direct computations."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from stages.eval import pass_at_k, pass_k_values
from stages.rewards.builtin_rewards import exact_answer
from stages.rewards.scoring import score_completions
from stages.rewards.spec import RewardSpec


def pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(samples[i] for i in subset) for subset in subsets)
    return float(Fraction(hits, len(subsets)))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_by_enumeration(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_success_rate():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0


def test_k_beyond_n_is_an_error():
    with pytest.raises(ValueError, match="k \\(9\\) must be <= n \\(8\\)"):
        pass_at_k(8, 1, 9)


def test_reported_ks():
    assert pass_k_values(1) == [1]
    assert pass_k_values(8) == [1, 2, 4, 8]
    assert pass_k_values(10) == [1, 2, 4, 8, 10]


def test_exact_answer_keeps_unparsable_apart_from_wrong():
    out = exact_answer(["7", "8", "seven", "", " 7 "], answer=["7"] * 5)
    assert out.scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert out.parsed == [True, True, False, False, True]
    lenient = exact_answer(["the answer is 7"], answer=["7"], extract="last_number")
    assert lenient.scores == [1.0] and lenient.parsed == [True]


def flaky_reward(completions, answer, **_):
    return [1.0 / (len(text) - 3) for text in completions]  # raises on 3-character completions


def wrong_length_reward(completions, **_):
    return [1.0]


def test_reward_exceptions_are_counted_with_the_sample_not_silenced():
    specs = {"flaky": RewardSpec(fn="test_eval_math:flaky_reward")}
    scored = score_completions(specs, ["abcd", "abc", "abcde"], {"answer": ["1", "2", "3"]})
    component = scored.components[0]
    assert component.scores == [1.0, 0.0, 0.5]
    assert component.parsed == [True, False, True]
    assert scored.error_count == 1 and component.errors[0][0] == 1
    assert "ZeroDivisionError" in component.errors[0][1]


def test_reward_returning_wrong_count_is_an_error():
    from stages.rewards.spec import RewardError

    with pytest.raises(RewardError, match="returned 1 scores for 2 completions"):
        score_completions({"w": RewardSpec(fn="test_eval_math:wrong_length_reward")}, ["a", "b"], {"answer": ["1", "2"]})


def test_weighted_combination():
    specs = {"correct": RewardSpec(fn="exact_answer"), "short": RewardSpec(fn="length_penalty", weight=2.0,
                                                                           kwargs={"target_chars": 1, "per_char": 0.1})}
    scored = score_completions(specs, ["12", "3"], {"answer": ["12", "4"]})
    assert scored.total == pytest.approx([1.0 - 0.2, 0.0])


def test_exact_answer_last_number_reads_whole_decimals():
    """"2.5" is not 5: the last number is read whole, not its last run of digits."""
    out = exact_answer(["2.5", "it is 12.5", "so 5.", "5.0", "-5", "3 then 5"], answer=["5", "5", "5", "5", "5", "5"],
                       extract="last_number")
    assert out.scores == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert out.parsed == [True] * 6
