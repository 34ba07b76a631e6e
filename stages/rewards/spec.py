"""What a pipeline declares of a reward (``RewardSpec``) and what a reward function returns (docs/algorithms.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from stages.context import SCORER_PREFIX
from stages.models.loading import ModelSpec
from stages.sampling import JUDGE_DEFAULTS, JUDGE_SAMPLING, SamplingSettings
from stages.spec_model import SpecModel, applies_when

REWARD_MODEL_FN = "reward_model"  # the built-in that scores with a trained reward_model stage
REASONING_GYM_FN = "reasoning_gym"  # the built-in that scores reasoning_gym data with the task's score_answer
JUDGE_FN = "judge"  # the built-in that asks a generative model (or a judge function) to score against a rubric
ENVIRONMENT_FN = "environment"  # the built-in that is an environment's own score of an episode
BOUND_ONLY_FNS = (REWARD_MODEL_FN, JUDGE_FN, ENVIRONMENT_FN)  # scorers a stage binds in its own process
# built-ins bounding each completion themselves (a sandbox, its own time limit): run in the stage's process
SELF_BOUNDED_FNS = ("code_tests",)
RUBRIC_PLACEHOLDERS = ("{prompt}", "{completion}", "{answer}")  # what stages/rewards/judge.py render_rubric fills
# a rubric field to fill: a name in braces and what follows (`{prompt.__class__}`, `{x[0]}`, `{answer!r}`); JSON is none
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
        """The reward as hashed: a judge's own fields only on a judge, so other rewards' hashes stay valid."""
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
    steps: list[list] | None = None  # a process reward's StepScores, per completion


class RewardError(ValueError):
    """A reward that cannot be loaded or that broke its contract."""


def reward_input_key(reward_name: str) -> str:
    """The ``inputs`` key under which a stage receives the checkpoint of a reward's reward_model stage."""
    return f"{SCORER_PREFIX}{reward_name}"
