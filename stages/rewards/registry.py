"""Reward functions: a registry of built-ins, dotted paths to user functions, weighted sums.

A reward function follows TRL's shape, ``fn(completions, **columns) -> scores``, where
``completions`` are the sampled texts and the columns include ``answer`` (reference answers)
and ``prompts`` (the chat messages), plus ``task`` (per completion, the generated entry it
answers, e.g. ``{"reasoning_gym": "chain_sum", ..., "index": 3}``) for data whose records
carry one (reasoning_gym datasets). It may return plain scores, or a ``RewardOutput``
that also says per completion whether it could be parsed at all, so that "could not parse"
is never mistaken for "wrong". An exception inside a reward is counted and reported with
the offending sample, never turned into a silent zero.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Literal

from pydantic import ConfigDict, Field, model_validator

from stages.context import SCORER_PREFIX
from stages.sampling import JUDGE_DEFAULTS, JUDGE_SAMPLING, SamplingSettings
from stages.models.loading import ModelSpec
from stages.spec_model import SpecModel, applies_when

REWARD_MODEL_FN = "reward_model"  # the built-in that scores with a trained reward_model stage
REASONING_GYM_FN = "reasoning_gym"  # the built-in that scores reasoning_gym data with the task's score_answer
JUDGE_FN = "judge"  # the built-in that asks a generative model (or a judge function) to score against a rubric
ENVIRONMENT_FN = "environment"  # the built-in that is an environment's own score of an episode (stages/rollout/environments.py)
BOUND_ONLY_FNS = (REWARD_MODEL_FN, JUDGE_FN, ENVIRONMENT_FN)  # scorers a stage binds in its own process
# built-ins that bound every completion themselves, in a sandboxed process with its own time limit: run in
# the stage's process (where its sandbox is checked), not in the reward worker
SELF_BOUNDED_FNS = ("code_tests",)
RUBRIC_PLACEHOLDERS = ("{prompt}", "{completion}", "{answer}")  # what stages/rewards/judge.py render_rubric fills
# a placeholder: a name in braces, with whatever attribute, index, conversion or format spec follows it
# (`{prompt.__class__}`, `{x[0]}`, `{answer!r}`); JSON such as {"score": 1} does not start with a name
_PLACEHOLDER = re.compile(r"\{[A-Za-z_][^{}]*\}")
JUDGE_SCALE = re.compile(r"(-?\d+)-(-?\d+)")  # a judge's numeric scale, e.g. 1-10


_RM = {"fn": REWARD_MODEL_FN}
_JUDGE = {"fn": JUDGE_FN}
_ONLY_JUDGE = applies_when(_JUDGE, why="it says how a judge judges")


class RewardSpec(SpecModel):
    """A named reward: a built-in or a user function, with its weight and arguments."""

    model_config = ConfigDict(extra="forbid")

    fn: str = Field(description="Built-in name (e.g. exact_answer) or dotted path `pkg.module:function`.")
    weight: float = Field(1.0, description="Weight of this component in the combined reward (0: scored and "
                          "logged, never trained on, e.g. a verifier watched beside a learned reward).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the function.")
    stage: str | None = Field(
        None, json_schema_extra=applies_when(_RM, _JUDGE, why="it names the model that scores"),
        description="fn reward_model: the `reward_model` stage whose checkpoint scores; fn judge: the model that "
        "judges, `base` (the pipeline's model: tiny, path, GGUF or hub) or a stage whose checkpoint it is.")
    normalize: Literal["none", "running", "group"] = Field(
        "none", json_schema_extra=applies_when(_RM, why="it rescales a reward model's scores"),
        description="`running` rescales scores by the running mean and std of every score the stage has seen so "
        "far; `group` subtracts, per prompt, the mean score of that prompt's completions in the batch (a reward "
        "model's scores are only comparable within a prompt).")
    offset: float = Field(0.0, json_schema_extra=applies_when(_RM, why="it shifts a reward model's scores"),
                          description="A fixed offset subtracted from every score.")
    batch_size: int = Field(
        64, ge=1, json_schema_extra=applies_when(
            _RM, _JUDGE, why="the other rewards score in the reward worker, batched by the stage"),
        description="fn reward_model: completions scored per forward pass; fn judge: judge prompts per generate "
        "call (HF generate).")
    model: ModelSpec | None = Field(
        None, json_schema_extra=_ONLY_JUDGE, description="Instead of `stage:`: a judge model of its own, "
        "{gguf: {package, file}} or {gguf: FILE}, {hub: ID} or {path: DIR}, as the pipeline's `model:` takes them.")
    judge_fn: str | None = Field(
        None, json_schema_extra=_ONLY_JUDGE, description="Instead of `stage:`: a dotted path `pkg.mod:fn` to a "
        "function `fn(conversations) -> replies` (one reply text per chat conversation), e.g. a hosted model's "
        "client; cached by its name.")
    rubric: str | None = Field(
        None, json_schema_extra=_ONLY_JUDGE, description="The judge's user message, with `{completion}` and "
        "optionally `{prompt}` (the user turns) and `{answer}` (the reference answer).")
    scale: str = Field(
        "yes_no", json_schema_extra=_ONLY_JUDGE, description="How the reply is read: `yes_no` (a reply starting "
        "with yes scores 1, no 0) or `LOW-HIGH` integers such as `1-10` (the first number n of the reply, scored "
        "(n - LOW) / (HIGH - LOW)). Any other reply is a judge error, counted, never a score.")
    sampling: JUDGE_SAMPLING = Field(
        default_factory=lambda: SamplingSettings(**JUDGE_DEFAULTS), json_schema_extra=_ONLY_JUDGE,
        description="The judge's sampling settings, fixed and part of the reward's hash and of the reply cache's "
        "key: temperature 0 (greedy), max_tokens 8 and attempts 1 (a judge's one reply) unless set.")
    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto", json_schema_extra=_ONLY_JUDGE, description="Generation backend of a model judge (auto: vLLM where "
        "it can serve the judge, else HF).")
    audit_every: int = Field(
        10, ge=1, json_schema_extra=_ONLY_JUDGE, description="A grpo stage audits the judge against its verifiers "
        "every this many reward batches (eval stages audit every evaluation).")
    max_seconds: float = Field(
        60.0, gt=0, le=86400, json_schema_extra=applies_when(
            {"fn": {"not": [*BOUND_ONLY_FNS, *SELF_BOUNDED_FNS]}},
            why="it bounds rewards run in the reward worker; reward_model, judge and environment rewards run in "
                "the stage's own process, and code_tests bounds each completion itself (kwargs: {timeout_s: ...})"),
        description="Wall-clock bound of one call of the reward (on up to 32 completions, "
        "then on one completion when a call fails and its completions are retried one by one), counted from when "
        "the worker holds the reward (not its start or the import of the reward's module), in any thread: "
        "the reward runs in a worker process that is killed past the bound, and a completion that still passes "
        "it is a reward error under the stage's reward_errors policy.")

    @model_validator(mode="after")
    def _reward_model_fields(self):
        if self.fn == REWARD_MODEL_FN:
            if not self.stage:
                raise ValueError("fn reward_model needs `stage:`, the reward_model stage whose checkpoint scores")
            if self.normalize != "none" and self.offset:
                raise ValueError(f"normalize {self.normalize} and offset {self.offset} are alternatives; set one")
        elif self.fn == JUDGE_FN:
            self._check_judge()
        return self

    def identity(self) -> dict:
        """The reward as hashed (stage fingerprints, eval settings): a judge's own fields only on a judge,
        so the hashes of every other reward stay what they were before judges existed."""
        payload = self.model_dump(mode="json")
        del payload["max_seconds"]  # how long a call may take changes no score it returns
        if self.fn != JUDGE_FN:
            for key in ("model", "judge_fn", "rubric", "scale", "sampling", "backend", "audit_every"):
                payload.pop(key)
        return payload

    def _check_judge(self) -> None:
        if sum(x is not None for x in (self.stage, self.model, self.judge_fn)) != 1:
            raise ValueError("fn judge needs one judge: `stage:` (base, or a stage whose checkpoint judges), "
                             "`model:` (a GGUF, hub or path model of its own) or `judge_fn: pkg.mod:fn`")
        if not self.rubric or "{completion}" not in self.rubric:
            raise ValueError("fn judge needs `rubric:`, the judge's message, containing {completion} (and optionally "
                             "{prompt} and {answer})")
        unknown = sorted({m.group(0) for m in _PLACEHOLDER.finditer(self.rubric)} - set(RUBRIC_PLACEHOLDERS))
        if unknown:
            raise ValueError(f"rubric placeholder(s) {', '.join(unknown)} are not filled by posttrain: a rubric may "
                             f"use {', '.join(RUBRIC_PLACEHOLDERS)} only, as they are (no attribute, index or "
                             "format spec); other braces are kept as text when they do not start with a name")
        match = JUDGE_SCALE.fullmatch(self.scale)
        if self.scale != "yes_no" and not (match and int(match[1]) < int(match[2])):
            raise ValueError(f"scale {self.scale!r}: use yes_no or LOW-HIGH integers with LOW < HIGH, e.g. 1-10")


@dataclass
class RewardOutput:
    scores: list[float]
    parsed: list[bool]
    errors: list[tuple[int, str]] = field(default_factory=list)  # (index, why): counted, the score is not one
    # a process reward's scored steps, per completion (stages/rewards/steps.py StepScore: span and score)
    steps: list[list] | None = None


class RewardError(ValueError):
    """A reward that cannot be loaded or that broke its contract."""


# ---------------------------------------------------------------- built-ins

_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # a decimal is one number: "2.5" is not "5"


def extract_integer(text: str, mode: str = "strict") -> str | None:
    """The answer in ``text``: the whole reply as an integer (strict), or its last number,
    decimals read whole (last_number)."""
    text = text.strip()
    if mode == "strict":
        return text if _INTEGER.fullmatch(text) else None
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def exact_answer(completions: list[str], answer: list[str | None], extract: str = "strict", **_) -> RewardOutput:
    """1.0 when the extracted answer equals the reference, 0.0 when wrong; unparsable apart.

    ``extract``: ``strict`` (the reply is exactly an integer) or ``last_number`` (the last
    number in the reply, compared by value: "5.0" is 5, "2.5" is not).
    """
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


def _lazy(path: str) -> Callable[..., Any]:
    """A built-in kept in its own module, imported on first use (math-verify and SymPy import
    slowly, and stages.rewards.code_tests imports this module)."""

    def call(completions, **columns):
        return load_reward_fn(path)(completions, **columns)

    call.__name__ = path.rpartition(":")[2]
    call.lazy_path = path  # the reward worker imports it before its time bound starts
    return call


def reward_model(completions: list[str], **_) -> list[float]:
    """Scores with a reward_model stage's checkpoint; the stage that uses it binds the model
    (stages/reward_model.py ``bind_reward_models``), so an unbound call is a wiring error."""
    raise RewardError("the reward_model reward scores with a trained reward model and is bound by the stage "
                      "that uses it; it cannot be called on its own (e.g. by check-reward before training)")


def judge(completions: list[str], **_) -> list[float]:
    """Scores with a judge model or function; the stage that uses it binds the judge (stages/rewards/judge.py
    ``bind_judges``), so an unbound call is a wiring error."""
    raise RewardError("the judge reward is bound to its judge by the stage (or check-reward) that uses it; it cannot "
                      "be called on its own")


def environment(completions: list[str], **_) -> list[float]:
    """The environment's own score of an episode (stages/rollout/environments.py ``Environment.score``); a stage with
    ``environment:`` binds it to its episodes (stages/rollout/episodes.py ``environment_scorers``)."""
    raise RewardError("the environment reward is an environment's own score of an episode, bound by a stage with "
                      "`environment:` to its episodes; it cannot score a lone completion (e.g. in `reward_checks:`)")


def reward_input_key(reward_name: str) -> str:
    """The ``inputs`` key under which a stage receives the checkpoint of a reward's reward_model stage."""
    return f"{SCORER_PREFIX}{reward_name}"


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "exact_answer": exact_answer,
    REWARD_MODEL_FN: reward_model,
    JUDGE_FN: judge,
    ENVIRONMENT_FN: environment,
    "math_answer": _lazy("stages.rewards.math_answer:math_answer"),
    "code_tests": _lazy("stages.rewards.code_tests:code_tests"),
    REASONING_GYM_FN: _lazy("stages.data.reasoning_gym:reasoning_gym_answer"),
    "regex_format": regex_format,
    "length_penalty": length_penalty,
    "chain_steps": _lazy("stages.rewards.steps:chain_steps"),
}


