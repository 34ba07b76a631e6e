"""``math_answer``: is the completion's final answer mathematically equal to the reference?

Both sides go through Hugging Face's ``math-verify``: ``parse`` extracts the answer
(``\\boxed{...}``, ``$...$``, or the last plain expression/number) and turns it into a
SymPy object; ``verify`` compares them numerically and symbolically, so
``\\boxed{\\frac{1}{2}}`` matches the reference ``0.5``. A completion from which no answer
can be parsed ("no idea") is *unparsed*, not wrong.

A bare reference answer (no ``$`` and no ``\\boxed``) is parsed as LaTeX math, i.e. as
``$answer$``: ``(1, 2)`` is then an interval rather than "the last number, 2".

Timeouts: math-verify bounds each parse/compare with ``signal.alarm``, which only works in
the main thread. Called from any other thread (Prefect runs tasks in worker threads)
those timeouts are switched off, so a pathological expression can take as long as SymPy
needs there.
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

from stages.rewards import RewardOutput


def math_answer(completions: list[str], answer: list[str | None], timeout_s: int = 5, **_) -> RewardOutput:
    """1.0 when the parsed answer equals the reference (math-verify), 0.0 when it differs."""
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    scores, parsed = [], []
    for i, (text, reference) in enumerate(zip(completions, answer)):
        gold = parse_reference(reference, timeout)
        if not gold:
            raise ValueError(f"math_answer: the reference answer of completion {i} cannot be parsed: {reference!r}")
        prediction = parse(text, parsing_timeout=timeout)
        parsed.append(bool(prediction))
        ok = bool(prediction) and verify(gold, prediction, timeout_seconds=timeout)
        scores.append(1.0 if ok else 0.0)
    return RewardOutput(scores, parsed)


def parse_reference(reference: str | None, timeout: int | None) -> list:
    """The reference answer as math-verify objects; an empty list when it cannot be parsed."""
    if reference is None or not str(reference).strip():
        return []
    text = str(reference).strip()
    if "$" not in text and "\\boxed" not in text:
        as_math = parse(f"${text}$", parsing_timeout=timeout)
        if as_math:
            return as_math
    return parse(text, parsing_timeout=timeout)
