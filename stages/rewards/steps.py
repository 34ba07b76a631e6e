"""Process rewards: scores of a completion's steps, not only of its end. Design: docs/algorithms.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SplitRule = Literal["lines", "delimiter", "tags"]
# one step of a chain: "a op b = c", integers; spaces allowed around each part
STEP = re.compile(r"\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*")
# the chain a prompt asks for: "12+5+8-3" (the first such expression of the user's message)
CHAIN = re.compile(r"-?\d+(?:\s*[+\-*]\s*\d+)+")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_TAG = re.compile(r"<step>(.*?)</step>", re.DOTALL)


@dataclass(frozen=True)
class StepScore:
    """One scored step: characters [start, end) of the completion, and its score."""

    start: int
    end: int
    score: float


def split_steps(text: str, split: SplitRule = "delimiter", delimiter: str = ",") -> list[tuple[int, int]]:
    """The character spans [start, end) of ``text``'s non-empty steps, white space around them left out."""
    if split == "tags":
        raw = [(m.start(1), m.end(1)) for m in _TAG.finditer(text)]
    else:
        separator = "\n" if split == "lines" else delimiter
        if not separator:
            raise ValueError("split delimiter: the delimiter must be a non-empty string")
        raw, start = [], 0
        while True:
            at = text.find(separator, start)
            raw.append((start, len(text) if at < 0 else at))
            if at < 0:
                break
            start = at + len(separator)
    spans = []
    for start, end in raw:
        piece = text[start:end]
        stripped = piece.strip()
        if stripped:
            left = start + len(piece) - len(piece.lstrip())
            spans.append((left, left + len(stripped)))
    return spans


def chain_terms(prompt_text: str) -> list[tuple[str, int]] | None:
    """The chain a prompt asks for as (op, operand) pairs ("12+5-3" -> [("", 12), ("+", 5), ("-", 3)]), or None."""
    found = CHAIN.search(prompt_text)
    if not found:
        return None
    expression = found[0].replace(" ", "")
    parts = re.findall(r"([+\-*]?)(\d+)", expression)
    terms = [("", int(parts[0][1]) * (-1 if expression.startswith("-") else 1))]
    terms += [(op, int(number)) for op, number in parts[1:]]
    return terms


def check_chain(text: str, terms: list[tuple[str, int]], split: SplitRule = "delimiter",
                delimiter: str = ",") -> list[StepScore]:
    """Each step of ``text`` scored 1.0 when it is the chain's next step done right ("r op b = c", r the
    previous step's written result), else 0.0; a step past the chain's end is wrong."""
    scored, running = [], terms[0][1]
    for i, (start, end) in enumerate(split_steps(text, split, delimiter)):
        match = STEP.fullmatch(text[start:end])
        right = False
        if match and i + 1 < len(terms):
            a, op, b, c = int(match[1]), match[2], int(match[3]), int(match[4])
            expected_op, expected_b = terms[i + 1]
            right = a == running and op == expected_op and b == expected_b and c == _OPS[op](a, b)
        scored.append(StepScore(start, end, 1.0 if right else 0.0))
        if match:
            running = int(match[4])  # the next step continues from what this one wrote, right or wrong
    return scored


def chain_steps(completions: list[str], prompts: list, split: SplitRule = "delimiter", delimiter: str = ",",
                **_):
    """Chain arithmetic's process reward: the share of the chain's steps done right; none "a op b = c": unparsed."""
    from stages.rewards.spec import RewardError, RewardOutput

    scores, parsed, steps = [], [], []
    for text, messages in zip(completions, prompts):
        user = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        terms = chain_terms(user)
        if terms is None or len(terms) < 2:
            raise RewardError(f"chain_steps needs the chain to compute in the prompt (e.g. 12+5+8-3); the user "
                              f"message {user[:120]!r} holds none")
        checked = check_chain(text, terms, split, delimiter)
        steps.append(checked)
        parsed.append(any(STEP.fullmatch(text[s.start:s.end]) for s in checked))
        scores.append(sum(s.score for s in checked) / max(len(terms) - 1, len(checked)))
    return RewardOutput(scores, parsed, steps=steps)


def step_token_indices(tokenizer, token_ids: list[int], ends: list[int]) -> list[int]:
    """For each step end (a character offset), the first token whose decoded prefix reaches it (else the last)."""
    decoded = [len(tokenizer.decode(token_ids[:i + 1], skip_special_tokens=True)) for i in range(len(token_ids))]
    last = max(len(token_ids) - 1, 0)
    return [next((i for i, length in enumerate(decoded) if length >= end), last) for end in ends]


def process_metrics(components, correct: list[bool]) -> dict[str, float]:
    """Per process reward: the share of attempts with every step right, and of ``correct`` attempts with one wrong."""
    metrics = {}
    for component in components:
        if component.steps is None:
            continue
        sound = [bool(steps) and score >= 1.0 and all(s.score >= 1.0 for s in steps)
                 for steps, score in zip(component.steps, component.scores)]
        right = [s for s, c in zip(sound, correct) if c]
        metrics[f"steps/{component.name}/all_right_rate"] = sum(sound) / max(len(sound), 1)
        metrics[f"steps/{component.name}/correct_with_wrong_step_frac"] = (
            sum(not s for s in right) / len(right) if right else 0.0)
    return metrics
