"""The built-in rewards with no machinery of their own, and the names a stage binds to a scorer (``reward_model``,
``judge``, ``environment``), which refuse to score unbound."""

from __future__ import annotations

import re
from fractions import Fraction

from stages.rewards.spec import RewardError, RewardOutput

_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # a decimal is one number: "2.5" is not "5"


def extract_integer(text: str, mode: str = "strict") -> str | None:
    """The answer in ``text``: the whole reply as an integer (strict), or its last number, read whole (last_number)."""
    text = text.strip()
    if mode == "strict":
        return text if _INTEGER.fullmatch(text) else None
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def exact_answer(completions: list[str], answer: list[str | None], extract: str = "strict", **_) -> RewardOutput:
    """1.0 when the extracted answer equals the reference by value, 0.0 when wrong; unparsable apart."""
    if extract not in ("strict", "last_number"):
        raise RewardError(f"exact_answer: extract must be 'strict' or 'last_number', got {extract!r}")
    scores, parsed = [], []
    for text, reference in zip(completions, answer):
        value = extract_integer(text, extract)
        parsed.append(value is not None)
        ok = value is not None and reference is not None and Fraction(value) == Fraction(str(reference).strip())
        scores.append(1.0 if ok else 0.0)
    return RewardOutput(scores, parsed)


def regex_format(completions: list[str], pattern: str = r"-?\d+", **_) -> RewardOutput:
    """1.0 when the whole completion matches ``pattern``, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    scores = [1.0 if compiled.fullmatch(text.strip()) else 0.0 for text in completions]
    return RewardOutput(scores, [True] * len(completions))


def length_penalty(completions: list[str], target_chars: int = 0, per_char: float = 0.01, **_) -> list[float]:
    """Minus ``per_char`` for every character beyond ``target_chars``."""
    return [-per_char * max(0, len(text) - target_chars) for text in completions]


def reward_model(completions: list[str], **_) -> list[float]:
    """Scores with a reward_model stage's checkpoint, bound by the stage: an unbound call is a wiring error."""
    raise RewardError("the reward_model reward scores with a trained reward model and is bound by the stage "
                      "that uses it; it cannot be called on its own (e.g. by check-reward before training)")


def judge(completions: list[str], **_) -> list[float]:
    """Scores with a judge, bound by the stage: an unbound call is a wiring error."""
    raise RewardError("the judge reward is bound to its judge by the stage (or check-reward) that uses it; it cannot "
                      "be called on its own")


def environment(completions: list[str], **_) -> list[float]:
    """An environment's own score of an episode, bound by a stage with ``environment:``."""
    raise RewardError("the environment reward is an environment's own score of an episode, bound by a stage with "
                      "`environment:` to its episodes; it cannot score a lone completion (e.g. in `reward_checks:`)")
