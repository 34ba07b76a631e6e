"""``math_answer``: is the completion's final answer mathematically equal to the reference? (docs/algorithms.md)"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

from stages.rewards.spec import RewardOutput


def math_answer(completions: list[str], answer: list[str | None], timeout_s: int = 5, **_) -> RewardOutput:
    """1.0 when the parsed answer equals the reference (math-verify), 0.0 when it differs."""
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    scores, parsed = [], []
    for i, (text, reference) in enumerate(zip(completions, answer)):
        gold = parse_reference(reference, timeout)
        if not gold:
            raise ValueError(f"math_answer: the reference answer of completion {i} cannot be parsed: {reference!r}")
        prediction = parse_answer(text, timeout)
        parsed.append(bool(prediction))
        ok = bool(prediction) and verify(gold, prediction, timeout_seconds=timeout)
        scores.append(1.0 if ok else 0.0)
    return RewardOutput(scores, parsed)


_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")


def is_bare_expression(text: str) -> bool:
    """One line of math and nothing else: ``x^2+1``, ``\\sqrt{2}``, ``2x``, ``(1, 2)``; not prose."""
    return ("$" not in text and "\\boxed" not in text and "\n" not in text
            and not _WORD.search(_LATEX_COMMAND.sub("", text)))


def parse_answer(text: str | None, timeout: int | None) -> list:
    """Math-verify objects of a reply or reference ([] if none): a bare expression as ``$text$``, else extracted."""
    if text is None or not str(text).strip():
        return []
    text = str(text).strip()
    if is_bare_expression(text):
        as_math = parse(f"${text}$", parsing_timeout=timeout)
        if as_math:
            return as_math
    return parse(text, parsing_timeout=timeout)


def parse_reference(reference: str | None, timeout: int | None) -> list:
    """The reference answer as math-verify objects, read like a reply; an empty list when it cannot be parsed."""
    gold = parse_answer(reference, timeout)
    if not gold and reference is not None and str(reference).strip() and "$" not in str(reference):
        gold = parse(f"${str(reference).strip()}$", parsing_timeout=timeout)  # a trusted answer, e.g. a word
    return gold