# ---------------------------------------------------------------- loading


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED_PATH = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*(:{_IDENTIFIER})?")


@functools.lru_cache(maxsize=None)
def load_reward_fn(name: str) -> Callable[..., Any]:
    """Resolve a built-in name or a dotted path (``pkg.mod:fn`` or ``pkg.mod.fn``)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    fn = import_dotted(name, "reward")
    check_signature(name, fn)
    return fn


def import_dotted(name: str, what: str) -> Callable[..., Any]:
    """The function a dotted path names (``pkg.mod:fn`` or ``pkg.mod.fn``): never a file, never code."""
    looks_like_file = "/" in name or "\\" in name or name.endswith(".py")
    if looks_like_file or not _DOTTED_PATH.fullmatch(name):  # never a file path, a relative import, code
        raise RewardError(
            f"{what} {name!r} is not a dotted path: {what} code is imported only from a module on the Python "
            "path, named like `my_pkg.rewards:score`"
            + ("; a file path is never imported, make the file an importable module instead" if looks_like_file else "")
        )
    if ":" in name:
        module_name, _, attr = name.partition(":")
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
    else:
        raise RewardError(
            f"unknown {what} {name!r}: not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
            "and not a dotted path like `my_pkg.rewards:score`"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise RewardError(f"{what} {name!r}: cannot import module {module_name!r} "
                          f"({type(error).__name__}: {error})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"{what} {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(f"{what} {name!r} is not callable")
    return fn


def check_signature(name: str, fn: Any) -> None:
    """A reward takes completions first and accepts the data columns as keywords."""
    if not callable(fn):
        raise RewardError(f"reward {name!r} is not callable")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise RewardError(f"reward {name!r} must take the completions as its first argument: fn(completions, **columns)")
    required_extra = [p.name for p in positional[1:] if p.default is p.empty]
    unknown = [n for n in required_extra if n not in ("answer", "prompts", "task")]
    if unknown or not (takes_kwargs or "answer" in [p.name for p in params]):
        raise RewardError(
            f"reward {name!r} has signature {inspect.signature(fn)}; expected fn(completions, **columns) "
            "(columns: answer, prompts, task)"
        )


# ---------------------------------------------------------------- scoring


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
    """A process reward's steps: one list per completion of StepScores (stages/rewards/steps.py: spans within
    the completion, in order, not overlapping; finite scores), else a RewardError saying what is wrong."""
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

    ``fn`` is a bound scorer (a loaded reward model, a judge, an environment's score), called in this
    process, as is ``code_tests`` (each completion in its own sandboxed process, under its own time limit).
    Every other reward runs in the stage's reward worker (stages/rewards/worker.py) under the wall-clock
    bound ``spec.max_seconds`` per call, in chunks of ``CHUNK`` completions."""
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
    """``spec.fn`` on a chunk in the reward worker, bounded by ``spec.max_seconds``: a broken reward
    (a ``RewardError`` in the worker) raises ``RewardError`` here; any other exception, and a call
    past its bound, raises an exception whose message names what happened."""
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
    """A StepScore (stages/rewards/steps.py, which imports this module: told by its fields)."""
    return all(isinstance(getattr(step, name, None), int) for name in ("start", "end")) and \
        isinstance(getattr(step, "score", None), (int, float))


