"""The one scorer: how every stage turns sampled completions into rewards. Design: docs/algorithms.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from stages.rewards.registry import load_reward_fn
from stages.rewards.spec import BOUND_ONLY_FNS, SELF_BOUNDED_FNS, RewardError, RewardOutput, RewardSpec


@dataclass
class ComponentScores:
    name: str
    weight: float
    scores: list[float]
    parsed: list[bool]
    errors: list[tuple[int, str]] = field(default_factory=list)
    steps: list[list] | None = None  # a process reward's StepScores per completion ([] where it raised)


@dataclass
class ScoredBatch:
    components: list[ComponentScores]
    total: list[float]

    @property
    def error_count(self) -> int:
        return sum(len(c.errors) for c in self.components)


def _normalise_output(name: str, result: Any, expected: int) -> RewardOutput:
    if isinstance(result, RewardOutput):
        output = result
    elif isinstance(result, tuple) and len(result) == 2:
        output = RewardOutput(list(result[0]), [bool(p) for p in result[1]])
    else:
        scores = list(result)
        output = RewardOutput(scores, [True] * len(scores))
    if len(output.scores) != expected or len(output.parsed) != expected:
        raise RewardError(f"reward {name!r} returned {len(output.scores)} scores for {expected} completions")
    scores = []
    for value in output.scores:
        value = float(value)
        if math.isnan(value):
            raise RewardError(f"reward {name!r} returned NaN")
        scores.append(value)
    bad = [index for index, _ in output.errors if not 0 <= index < expected]
    if bad:
        raise RewardError(f"reward {name!r} reported errors at indices {bad} of {expected} completions")
    return RewardOutput(scores, output.parsed, list(output.errors), _checked_steps(name, output.steps, expected))


def _checked_steps(name: str, steps, expected: int) -> list[list] | None:
    """A process reward's steps (StepScores in order, not overlapping, finite), else a RewardError saying why."""
    if steps is None:
        return None
    steps = list(steps)
    if len(steps) != expected:
        raise RewardError(f"reward {name!r} returned steps for {len(steps)} completions, not {expected}")
    for index, scored in enumerate(steps):
        end = 0
        for step in scored:
            if not _is_step(step) or not (end <= step.start <= step.end) or not math.isfinite(step.score):
                raise RewardError(f"reward {name!r}: completion {index}'s steps must be StepScore(start, end, score) "
                                  f"in order, not overlapping, with finite scores; got {step!r}")
            end = step.end
    return [list(scored) for scored in steps]


def score_component(name: str, spec: RewardSpec, completions: list[str], columns: dict[str, list],
                    fn: Callable[..., Any] | None = None) -> ComponentScores:
    """Score a batch; if the function raises (or passes its time bound), isolate the failing samples one by one.
    A bound ``fn`` and ``code_tests`` run here; other rewards in the worker, ``spec.max_seconds`` per chunk."""
    if fn is None and spec.fn not in BOUND_ONLY_FNS + SELF_BOUNDED_FNS:
        from stages.rewards.worker import CHUNK

        call, chunk = _bounded_call(spec), CHUNK
    else:
        fn = fn or load_reward_fn(spec.fn)

        def call(texts, cols):
            return fn(texts, **cols, **spec.kwargs)

        chunk = max(len(completions), 1)
    scores, parsed, errors, steps = [], [], [], []
    for start in range(0, len(completions), chunk):
        part = slice(start, start + chunk)
        output = _score_chunk(name, call, completions[part], {key: values[part] for key, values in columns.items()})
        scores += output.scores
        parsed += output.parsed
        errors += [(start + index, message) for index, message in output.errors]
        steps += output.steps if output.steps is not None else [None] * len(output.scores)
    return ComponentScores(name, spec.weight, scores, parsed, errors, _process_steps(steps))


def _bounded_call(spec: RewardSpec) -> Callable[[list[str], dict[str, list]], Any]:
    """``spec.fn`` on a chunk in the reward worker within ``spec.max_seconds``; a RewardError there is one here."""
    from stages.rewards.worker import RewardRaised, RewardTimeout, worker

    def call(texts, cols):
        try:
            return worker().call(spec.fn, texts, cols, spec.kwargs, spec.max_seconds)
        except RewardRaised as error:
            if error.contract:
                raise RewardError(str(error)) from None
            raise RewardFailed(f"{error.kind}: {error}") from None
        except RewardTimeout:
            raise RewardFailed(f"took longer than {spec.max_seconds:g} s (the reward's max_seconds) and was "
                               "stopped") from None

    return call


class RewardFailed(Exception):
    """A reward's exception or time-out in the worker, described as the stage reports it."""


def _describe(error: Exception) -> str:
    return str(error) if isinstance(error, RewardFailed) else f"{type(error).__name__}: {error}"


