"""The base of every pipeline config model: each value has a type and a finite range. Design: docs/algorithms.md."""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_INT = 2**31 - 1
MAX_FLOAT = 1e9
SEED_LIMIT = 2**32
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"  # a pipeline's name (its MLflow experiment)
KEY_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"  # stage, dataset, reward names: no '.', which --set paths split on
_WHY = "names become file names, MLflow metric keys and Prefect task names"
# a Hugging Face repository id, `name` or `owner/name`: no "..", "--" or other "/" (huggingface_hub's rule)
_HUB_PART = r"[A-Za-z0-9][A-Za-z0-9_]*([.-][A-Za-z0-9_]+)*"
HUB_ID_PATTERN = rf"^{_HUB_PART}(/{_HUB_PART})?$"


def _revision(revision: str) -> str:
    if problem := revision_problem(revision):
        raise ValueError(problem)
    return revision


def revision_problem(revision: str) -> str | None:
    """Why ``revision`` cannot be a hub revision, or None: ``refs/pr/1`` may be, never a path step (a cache folder)."""
    if not revision.strip() or revision != revision.strip():
        return f"{revision!r} is not a commit, branch or tag (empty, or white space around it)"
    parts = revision.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\\" in revision or any(c.isspace() or ord(c) < 32
                                                                                  for c in revision):
        return f"{revision!r} is not a commit, branch or tag: it holds a path step ('..', '.', an empty part, a " \
               "backslash or white space), and a revision names a folder of the local cache"
    return None


def name_problem(name: Any, pattern: str = KEY_NAME_PATTERN) -> str | None:
    """Why ``name`` cannot name a stage, dataset or reward (or, with NAME_PATTERN, a pipeline), or None."""
    if not isinstance(name, str):
        return f"a name must be a string (got {type(name).__name__} {name!r})"
    if not re.fullmatch(pattern, name):
        shown = name if len(name) <= 40 else f"{name[:37]}... ({len(name)} characters)"
        dots = ", '.'" if "." in pattern else ""
        return f"{shown!r} is not a valid name: 1-64 letters, digits, '_'{dots} and '-', starting with a letter " \
               f"or digit ({_WHY})"
    return None


# a hub revision (a commit, branch or tag) as a field's type: checked by ``revision_problem``
HubRevision = Annotated[str, AfterValidator(_revision), Field(max_length=256)]


def _number_problem(value: Any, seed: bool) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if seed and not 0 <= value < SEED_LIMIT:
            return f"a seed must be in [0, 2**32): numpy, torch and vLLM take no other (got {_short(value)})"
        if not seed and abs(value) > MAX_INT:
            return f"must be within ±{MAX_INT} (2**31 - 1): larger than any count or step posttrain runs " \
                   f"(got {_short(value)})"
    elif isinstance(value, float):
        if not math.isfinite(value):
            return f"must be a finite number: NaN and infinity are refused (got {value!r})"
        if abs(value) > MAX_FLOAT:
            return f"must be within ±{MAX_FLOAT:g}: larger than any rate, weight or limit posttrain uses " \
                   f"(got {value!r})"
    return None


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def value_problem(value: Any, seed: bool = False, depth: int = 0) -> str | None:
    """The first out-of-range number or empty list item in ``value`` (searched through lists and mappings)."""
    if depth > 32:
        return "nests deeper than 32 levels"
    if isinstance(value, (int, float)):
        return _number_problem(value, seed)
    if isinstance(value, dict):
        for key, item in value.items():
            problem = value_problem(item, seed or key == "seed", depth + 1)
            if problem:
                return f"{key}: {problem}" if depth == 0 else problem
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, str) and not item:
                return f"item {i} is an empty string, which names nothing (an empty stop string would end " \
                       "every completion at once)"
            problem = value_problem(item, seed, depth + 1)
            if problem:
                return problem
    return None


def _alternatives(annotation) -> list:
    """A field's type as its alternatives: Annotated and unions unwrapped (``int | None`` -> [int, NoneType])."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _alternatives(args[0])
    if origin in (Union, types.UnionType):
        return [alternative for arg in args for alternative in _alternatives(arg)]
    return [annotation]


def boolean_for_number(value: Any, annotation) -> bool:
    """Whether ``value`` is (or a list of it holds) a boolean where ``annotation`` takes a number but no boolean:
    pydantic's lax mode reads ``true`` as 1, so ``max_steps: true`` would train one step."""
    alternatives = _alternatives(annotation)
    if isinstance(value, bool):
        scalars = set()
        for alternative in alternatives:
            if typing.get_origin(alternative) is Literal:
                scalars |= {type(v) for v in typing.get_args(alternative)}
            else:
                scalars.add(alternative if isinstance(alternative, type) else object)  # Any, list[...]: object
        return bool(scalars & {int, float}) and not scalars & {bool, object}
    if isinstance(value, list):
        items = [typing.get_args(a)[0] for a in alternatives if typing.get_origin(a) is list and typing.get_args(a)]
        return len(items) == 1 and any(boolean_for_number(item, items[0]) for item in value)
    return False


