"""What each reward function accepts and reads, so a pipeline is checked before anything runs (docs/algorithms.md)."""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator

from stages.rewards.sandbox import ISOLATION_MODES
from stages.spec_model import SpecModel

COLUMNS = ("answer", "prompts", "task")  # what a reward receives from the data, not from kwargs


class ExactAnswerKwargs(SpecModel):
    extract: Literal["strict", "last_number"] = Field(
        "strict", description="`strict`: the whole reply is the integer; `last_number`: its last number, "
        "decimals read whole (\"2.5\" is not 5).")


class RegexFormatKwargs(SpecModel):
    pattern: str = Field(r"-?\d+", description="Regular expression the whole stripped completion must match.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str):
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"not a valid regular expression ({error})") from None
        return pattern


class LengthPenaltyKwargs(SpecModel):
    target_chars: int = Field(0, ge=0, le=1_000_000, description="Characters allowed before the penalty starts.")
    per_char: float = Field(0.01, ge=0, le=1.0, description="Penalty per character beyond target_chars.")


class MathAnswerKwargs(SpecModel):
    timeout_s: int = Field(5, ge=1, le=600, description="Seconds math-verify may spend per parse or comparison.")


class CodeTestsKwargs(SpecModel):
    tests: str | None = Field(None, min_length=1, description="Test asserts for every completion (default: the "
                              "record's `answer`).")
    timeout_s: float = Field(5.0, gt=0, le=600, description="Wall-clock seconds per completion.")
    memory_mb: int = Field(512, ge=16, le=65536, description="Address-space limit of the sandboxed process.")
    workers: int = Field(4, ge=1, le=64, description="Completions run at once.")
    sandbox: Literal[ISOLATION_MODES] = Field(  # type: ignore[valid-type]
        ISOLATION_MODES[0], description="`bubblewrap`, or `rlimits-only`, the explicit opt-out (see README, Security).")


class NoKwargs(SpecModel):
    pass


class ReasoningGymKwargs(SpecModel):
    binary: bool = Field(False, description="1.0 only at full credit, else 0.0 (reasoning-gym's partial credit "
                         "pays replies that merely contain the answer).")


KWARGS_SCHEMAS: dict[str, type[SpecModel]] = {
    "exact_answer": ExactAnswerKwargs,
    "regex_format": RegexFormatKwargs,
    "length_penalty": LengthPenaltyKwargs,
    "math_answer": MathAnswerKwargs,
    "code_tests": CodeTestsKwargs,
    "reasoning_gym": ReasoningGymKwargs,
    "reward_model": NoKwargs,
}


def _choices(schema: type[SpecModel], name: str) -> list | None:
    info = schema.model_fields.get(name)
    tp = info.annotation if info else None
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def _schema_issues(owner: str, schema: type[SpecModel], kwargs: dict) -> list[tuple[tuple, str]]:
    try:
        schema.model_validate(kwargs)
    except ValidationError as error:
        issues = []
        allowed = list(schema.model_fields)
        for item in error.errors():
            key = item["loc"][0] if item["loc"] else ""
            value = item.get("input")
            if item["type"] == "extra_forbidden":
                close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                takes = f"; it takes: {', '.join(allowed)}" if allowed else "; it takes none"
                issues.append(((key,), f"unknown argument of {owner}{hint}{takes}"))
            elif item["type"] == "literal_error" and (choices := _choices(schema, str(key))):
                issues.append(((key,), f"must be one of {', '.join(map(str, choices))} (got {value!r})"))
            else:
                message = item["msg"].removeprefix("Value error, ")
                ctx = item.get("ctx") or {}
                bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
                if item["type"] in bounds:
                    message = f"must be {bounds[item['type']]} {next(iter(ctx.values()))}"
                issues.append((tuple(item["loc"]), f"{message} (got {value!r})"))
        return issues
    return []


def _signature_issues(owner: str, fn: Any, kwargs: dict) -> list[tuple[tuple, str]]:
    """A user function without a declared schema: its keyword parameters are the schema."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # the first takes the completions
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []  # takes anything
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.name not in COLUMNS}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: check the names only
        hints = {}
    issues = []
    for key, value in kwargs.items():
        if key not in named:
            close = difflib.get_close_matches(str(key), list(named), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            takes = f"; it takes: {', '.join(named)}" if named else "; it takes none"
            issues.append(((key,), f"unknown argument of {owner}{hint}{takes}"))
        elif key in hints:
            try:
                TypeAdapter(hints[key]).validate_python(value, strict=False)
            except ValidationError as error:
                issues.append(((key,), f"{error.errors()[0]['msg']} (got {value!r}; {owner} declares {key}: "
                               f"{getattr(hints[key], '__name__', hints[key])})"))
            except Exception:  # an annotation pydantic cannot build a validator for
                pass
    return issues


def kwargs_issues(fn_name: str, fn: Any, kwargs: dict) -> list[tuple[tuple, str]]:
    """(path under ``kwargs``, message) for every argument ``fn`` does not accept as given."""
    owner = fn_name if fn_name in KWARGS_SCHEMAS else f"{fn_name!r}"
    schema = KWARGS_SCHEMAS.get(fn_name) or getattr(fn, "kwargs_schema", None)
    if isinstance(schema, type) and issubclass(schema, SpecModel):
        return _schema_issues(owner, schema, kwargs)
    if fn is None:
        return []
    return _signature_issues(owner, fn, kwargs)


RECORD_READERS = ("exact_answer", "math_answer", "code_tests")  # the built-ins ``record_problem`` knows


def record_problem(fn_name: str, kwargs: dict, record: dict) -> str | None:
    """Why a built-in reward cannot score completions of ``record`` (a canonical record), or None."""
    answer = record.get("answer")
    if fn_name == "exact_answer":
        if answer is None:
            return "has no `answer`, which exact_answer compares against (every attempt would score 0)"
        try:
            Fraction(answer.strip())
        except (ValueError, ZeroDivisionError):
            return f"has answer {answer[:60]!r}, and exact_answer compares numbers (use math_answer, or a reward " \
                   "of your own, for other answers)"
    elif fn_name == "math_answer":
        if answer is None or not answer.strip():
            return "has no `answer`, which math_answer compares against (every attempt would score 0)"
    elif fn_name == "code_tests" and not kwargs.get("tests"):
        if answer is None or not answer.strip():
            return "has no `answer`, which code_tests runs as the tests (or give `kwargs: {tests: ...}`)"
        try:
            compile(answer, "<tests>", "exec")
        except (SyntaxError, ValueError) as error:
            return f"has an `answer` that code_tests runs as tests, and it does not compile ({error})"
    return None