def _score_chunk(name: str, call, completions: list[str], columns: dict[str, list]) -> RewardOutput:
    try:
        return _normalise_output(name, call(completions, columns), len(completions))
    except RewardError:
        raise
    except Exception as error:
        if len(completions) == 1:  # nothing to isolate: this completion is the culprit
            return RewardOutput([0.0], [False], [(0, _describe(error))])
    scores, parsed, errors, steps = [], [], [], []
    for i, text in enumerate(completions):
        single = {key: [values[i]] for key, values in columns.items()}
        try:
            output = _normalise_output(name, call([text], single), 1)
            scores.append(output.scores[0])
            parsed.append(output.parsed[0])
            errors += [(i, message) for _, message in output.errors]
            steps.append(output.steps[0] if output.steps is not None else None)
        except RewardError:
            raise
        except Exception as error:  # counted and reported, scored 0 and marked unparsed
            errors.append((i, _describe(error)))
            scores.append(0.0)
            parsed.append(False)
            steps.append(None)
    return RewardOutput(scores, parsed, errors, _process_steps(steps))


def _is_step(step) -> bool:
    return all(isinstance(getattr(step, name, None), int) for name in ("start", "end")) and \
        isinstance(getattr(step, "score", None), (int, float))


def _process_steps(steps: list) -> list[list] | None:
    """Per completion its steps ([] where the reward raised on it), or None: no completion has steps."""
    return [s or [] for s in steps] if any(s is not None for s in steps) else None


def reward_columns(records: list[dict], prompts: list, attempts: int) -> dict[str, list]:
    """The columns ``answer``, ``prompts`` (and ``task``) beside ``attempts`` completions of each record, prompt-major."""
    columns: dict[str, list] = {
        "answer": [r.get("answer") for r in records for _ in range(attempts)],
        "prompts": [p for p in prompts for _ in range(attempts)],
    }
    tasks = [r.get("task") for r in records for _ in range(attempts)]
    if any(t is not None for t in tasks):
        columns["task"] = tasks
    return columns


def score_completions(
    specs: dict[str, RewardSpec], completions: list[str], columns: dict[str, list],
    fns: dict[str, Callable[..., Any]] | None = None,
) -> ScoredBatch:
    """Every component on one batch; ``fns``: bound scorers by reward name."""
    fns = fns or {}
    components = [score_component(name, spec, completions, columns, fns.get(name)) for name, spec in specs.items()]
    total = [sum(c.weight * c.scores[i] for c in components) for i in range(len(completions))]
    return ScoredBatch(components, total)


@dataclass
class RewardErrorPolicy:
    """A stage's ``reward_errors`` policy over every reward exception it meets."""

    policy: str  # "fail" or "score"
    limit: int  # max_reward_errors
    count: int = 0
    shown: int = 0  # errors written to the stage's log so far (the first SHOWN_ERRORS)

    @classmethod
    def of(cls, config) -> "RewardErrorPolicy":
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
        """The stage's first SHOWN_ERRORS errors go to its log with their completion; the rest are counted."""
        for name, message, completion in errors:
            self.shown += 1
            if self.shown <= SHOWN_ERRORS:
                print(f"reward error (scored 0, reward_errors: {self.policy}): reward {name!r} {message} on "
                      f"completion {completion[:300]!r}", flush=True)
            elif self.shown == SHOWN_ERRORS + 1:
                print(f"reward errors after the first {SHOWN_ERRORS} are counted only (reward/errors)", flush=True)


SHOWN_ERRORS = 20


class Scorer:
    """A stage's rewards over batches, under its ``reward_errors`` policy (``auditor``: a judge's, fed each batch)."""

    def __init__(self, specs: dict[str, RewardSpec], policy: RewardErrorPolicy,
                 fns: dict[str, Callable[..., Any]] | None = None, auditor=None):
        self.specs, self.policy, self.fns, self.auditor = specs, policy, dict(fns or {}), auditor

    @property
    def errors(self) -> int:
        return self.policy.count

    def score(self, completions: list[str], columns: dict[str, list],
              fns: dict[str, Callable[..., Any]] | None = None) -> ScoredBatch:
        """Every reward on one batch (the weighted total beside each component); ``fns`` override bound scorers."""
        scored = score_completions(self.specs, completions, columns, {**self.fns, **(fns or {})})
        self.policy.count_reward_errors(scored.components, completions)
        if self.auditor is not None:
            self.auditor.record_batch(scored, columns["prompts"], completions)
        return scored

    def score_one(self, name: str, completions: list[str], columns: dict[str, list],
                  fn: Callable[..., Any] | None = None) -> ComponentScores:
        """One reward on one batch (TRL calls each reward function on its own); ``fn`` overrides its scorer."""
        component = score_component(name, self.specs[name], completions, columns, fn or self.fns.get(name))
        self.policy.count_reward_errors([component], completions)
        if self.auditor is not None:
            self.auditor.record(component, columns["prompts"], completions)
        return component
