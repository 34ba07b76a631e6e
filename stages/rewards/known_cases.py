"""A reward's known cases (``reward_checks:``, ``posttrain check-reward``), checked against their ranges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ConfigDict, Field

from stages.rewards.scoring import reward_columns, score_component
from stages.rewards.spec import RewardSpec
from stages.spec_model import SpecModel


class KnownCase(SpecModel):
    """What every known case (a reward's ``RewardCase``, an environment's ``EpisodeCase``) says first."""

    model_config = ConfigDict(extra="forbid")

    case: str = Field(description="What the case is: success, failure, malformed or shortcut.",
                      pattern="^(success|failure|malformed|shortcut)$")


class RewardCase(KnownCase):
    """A completion whose reward is known before training: the score range it must get."""

    completion: str = Field(description="The model's reply to score.")
    answer: str | None = Field(None, description="Reference answer handed to the reward.")
    prompt: str | None = Field(None, description="User message the completion answers (optional).")
    min: float | None = Field(None, description="The score must be at least this.")
    max: float | None = Field(None, description="The score must be at most this.")
    parsed: bool | None = Field(None, description="Whether the reward must report the completion as parsed.")
    steps: list[float] | None = Field(
        None, description="A process reward's step scores the completion must get, in order (e.g. [1, 0, 0] for a "
        "right first step then two wrong ones: a shortcut to a right answer shows here, not in the final score).")
    task: dict[str, Any] | None = Field(
        None, description="For a reasoning_gym reward (required there): the entry the completion answers, as in a "
        "reasoning_gym dataset's records: {reasoning_gym: chain_sum, config: {...}, seed: 0, size: 10, index: 3, "
        "answer_format: answer_tags}; config, seed (0) and answer_format (answer_tags) may be left out.")

    def model_post_init(self, __context) -> None:
        if self.min is None and self.max is None and self.parsed is None and self.steps is None:
            raise ValueError("a reward case needs an expectation: min, max, parsed and/or steps")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")


@dataclass
class CaseResult:
    reward: str
    case: RewardCase
    score: float
    parsed: bool
    error: str | None
    steps: list[float] | None = None  # a process reward's step scores

    @property
    def completion_repr(self) -> str:
        return repr(self.case.completion)[:200]

    @property
    def violations(self) -> list[str]:
        problems = []
        if self.error:
            problems.append(f"raised {self.error}")
        if self.case.min is not None and self.score < self.case.min:
            problems.append(f"score {self.score:g} < min {self.case.min:g}")
        if self.case.max is not None and self.score > self.case.max:
            problems.append(f"score {self.score:g} > max {self.case.max:g}")
        if self.case.parsed is not None and self.parsed != self.case.parsed:
            problems.append(f"parsed={self.parsed}, expected {self.case.parsed}")
        if self.case.steps is not None:
            if self.steps is None:
                problems.append("the reward scores no steps (not a process reward), but the case expects step scores")
            elif len(self.steps) != len(self.case.steps) or any(
                    abs(got - want) > 1e-9 for got, want in zip(self.steps, self.case.steps)):
                problems.append(f"step scores {[round(s, 6) for s in self.steps]}, expected {self.case.steps}")
        return problems


def check_reward_cases(name: str, spec: RewardSpec, cases: list[RewardCase],
                       fn: Callable[..., Any] | None = None) -> list[CaseResult]:
    """Score every known case of one reward (``fn``: a judge's bound scorer); a violation: do not train on it."""
    completions = [c.completion for c in cases]
    columns = reward_columns([{"answer": c.answer, "task": c.task} for c in cases],
                             [[{"role": "user", "content": c.prompt or ""}] for c in cases], 1)
    scored = score_component(name, spec, completions, columns, fn)
    errors = dict(scored.errors)
    steps = scored.steps or [None] * len(cases)
    return [CaseResult(name, case, scored.scores[i], scored.parsed[i], errors.get(i),
                       [s.score for s in steps[i]] if steps[i] is not None else None)
            for i, case in enumerate(cases)]