def _process_steps(steps: list) -> list[list] | None:
    """Per completion its steps ([] where the reward raised on it), or None: no completion has steps."""
    return [s or [] for s in steps] if any(s is not None for s in steps) else None


def reward_columns(records: list[dict], prompts: list, attempts: int) -> dict[str, list]:
    """The columns a reward reads beside ``attempts`` completions of each record, prompt-major: the
    reference ``answer``, the ``prompts`` (chat messages) and, when any record answers a generated task
    (reasoning_gym data), ``task``; data without one hands rewards exactly ``answer`` and ``prompts``.
    Every stage, and ``check-reward``, builds its columns here."""
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
    """Every component on one batch; ``fns``: bound scorers by reward name (reward models)."""
    fns = fns or {}
    components = [score_component(name, spec, completions, columns, fns.get(name)) for name, spec in specs.items()]
    total = [sum(c.weight * c.scores[i] for c in components) for i in range(len(completions))]
    return ScoredBatch(components, total)


# ---------------------------------------------------------------- known cases (check-reward)


class RewardCase(SpecModel):
    """A completion whose reward is known before training: the score range it must get."""

    model_config = ConfigDict(extra="forbid")

    case: str = Field(description="What the case is: success, failure, malformed or shortcut.",
                      pattern="^(success|failure|malformed|shortcut)$")
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
    """Score every known case of one reward; a result with violations means do not train on it.
    ``fn``: the bound scorer of a judge."""
    completions = [c.completion for c in cases]
    columns = reward_columns([{"answer": c.answer, "task": c.task} for c in cases],
                             [[{"role": "user", "content": c.prompt or ""}] for c in cases], 1)
    scored = score_component(name, spec, completions, columns, fn)
    errors = dict(scored.errors)
    steps = scored.steps or [None] * len(cases)
    return [CaseResult(name, case, scored.scores[i], scored.parsed[i], errors.get(i),
                       [s.score for s in steps[i]] if steps[i] is not None else None)
            for i, case in enumerate(cases)]
