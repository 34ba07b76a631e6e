"""The one scorer: how every stage turns sampled completions into rewards.

Eval, GRPO (each TRL reward function), PPO, online DPO and the difficulty filter all score
through here, so three things are written once:

- the columns a reward function reads beside the completions: ``reward_columns`` of
  stages/rewards/registry.py, where the reward contract is (every caller builds them through it).
- ``RewardErrorPolicy``: a stage's ``reward_errors`` / ``max_reward_errors``. Every
  exception a reward raised (stages/rewards/registry.py isolates it to the completion that caused
  it, and a call past its time bound is one too) is counted across the whole stage; under
  ``fail`` the stage stops once the count passes the limit, naming the reward, its error
  and the completion; under ``score`` the completion scores 0 and the count is logged. An error
  carried on (under ``score``, or within the limit) is written to the stage's log with its
  completion (the first 20): a judge's unreadable reply is such an error, the reply quoted.
- ``Scorer``: scores a batch with the stage's rewards and bound scorers (reward models,
  judges, an environment's own score), applies the policy, and hands judged batches to
  the judge auditor (stages/rewards/judge.py) so judges are audited against verifiers wherever
  they score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from stages.rewards.registry import ComponentScores, RewardSpec, ScoredBatch, score_component, score_completions


@dataclass
class RewardErrorPolicy:
    """A stage's ``reward_errors`` policy over every reward exception it meets."""

    policy: str  # "fail" or "score"
    limit: int  # max_reward_errors
    count: int = 0
    shown: int = 0  # errors written to the stage's log so far (the first SHOWN_ERRORS)

    @classmethod
    def of(cls, config) -> "RewardErrorPolicy":
        """The policy a stage config declares (``reward_errors``, ``max_reward_errors``)."""
        return cls(config.reward_errors, config.max_reward_errors)

    def count_reward_errors(self, components: Iterable[ComponentScores], completions: list[str]) -> None:
        """Add the components' errors to the stage's count; under ``fail``, raise once it passes the limit."""
        components = list(components)
        new = sum(len(c.errors) for c in components)
        self.count += new
        if not new or self.policy != "fail" or self.count <= self.limit:
            self._show([(c.name, message, completions[i]) for c in components for i, message in c.errors])
            return
        component = next(c for c in components if c.errors)
        index, message = component.errors[0]
        raise RuntimeError(
            f"reward {component.name!r} raised {message} on completion {completions[index]!r} "
            f"({self.count} reward errors so far, max_reward_errors is {self.limit}); fix the reward, or set "
            "reward_errors: score to score such completions 0 and go on")


    def state(self) -> dict:
        """The counts a resumed stage carries on from (stages/training/resume.py)."""
        return {"count": self.count, "shown": self.shown}

    def restore(self, saved: dict) -> None:
        self.count, self.shown = saved["count"], saved["shown"]

    def _show(self, errors: list[tuple[str, str, str]]) -> None:
        """Each error counted and carried on (a judge's unreadable reply, a reward's exception) goes to the
        stage's log with its completion, the first SHOWN_ERRORS of the stage; the rest are counted only."""
        for name, message, completion in errors:
            self.shown += 1
            if self.shown <= SHOWN_ERRORS:
                print(f"reward error (scored 0, reward_errors: {self.policy}): reward {name!r} {message} on "
                      f"completion {completion[:300]!r}", flush=True)
            elif self.shown == SHOWN_ERRORS + 1:
                print(f"reward errors after the first {SHOWN_ERRORS} are counted only (reward/errors)", flush=True)


SHOWN_ERRORS = 20


class Scorer:
    """A stage's rewards over batches of completions, under its ``reward_errors`` policy.

    ``fns``: bound scorers by reward name (reward models, judges, environment scores), used instead
    of the named function; ``auditor``: stages/rewards/judge.py's ``BatchAuditor`` (RL stages), fed every
    scored batch."""

    def __init__(self, specs: dict[str, RewardSpec], policy: RewardErrorPolicy,
                 fns: dict[str, Callable[..., Any]] | None = None, auditor=None):
        self.specs, self.policy, self.fns, self.auditor = specs, policy, dict(fns or {}), auditor

    @property
    def errors(self) -> int:
        return self.policy.count

    def score(self, completions: list[str], columns: dict[str, list],
              fns: dict[str, Callable[..., Any]] | None = None) -> ScoredBatch:
        """Every reward on one batch (the weighted total beside each component); ``fns`` override the
        bound scorers for this batch (an environment's score of this batch's episodes)."""
        scored = score_completions(self.specs, completions, columns, {**self.fns, **(fns or {})})
        self.policy.count_reward_errors(scored.components, completions)
        if self.auditor is not None:
            self.auditor.record_batch(scored, columns["prompts"], completions)
        return scored

    def score_one(self, name: str, completions: list[str], columns: dict[str, list],
                  fn: Callable[..., Any] | None = None) -> ComponentScores:
        """One reward on one batch (TRL calls each reward function on its own); ``fn`` overrides the
        bound scorer for this call (an environment's score of this batch's episodes)."""
        component = score_component(name, self.specs[name], completions, columns, fn or self.fns.get(name))
        self.policy.count_reward_errors([component], completions)
        if self.auditor is not None:
            self.auditor.record(component, columns["prompts"], completions)
        return component