class SpecModel(BaseModel):
    """Every pipeline config model: unknown keys refused, every number finite and bounded."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # Keys of an older vocabulary, refused with where each lives now (``old -> new path``).
    renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any):
        if isinstance(data, dict):
            old = [key for key in cls.renamed if key in data]
            if old:
                raise ValueError("; ".join(f"{key} was renamed (did you mean {cls.renamed[key]}?)" for key in old))
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo):
        if not isinstance(value, (bool, list)):  # the rest cannot hold a boolean read as a number
            return value
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and boolean_for_number(value, field.annotation):
            raise ValueError(f"must be a number, not a boolean (got {value!r})")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _finite_and_bounded(cls, value: Any, info: ValidationInfo):
        if isinstance(value, BaseModel) or value is None or isinstance(value, str):
            return value
        name = info.field_name or ""
        problem = value_problem(value, seed=name == "seed" or name.endswith("_seed"))
        if problem:
            raise ValueError(problem)
        return value


APPLIES_WHEN = "applies_when"  # the key of a field's ``json_schema_extra`` that holds its condition


def applies_when(*alternatives: dict, why: str) -> dict:
    """``json_schema_extra`` of a field refused (saying ``why``) unless one of ``alternatives`` holds, each mapping
    paths from the entry's root (all must hold) to a value, values, ``{"set": b}``, ``{"not": []}``, ``{"min": x}``."""
    return {APPLIES_WHEN: {"any_of": [dict(a) for a in alternatives], "why": why}}


def field_condition(model_cls, name: str) -> dict | None:
    """The ``applies_when`` condition declared on a model's field, or None."""
    extra = model_cls.model_fields[name].json_schema_extra
    return extra.get(APPLIES_WHEN) if isinstance(extra, dict) else None


def _test_holds(value: Any, test: Any) -> bool:
    if isinstance(test, dict):
        if "set" in test:
            return (value is not None) == test["set"]
        if "not" in test:
            return value not in test["not"]
        if "min" in test:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= test["min"]
        raise ValueError(f"unknown condition test {test!r}")
    return value in test if isinstance(test, list) else value == test


def _test_text(path: str, test: Any) -> str:
    if isinstance(test, dict):
        if "set" in test:
            return f"{path} is set" if test["set"] else f"{path} is not set"
        if "not" in test:
            return f"{path} is not {' or '.join(map(str, test['not']))}"
        return f"{path} is at least {test['min']}"
    return f"{path} is {' or '.join(map(str, test)) if isinstance(test, list) else test}"


def condition_text(condition: dict) -> str:
    """``generation.mode is server and algorithm is grpo``: the condition as the reference and errors say it."""
    return " or ".join(" and ".join(_test_text(p, t) for p, t in alternative.items())
                       for alternative in condition["any_of"])


MISSING = object()  # a path the entry has no field for (another stage kind's field)


def read_path(root: Any, path: str) -> Any:
    """The value at a dotted path from ``root`` (MISSING where a part is not a field)."""
    value = root
    for part in path.split("."):
        if value is None:
            return None
        if not isinstance(value, BaseModel) or part not in type(value).model_fields:
            return MISSING
        value = getattr(value, part)
    return value


def _path_holds(root: Any, path: str, test: Any) -> bool:
    value = read_path(root, path)
    if value is MISSING:  # the entry has no such field: only "is not set" holds
        return isinstance(test, dict) and test.get("set") is False
    return _test_holds(value, test)


def condition_holds(root: Any, condition: dict) -> bool:
    return any(all(_path_holds(root, path, test) for path, test in alternative.items())
               for alternative in condition["any_of"])


def condition_paths(condition: dict) -> set[str]:
    return {path for alternative in condition["any_of"] for path in alternative}


def set_fields(model: BaseModel, prefix: tuple = ()):
    """(path, value, condition) of every field set in ``model`` and its nested models, depth first."""
    for name in sorted(model.model_fields_set, key=list(type(model).model_fields).index):
        if name not in type(model).model_fields:
            continue
        value = getattr(model, name, None)
        yield (*prefix, name), value, field_condition(type(model), name)
        if isinstance(value, BaseModel):
            yield from set_fields(value, (*prefix, name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from set_fields(item, (*prefix, name, i))
