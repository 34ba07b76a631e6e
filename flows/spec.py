"""The pipeline spec: YAML -> typed pydantic models, with every error reported at once.

Each error names its YAML path (``stages.grpo.kl_beta``) and, where the file has it, its
line. Structural errors (unknown keys, wrong types, out-of-range values) and semantic ones
(unknown references, cycles, heldout data feeding training, rewards that do not import,
data files that do not parse) are collected together so a user fixes a file in one pass.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
)

from flows.graph import BASE, expand_rounds
from flows.iterate import IterateSpec, iterate_issues
from stages.context import Resources
from stages.data import (
    ArithmeticData,
    DataError,
    DataSpec,
    FileData,
    ReasoningGymData,
    holds_preferences,
    load_records,
    located_file_records,
    prompt_messages,
    prompt_text,
)
from stages.models import (
    GGUFModelSpec,
    HubModelSpec,
    ModelSpec,
    PathModelSpec,
    chat_template_problem,
    check_checkpoint_dir,
)
from stages.pretrained import (
    GGUF_SUFFIX,
    ModelSourceError,
    cached_hub_snapshot,
    gguf_reader_problem,
    hub_problem,
    locate_gguf,
)
from stages.registry import STAGE_KINDS
from stages.rewards import (
    BUILTIN_REWARDS,
    REASONING_GYM_FN,
    REWARD_MODEL_FN,
    RewardCase,
    RewardError,
    RewardSpec,
    load_reward_fn,
)
from stages.reward_schemas import RECORD_READERS, kwargs_issues, record_problem
from stages.sandbox import ISOLATION_MODES
from stages.spec_model import KEY_NAME_PATTERN, NAME_PATTERN, SpecModel, name_problem

def _stage_kind(value) -> str | None:
    if isinstance(value, BaseModel):
        return getattr(value, "kind", None)
    kind = value.get("kind") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None  # `kind: [sft]` is no kind (and unhashable)


StageSpec = Annotated[
    Union[tuple(Annotated[config, Tag(kind)] for kind, config in STAGE_KINDS.items())],
    Discriminator(_stage_kind),
]


class Pipeline(SpecModel):
    """One post-training pipeline: a base model, datasets, rewards and stages."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=rf"^{NAME_PATTERN}$",
        description="Pipeline name (1-64 letters, digits, '_', '.', '-'); also the MLflow experiment name.",
    )
    seed: int = Field(0, description="Seed for model initialisation and for stages that set none.")
    model: ModelSpec = Field(description="The base model every chain starts from (`base` in stage references).")
    data: dict[str, DataSpec] = Field(min_length=1, description="Datasets by name, each with a role.")
    rewards: dict[str, RewardSpec] = Field(
        default_factory=dict, description="Named rewards; built-in names may also be used directly."
    )
    stages: dict[str, StageSpec] = Field(min_length=1, description="Stages by name; references form the graph.")
    reward_checks: dict[str, list[RewardCase]] = Field(
        default_factory=dict,
        description="Known cases per reward (successes, failures, malformed, shortcuts) that "
        "`posttrain check-reward` and `check_rewards: true` verify before training.",
    )
    resources: Resources | None = Field(
        None, description="Default work pool / GPUs / processes for every stage that sets no `resources`.")
    iterate: IterateSpec | None = Field(
        None, description="Rounds of training on the failure cases an eval stage collected (flows/iterate.py).")

    def seed_for(self, stage: str) -> int:
        """A stage's seed: its own when it sets one (0 included), else the pipeline's."""
        own = getattr(self.stages[stage], "seed", None)
        return self.seed if own is None else own

    def resources_for(self, stage: str) -> Resources:
        """A stage's resources: its own, else the pipeline default, else in-process on one process."""
        return self.stages[stage].resources or self.resources or Resources()


# ------------------------------------------------------------------ errors


@dataclass
class SpecIssue:
    path: str
    message: str
    line: int | None = None

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}: " if self.line else f"{source}: "
        message = " ".join(part.strip() for part in self.message.splitlines())  # one issue, one line
        return f"{where}{self.path + ': ' if self.path else ''}{message}"


class SpecError(Exception):
    """A pipeline that must not run; holds every issue found."""

    def __init__(self, source: str, issues: list[SpecIssue]):
        self.source = source
        self.issues = issues
        super().__init__("\n".join(issue.render(source) for issue in issues))


@dataclass
class LoadedPipeline:
    spec: Pipeline
    path: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def base_dir(self) -> Path:
        return self.path.parent.resolve()

    def rewards_for(self, names: list[str]) -> dict[str, RewardSpec]:
        """Reward specs by name: declared ones, else the built-in of that name."""
        return {n: self.spec.rewards.get(n) or RewardSpec(fn=n) for n in names}


# ------------------------------------------------------------------ YAML, bounded, with line numbers

MAX_PIPELINE_BYTES = 1_000_000  # a pipeline is a few KB; a larger file is not one (and would parse for minutes)
MAX_VALUES = 100_000  # values after YAML aliases are expanded: an alias bomb expands a small file without end
MAX_DEPTH = 64  # levels of nesting; a pipeline needs about six
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built: ~20x faster, same nodes and marks


class _Refused(Exception):
    """The document cannot be read further; the issues collected so far say why."""


def _line(node) -> int:
    return node.start_mark.line + 1


def _key_problem(key) -> str | None:
    """Why a mapping key is not a plain string name, or None (keys name stages, datasets, fields)."""
    if isinstance(key, yaml.ScalarNode) and key.tag in (_STR_TAG, _MERGE_TAG):
        return None
    if isinstance(key, yaml.ScalarNode):
        kind = key.tag.rpartition(":")[2]
        shown = key.value or "~"
        return f"key {shown!r} is read by YAML as {kind}, not a string; a key is a name: quote it (\"{shown}\") " \
               "or rename it"
    return f"a key must be a string, not a {'mapping' if isinstance(key, yaml.MappingNode) else 'list'}"


def _key_text(key) -> str:
    return key.value if isinstance(key, yaml.ScalarNode) else "?"


def _structure_issues(root) -> list[SpecIssue]:
    """What makes a composed document unfit to build: keys that are not strings, an alias that contains
    itself, nesting deeper than MAX_DEPTH, more than MAX_VALUES values once aliases are expanded.

    Each node is visited once (an alias is the very node its anchor names), so a document that
    expands to billions of values is measured in time linear in its size.
    """
    issues: list[SpecIssue] = []
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node, path: tuple) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in on_path:
            issues.append(SpecIssue(_dotted(path), "a YAML alias refers to a collection that contains it (a "
                                    "recursive structure); a pipeline is a finite tree", _line(node)))
            raise _Refused
        if len(path) > MAX_DEPTH:
            issues.append(SpecIssue(_dotted(path[:2]), f"nests deeper than {MAX_DEPTH} levels; a pipeline needs a "
                                    "handful", _line(node)))
            raise _Refused
        on_path.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                problem = _key_problem(key)
                if problem:
                    issues.append(SpecIssue(_dotted(path + (_key_text(key),)), problem, _line(key)))
                total += size(value, path + (_key_text(key),))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += size(item, path + (i,))
        on_path.discard(id(node))
        sizes[id(node)] = total
        if total > MAX_VALUES:
            issues.append(SpecIssue(_dotted(path), f"holds more than {MAX_VALUES} values once its YAML aliases are "
                                    "expanded (an alias repeats everything its anchor names); a pipeline holds a "
                                    "few hundred", _line(node)))
            raise _Refused
        return total

    try:
        size(root, ())
    except _Refused:
        pass
    return issues


def _yaml_error_issue(error: Exception, what: str = "", text: str = "") -> SpecIssue:
    if isinstance(error, yaml.reader.ReaderError):  # a character YAML does not allow, e.g. NUL
        line = text[: error.position].count("\n") + 1 if text else None
        return SpecIssue(what, f"YAML syntax error: character {error.character!r} is not allowed in YAML text "
                               "(control characters other than tab and newline)", line)
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    column = f", column {mark.column + 1}" if mark else ""
    kind = "YAML syntax error"
    if isinstance(error, yaml.constructor.ConstructorError) and "constructor for the tag" in problem:
        # e.g. !!python/object/apply:os.system
        kind = "YAML tag refused (pipelines are read with the safe loader, which builds no Python objects)"
    elif isinstance(error, yaml.constructor.ConstructorError):
        kind = "YAML value refused"
    return SpecIssue(what, f"{kind}{column}: {problem}", mark.line + 1 if mark else None)


def read_yaml(text: str, what: str = "") -> tuple[Any, Any, list[SpecIssue]]:
    """(data, composed root node, issues): parse ``text`` in bounded time and memory.

    Refused (no data, issues say why): syntax errors, tags the safe loader does not build,
    keys that are not strings, recursive aliases, nesting deeper than MAX_DEPTH and alias
    expansion past MAX_VALUES.
    """
    try:
        root = yaml.compose(text, Loader=_COMPOSER)
    except yaml.YAMLError as error:
        if _COMPOSER is not yaml.SafeLoader:  # PyYAML's own messages show the offending character
            try:
                yaml.compose(text, Loader=yaml.SafeLoader)
            except yaml.YAMLError as detailed:
                error = detailed
            except RecursionError:
                pass
        return None, None, [_yaml_error_issue(error, what, text)]
    except RecursionError:  # the pure-Python composer on a deeply nested document
        return None, None, [SpecIssue(what, f"the document nests deeper than {MAX_DEPTH} levels; a pipeline "
                                      "needs a handful")]
    if root is None:
        return None, None, []
    issues = _structure_issues(root)
    if issues:
        return None, root, issues
    try:
        return yaml.SafeLoader("").construct_document(root), root, []
    except yaml.YAMLError as error:
        return None, root, [_yaml_error_issue(error, what)]
    except (ValueError, OverflowError) as error:  # e.g. a date that does not exist: `2024-13-45`
        return None, root, [SpecIssue(what, f"YAML value refused: {error}")]


def _line_index(root) -> dict[tuple, int]:
    """YAML path -> 1-based line where that key (or item) starts (``root``: a checked, composed document)."""
    lines: dict[tuple, int] = {}

    def walk(node, path):
        lines.setdefault(path, _line(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = path + (key.value,)
                lines[child] = _line(key)
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    if root is not None:
        walk(root, ())
    return lines


def duplicate_key_issues(root) -> list[SpecIssue]:
    """Keys given twice in one mapping: YAML silently keeps the last, so the first would be lost."""
    issues: list[SpecIssue] = []
    seen_nodes: set[int] = set()

    def walk(node, path):
        if id(node) in seen_nodes:  # an alias of a node already checked
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                line = _line(key)
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    if key.value in first:
                        issues.append(SpecIssue(_dotted(path + (key.value,)), f"duplicate key (first given at line "
                                                f"{first[key.value]}); YAML would keep only this one", line))
                    first.setdefault(key.value, line)
                walk(value, path + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    if root is not None:
        walk(root, ())
    return issues


def _line_for(lines: dict[tuple, int], path: tuple) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def _dotted(path: tuple) -> str:
    """``stages.sft.max_steps``; a key that is empty or holds a space, dot or colon is quoted (``stages."a b"``)."""
    return ".".join(str(p) if re.fullmatch(r"[^\s.:\"]+", str(p)) else json.dumps(str(p)) for p in path)


# ------------------------------------------------------------------ overrides


def unshared(value):
    """A copy of loaded YAML in which no two places share a dict or list.

    A YAML alias (``sampling: *sampling``) loads as the very object its anchor names, so an
    override of one stage's ``sampling.seed`` would silently change every stage that shares
    the anchor. ``copy.deepcopy`` keeps such sharing; this does not.
    """
    if isinstance(value, dict):
        return {key: unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unshared(item) for item in value]
    return value


def apply_overrides(raw: dict, overrides: list[str]) -> list[SpecIssue]:
    """Apply ``dotted.path=value`` overrides in place; values are parsed as YAML scalars."""
    issues = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            issues.append(SpecIssue("--set", f"{item!r} is not of the form dotted.path=value"))
            continue
        parts = key.strip().split(".")
        value, _, problems = read_yaml(text) if text.strip() else ("", None, [])
        if problems:
            shown = text if len(text) <= 60 else text[:57] + "..."
            issues.extend(SpecIssue(f"--set {key}", f"value {shown!r} is not valid YAML ({p.message})")
                          for p in problems)
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                issues.append(
                    SpecIssue(f"--set {key}", f"{'.'.join(parts[: depth + 1])} is not a mapping, cannot set inside it")
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    return issues


# ------------------------------------------------------------------ pydantic errors -> issues


def _unwrap(tp):
    """Strip Annotated / Optional; return (origin type, tagged union members or None)."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, getattr(__import__("types"), "UnionType", Union)):
        members = {}
        for arg in typing.get_args(tp):
            tag = None
            if typing.get_origin(arg) is Annotated:
                tag = next((m.tag for m in typing.get_args(arg)[1:] if isinstance(m, Tag)), None)
                arg = typing.get_args(arg)[0]
            if arg is type(None):
                continue
            members[tag or getattr(arg, "__name__", str(arg))] = arg
        if len(members) == 1:
            return next(iter(members.values())), None
        return tp, members
    return tp, None


def _walk_loc(loc: tuple, raw: Any) -> tuple[tuple, Any]:
    """Follow a pydantic error location through Pipeline's types.

    Returns the user-facing path (union tags dropped) and the model class at the end,
    so unknown keys can be matched against that model's real fields.
    """
    tp: Any = Pipeline
    path: list = []
    i = 0
    while i < len(loc):
        tp, members = _unwrap(tp)
        elem = loc[i]
        if members is not None:
            if elem in members:  # pydantic puts the union tag into the location
                tp = members[elem]
                i += 1
                continue
            tp = next(iter(members.values()))
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            path.append(elem)
            info = tp.model_fields.get(elem)
            tp = info.annotation if info else None
            raw = raw.get(elem) if isinstance(raw, dict) else None
        elif origin is dict:
            path.append(elem)
            tp = typing.get_args(tp)[1]
            raw = raw.get(elem) if isinstance(raw, dict) else None
        elif origin is list:
            path.append(elem)
            tp = typing.get_args(tp)[0]
            raw = raw[elem] if isinstance(raw, list) and isinstance(elem, int) and elem < len(raw) else None
        else:
            path.append(elem)
            tp = None
        i += 1
    tp, members = _unwrap(tp) if tp is not None else (None, None)
    if members is not None:
        tp = next(iter(members.values()))
    return tuple(path), tp


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


did_you_mean = _did_you_mean


def _describe(error: dict, model_cls) -> str:
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        options = list(model_cls.model_fields) if isinstance(model_cls, type) and issubclass(model_cls, BaseModel) else []
        allowed = f"; allowed: {', '.join(options)}" if options else ""
        return f"unknown key{_did_you_mean(error['loc'][-1], options)}{allowed}"
    if kind == "missing":
        return "required key is missing"
    if kind == "union_tag_invalid":
        known = sorted(STAGE_KINDS)
        return f"unknown stage kind {ctx.get('tag')!r}{_did_you_mean(ctx.get('tag'), known)}; known kinds: {', '.join(known)}"
    if kind == "union_tag_not_found":
        given = value.get("kind") if isinstance(value, dict) else None
        if given is not None:
            return f"`kind:` must be one of {', '.join(sorted(STAGE_KINDS))} (got {given!r})"
        return f"a stage needs `kind:` (one of {', '.join(sorted(STAGE_KINDS))})"
    if kind == "string_pattern_mismatch" and tuple(error["loc"]) == ("name",):
        return f"pipeline {name_problem(value, NAME_PATTERN)}"
    if kind == "finite_number":
        return f"must be a finite number: NaN and infinity are refused (got {value!r})"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit} (got {value!r})"
    message = error["msg"].removeprefix("Value error, ")
    if kind in ("model_source", "data_source"):
        return message
    if isinstance(value, (dict, list)) or "(got " in message:
        return message
    return f"{message} (got {value!r})"


def _issues_from_validation(error: ValidationError, raw: dict, lines) -> list[SpecIssue]:
    issues = []
    for item in error.errors():
        path, model_cls = _walk_loc(tuple(item["loc"]), raw)
        if item["type"] == "extra_forbidden":
            parent_path, parent_cls = _walk_loc(tuple(item["loc"][:-1]), raw)
            model_cls = parent_cls
        issues.append(SpecIssue(_dotted(path), _describe(item, model_cls), _line_for(lines, path)))
    return issues


# ------------------------------------------------------------------ semantic checks


def _partial(adapter: TypeAdapter, values: dict) -> dict:
    """The entries that validate on their own (so semantic checks run despite other errors)."""
    good = {}
    for name, value in (values or {}).items():
        try:
            good[name] = adapter.validate_python(value)
        except ValidationError:
            pass
    return good


def _lenient_stages(raw_stages: dict) -> dict:
    """Every stage of a known kind, validated if it can be, else built without validation.

    So a stage with a bad learning rate still has its references, datasets and rewards
    checked: the user sees all of a file's errors in one pass.
    """
    adapter, stages = TypeAdapter(StageSpec), {}
    for name, value in raw_stages.items():
        try:
            stages[name] = adapter.validate_python(value)
        except ValidationError:
            config_cls = STAGE_KINDS.get(_stage_kind(value))
            if config_cls is not None:
                stages[name] = config_cls.model_construct(**_valid_fields(config_cls, value))
    return stages


def _valid_fields(config_cls, value: dict) -> dict:
    """The fields of ``value`` that validate on their own; a required one that does not is None (an
    empty list or mapping for those types), which every reference and name check skips: no check
    meets a value of the wrong type."""
    fields = {}
    for name, info in config_cls.model_fields.items():
        if name in value:
            try:
                annotation = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
                fields[name] = TypeAdapter(annotation).validate_python(value[name])
                continue
            except ValidationError:
                pass
        if info.is_required():
            origin = typing.get_origin(_unwrap(info.annotation)[0])
            fields[name] = [] if origin is list else {} if origin is dict else None
    return fields


def _semantic_issues(raw: dict, base_dir: Path, lines) -> list[SpecIssue]:
    issues: list[SpecIssue] = []

    def add(path: tuple, message: str):
        issues.append(SpecIssue(_dotted(path), message, _line_for(lines, path)))

    raw_stages = raw.get("stages") if isinstance(raw.get("stages"), dict) else {}
    raw_data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    raw_rewards = raw.get("rewards") if isinstance(raw.get("rewards"), dict) else {}
    stages = _lenient_stages(raw_stages)
    data = _partial(TypeAdapter(DataSpec), raw_data)
    rewards = _partial(TypeAdapter(RewardSpec), raw_rewards)

    for name in raw_stages:
        if name == BASE:
            add(("stages", name), f"`{BASE}` is reserved for the pipeline's model; rename this stage")
        elif problem := name_problem(name, KEY_NAME_PATTERN):
            add(("stages", name), f"stage {problem}")
    for section, names in (("data", raw_data), ("rewards", raw_rewards)):
        for name in names:
            if problem := name_problem(name, KEY_NAME_PATTERN):
                add((section, name), f"{'dataset' if section == 'data' else 'reward'} {problem}")

    for name, config in stages.items():
        for field_name, target in config.references().items():
            where = ("stages", name, field_name)
            if not isinstance(target, str):
                continue  # a type error, already reported
            if target == name:
                add(where, f"stage {name!r} refers to itself")
            elif target != BASE and target not in raw_stages:
                options = [BASE, *raw_stages]
                add(where, f"unknown stage {target!r}{_did_you_mean(target, options)}; stages: {', '.join(options)}")
            elif target in stages and not stages[target].produces_checkpoint:
                add(where, f"stage {target!r} ({stages[target].kind}) produces no checkpoint to use here")
        for data_name in config.dataset_names():
            if not isinstance(data_name, str):
                continue
            where = ("stages", name, "data")
            if data_name not in raw_data:
                add(where, f"unknown dataset {data_name!r}{_did_you_mean(data_name, raw_data)}; datasets: "
                           f"{', '.join(map(str, raw_data)) or 'none declared'}")
            elif config.trains and isinstance(raw_data[data_name], dict) and raw_data[data_name].get("role") == "heldout":
                add(where, f"dataset {data_name!r} has role heldout and cannot feed training stage {name!r} "
                           "(leakage guard: heldout data is only ever evaluated)")
        for i, reward_name in enumerate(config.reward_names()):
            if not isinstance(reward_name, str):
                continue
            if reward_name not in raw_rewards and reward_name not in BUILTIN_REWARDS:
                options = [*raw_rewards, *BUILTIN_REWARDS]
                add(("stages", name, "rewards", i),
                    f"unknown reward {reward_name!r}{_did_you_mean(reward_name, options)}; "
                    f"declare it under `rewards:` or use a built-in ({', '.join(BUILTIN_REWARDS)})")

    raw_checks = raw.get("reward_checks") if isinstance(raw.get("reward_checks"), dict) else {}
    for reward_name in raw_checks:
        if reward_name not in raw_rewards and reward_name not in BUILTIN_REWARDS:
            add(("reward_checks", reward_name), f"unknown reward {reward_name!r}"
                f"{_did_you_mean(reward_name, [*raw_rewards, *BUILTIN_REWARDS])}")
    for name, config in stages.items():
        if getattr(config, "check_rewards", False) is True:
            names = [r for r in config.reward_names() if isinstance(r, str)]
            if not any(r in raw_checks for r in names):
                add(("stages", name, "check_rewards"),
                    f"check_rewards is on, but `reward_checks:` declares no cases for any of {', '.join(names)}")

    for name, spec in rewards.items():
        try:
            fn = load_reward_fn(spec.fn)
        except RewardError as error:
            add(("rewards", name, "fn"), str(error))
            fn = None
        for where, message in kwargs_issues(spec.fn, fn, spec.kwargs):
            add(("rewards", name, "kwargs", *where), message)

    for name, spec in data.items():
        for i, other in enumerate(getattr(spec, "exclude", [])):
            if other == name:
                add(("data", name, "exclude", i), f"dataset {name!r} cannot exclude itself")
            elif other not in raw_data:
                add(("data", name, "exclude", i), f"unknown dataset {other!r}{_did_you_mean(other, raw_data)}; "
                    f"datasets: {', '.join(raw_data)}")
    records = _DatasetRecords(data, base_dir)
    for name, spec in data.items():
        if isinstance(spec, FileData) and records.error(name):
            add(("data", name, "path"), records.error(name))
        elif isinstance(spec, ReasoningGymData):
            for field_name, message in _reasoning_gym_task_issues(spec):
                add(("data", name, field_name), message)
    for path, message in _consumer_issues(stages, rewards, data, raw_rewards, records):
        add(path, message)
    for path, message in _leakage_issues(data, records):
        add(path, message)
    for path, message in _sandbox_issues(stages, rewards, raw_rewards, raw_checks, raw):
        add(path, message)

    for path, message in _model_issues(raw.get("model"), base_dir, stages):
        add(path, message)

    for path, message in _reward_model_issues(stages, rewards, data, raw_stages, raw_rewards, raw_checks):
        add(path, message)
    for path, message in _reasoning_gym_issues(stages, rewards, data, raw_rewards, raw_checks):
        add(path, message)

    for name, config in stages.items():
        resources = getattr(config, "resources", None)
        if not isinstance(resources, Resources):
            raw_default = raw.get("resources")
            try:
                resources = Resources.model_validate(raw_default) if isinstance(raw_default, dict) else None
            except ValidationError:
                resources = None
        if resources is None or resources.world_size() <= 1:
            continue
        where = ("stages", name, "resources") if getattr(config, "resources", None) else ("resources",)
        if config.kind != "sft":
            add(where, f"stage {name!r} ({config.kind}): more than one process or GPU is supported for sft stages only")
        elif isinstance(getattr(config, "batch_size", None), int) and config.batch_size % resources.world_size():
            add(where, f"stage {name!r}: batch_size {config.batch_size} must divide evenly over "
                       f"{resources.world_size()} processes (each takes an equal share of the global batch)")

    for path, message in _vllm_issues(stages, raw):
        add(path, message)

    edges = {n: [t for t in c.references().values() if isinstance(t, str) and t in raw_stages]
             + [rewards[r].stage for r in c.reward_names() if r in rewards and rewards[r].stage in raw_stages]
             for n, c in stages.items()}
    for path, message in iterate_issues(raw.get("iterate"), stages, raw_data, raw_rewards, edges):
        add(path, message)
    for cycle in find_cycles(edges):
        add(("stages", cycle[0]), "dependency cycle: " + " -> ".join(cycle))
    return issues


class _DatasetRecords:
    """Each dataset's records, located (``file:line``), loaded once per validation and only when asked for.

    Files are always read (a file that does not parse is an error in itself); generated
    datasets only when a check needs their records.
    """

    def __init__(self, data: dict, base_dir: Path):
        self.data, self.base_dir = data, base_dir
        self._records: dict[str, list[tuple[str, dict]] | None] = {}
        self._errors: dict[str, str] = {}

    def error(self, name: str) -> str | None:
        self.get(name)
        return self._errors.get(name)

    def get(self, name: str) -> list[tuple[str, dict]] | None:
        """(where, record) pairs, or None when the dataset is unknown or cannot be read (reported apart)."""
        if name not in self._records:
            spec = self.data.get(name)
            try:
                if isinstance(spec, FileData):
                    self._records[name] = located_file_records(spec, self.base_dir)
                elif spec is not None:
                    self._records[name] = [(f"data.{name} record {i + 1}", r)
                                           for i, r in enumerate(load_records(spec, self.base_dir))]
                else:
                    self._records[name] = None
            except DataError as error:
                self._records[name], self._errors[name] = None, str(error)
            except Exception as error:  # a generator's own failure is reported by its own check
                self._records[name] = None
                self._errors.setdefault(name, f"{type(error).__name__}: {error}")
        return self._records[name]


# What each stage kind reads from a conversation record, beyond its schema.
def _record_shape_problem(kind: str, record: dict) -> str | None:
    messages = record.get("messages") or []
    if kind == "sft" and not any(m.get("role") == "assistant" for m in messages):
        return "has no assistant turn (`completion`, or a `messages` turn with role assistant), and sft trains " \
               "on the assistant's turns"
    if kind in ("rl", "eval") and not prompt_messages(record):
        return "has no prompt (only an assistant turn), and the stage samples replies to the prompt"
    return None


def _first_problem(records: list[tuple[str, dict]], problem_of) -> str | None:
    """``where: problem`` of the first record with a problem, and how many more have one."""
    found = [(where, problem) for where, record in records if (problem := problem_of(record))]
    if not found:
        return None
    where, problem = found[0]
    more = f" (and {len(found) - 1} more of its {len(records)} records)" if len(found) > 1 else ""
    return f"{where}: the record {problem}{more}"


def _consumer_issues(stages: dict, rewards: dict[str, RewardSpec], data: dict, raw_rewards: dict,
                     records: _DatasetRecords) -> list[tuple[tuple, str]]:
    """Datasets hold what their stages and rewards read, checked on the records themselves.

    Generated records have the turns their stages read by construction; arithmetic ones also
    integer answers, so they are not generated for this.
    """
    issues = []
    for name, config in stages.items():
        for data_name in config.dataset_names():
            spec = data.get(data_name) if isinstance(data_name, str) else None
            if spec is None or holds_preferences(spec) or isinstance(spec, ArithmeticData):
                continue
            kind = getattr(config, "kind", "")
            located = records.get(data_name) if isinstance(spec, FileData) else None
            if located and (problem := _first_problem(located, lambda r: _record_shape_problem(kind, r))):
                issues.append((("stages", name, "data"), f"dataset {data_name!r} cannot feed stage {name!r} ({kind}): "
                               f"{problem}"))
            for i, reward_name in enumerate(config.reward_names()):
                if not isinstance(reward_name, str):
                    continue
                spec_r = rewards.get(reward_name) if reward_name in raw_rewards else (
                    RewardSpec(fn=reward_name) if reward_name in BUILTIN_REWARDS else None)
                if spec_r is None or spec_r.fn not in RECORD_READERS:
                    continue
                located = records.get(data_name)  # a reasoning-gym dataset is generated for this, once
                if located is None:
                    continue
                problem = _first_problem(located, lambda r: record_problem(spec_r.fn, spec_r.kwargs, r))
                if problem is not None:
                    issues.append((("stages", name, "rewards", i), f"reward {reward_name!r} ({spec_r.fn}) cannot score "
                                   f"dataset {data_name!r}: {problem}"))
    return issues


def _leakage_issues(data: dict, records: _DatasetRecords) -> list[tuple[tuple, str]]:
    """A heldout dataset shares no prompt (normalised text) with a train or probe dataset.

    Compared by content whenever a file is involved: the same file declared twice, or a copy,
    is caught whatever its role says. Two built-in arithmetic generators draw from a question
    space of a few hundred sums by design (the quickstart's heldout measures the skill, not
    unseen questions), so they are refused only when they draw the same questions in the same
    order (same seed and ranges); two reasoning-gym datasets by their seed ranges
    (``_reasoning_gym_issues``).
    """
    issues = []
    for held_name, held in data.items():
        if held.role != "heldout":
            continue
        where = ("data", held_name, "path" if isinstance(held, FileData) else "seed")
        for other_name, other in data.items():
            if other_name == held_name or other.role == "heldout":
                continue
            if isinstance(held, ArithmeticData) and isinstance(other, ArithmeticData):
                same = ("seed", "min_operand", "max_operand", "ops")
                if all(getattr(held, f) == getattr(other, f) for f in same):
                    issues.append((where, f"heldout dataset {held_name!r} draws the same questions in the same order "
                                   f"as {other.role} dataset {other_name!r} (same generator, seed and ranges): "
                                   f"leakage guard; give it another seed"))
                continue
            if not (isinstance(held, FileData) or isinstance(other, FileData)):
                continue
            held_records, other_records = records.get(held_name), records.get(other_name)
            if held_records is None or other_records is None or holds_preferences(held) != holds_preferences(other):
                continue
            other_prompts = {prompt_text(r) for _, r in other_records}
            shared = [(w, r) for w, r in held_records if prompt_text(r) in other_prompts]
            if shared:
                first_where, first = shared[0]
                issues.append((where, f"heldout dataset {held_name!r} shares {len(shared)} of its {len(held_records)} "
                               f"prompts with {other.role} dataset {other_name!r} (compared as normalised text; first "
                               f"{first_where}: {prompt_text(first)[:80]!r}): leakage guard, heldout data is never "
                               "trained on; remove them from one of the two"))
    return issues


def _sandbox_issues(stages: dict, rewards: dict[str, RewardSpec], raw_rewards: dict, raw_checks: dict,
                    raw: dict) -> list[tuple[tuple, str]]:
    """A code_tests reward scored in this process (a stage without a work pool, or check-reward) needs its
    sandbox here: found now, not at scoring time after the training before it."""
    from stages.sandbox import SandboxUnavailable, ensure_available

    pooled_default = isinstance(raw.get("resources"), dict) and raw["resources"].get("pool")
    local_users: dict[str, list[str]] = {}
    for name, config in stages.items():
        own = getattr(config, "resources", None)
        if own.pool if isinstance(own, Resources) else pooled_default:
            continue
        for reward_name in config.reward_names():
            if isinstance(reward_name, str):
                local_users.setdefault(reward_name, []).append(name)
    for reward_name in raw_checks:
        local_users.setdefault(reward_name, []).append("check-reward")
    issues = []
    for reward_name, users in local_users.items():
        spec = rewards.get(reward_name) if reward_name in raw_rewards else (
            RewardSpec(fn=reward_name) if reward_name == "code_tests" else None)
        if spec is None or spec.fn != "code_tests":
            continue
        isolation = spec.kwargs.get("sandbox", ISOLATION_MODES[0])
        if isolation not in ISOLATION_MODES:
            continue  # reported by the kwargs check
        try:
            ensure_available(isolation)
        except SandboxUnavailable as error:
            where = ("rewards", reward_name, "fn") if reward_name in raw_rewards else ("rewards",)
            opt_out = (" Or opt out explicitly: `kwargs: {sandbox: rlimits-only}` on this reward (limits, a throwaway "
                       "dir and a scrubbed environment, no network or filesystem isolation)."
                       if isolation == "bubblewrap" else "")
            issues.append((where, f"reward {reward_name!r} (code_tests) runs model-written code in {', '.join(users)} "
                           f"in this process, and its sandbox cannot run here: {error}{opt_out}"))
    return issues


def _model_issues(model, base_dir: Path, stages: dict) -> list[tuple[tuple, str]]:
    """The base model can be found (and, for a local checkpoint, loaded safely and chatted with)."""
    if not isinstance(model, dict):
        return []
    try:
        spec = TypeAdapter(ModelSpec).validate_python(model)
    except ValidationError:
        return []  # reported as a structural error
    if isinstance(spec, GGUFModelSpec):
        where = ("model", "gguf") if isinstance(spec.gguf, str) else ("model", "gguf", "package")
        try:
            path = locate_gguf(spec.gguf, base_dir)
        except ModelSourceError as error:
            if not isinstance(spec.gguf, str) and "has no file" in str(error):
                where = ("model", "gguf", "file")
            return [(where, str(error))]
        if (problem := gguf_reader_problem()) is not None:
            return [(("model", "gguf"), problem)]
        if not path.name.endswith(GGUF_SUFFIX):
            return [(where, f"{str(path)!r} is not a .gguf file")]
        return []
    if isinstance(spec, HubModelSpec):
        if (problem := hub_problem(spec.hub, spec.revision)) is not None:
            return [(("model", "hub"), problem)]
        snapshot = cached_hub_snapshot(spec.hub, spec.revision)
        return [(("model", "hub"), message) for message in _checkpoint_problems(snapshot, spec, stages)]
    if isinstance(spec, PathModelSpec):
        path = Path(spec.path) if Path(spec.path).is_absolute() else base_dir / spec.path
        return [(("model", "path"), message) for message in _checkpoint_problems(path, spec, stages)]
    return []


def _checkpoint_problems(path: Path | None, spec, stages: dict) -> list[str]:
    if path is None:  # a hub model the hub has but the cache does not: checked once downloaded
        return []
    problem = check_checkpoint_dir(path, trust_remote_code=spec.trust_remote_code)
    if problem:
        return [problem]
    if (no_template := chat_template_problem(path)) and stages:
        # Every stage kind renders conversations with the base model's tokenizer (its
        # checkpoints carry that tokenizer on), so any stage needs a chat template.
        readers = [n for n, c in stages.items() if BASE in c.references().values()] or list(stages)
        return [f"{no_template}, and stage(s) {', '.join(readers)} render conversations with it; use a chat "
                "model's checkpoint or add a chat template to it"]
    return []


def _reasoning_gym_task_issues(spec: ReasoningGymData) -> list[tuple[str, str]]:
    """The task exists and reasoning-gym accepts its config (one entry is built, not all n)."""
    from stages.reasoning_gym_tasks import config_problem, task_names

    try:
        names = task_names()
    except DataError as error:  # the optional extra is not installed
        return [("reasoning_gym", str(error))]
    if spec.reasoning_gym not in names:
        return [("reasoning_gym", f"unknown reasoning-gym task {spec.reasoning_gym!r}"
                 f"{_did_you_mean(spec.reasoning_gym, names)}; reasoning_gym.factory.DATASETS lists its "
                 f"{len(names)} tasks")]
    problem = config_problem(spec)
    return [("config", problem)] if problem else []


def _reasoning_gym_issues(stages: dict, rewards: dict[str, RewardSpec], data: dict, raw_rewards: dict,
                          raw_checks: dict) -> list[tuple[tuple, str]]:
    """A ``reasoning_gym`` reward regenerates each entry from its record's ``task``: it scores
    reasoning_gym datasets only, and its known cases name their entry. A heldout reasoning_gym
    dataset shares no entry with another dataset of its task and config (leakage guard)."""
    from stages.reasoning_gym_tasks import task_problem

    def fn_of(reward_name):
        if reward_name in raw_rewards:
            return rewards[reward_name].fn if reward_name in rewards else None
        return reward_name if reward_name in BUILTIN_REWARDS else None

    issues = []
    for name, config in stages.items():
        gym_rewards = [(i, r) for i, r in enumerate(config.reward_names())
                       if isinstance(r, str) and fn_of(r) == REASONING_GYM_FN]
        for data_name in config.dataset_names():
            if not isinstance(data_name, str) or data_name not in data or isinstance(data[data_name], ReasoningGymData):
                continue
            for i, reward_name in gym_rewards:
                issues.append((("stages", name, "rewards", i), f"reward {reward_name!r} (fn reasoning_gym) scores "
                               f"reasoning_gym datasets only, and dataset {data_name!r} is not one (`reasoning_gym: "
                               "TASK`): its records name no task entry to regenerate and score"))

    for reward_name, cases in raw_checks.items():
        if fn_of(reward_name) != REASONING_GYM_FN or not isinstance(cases, list):
            continue
        for i, case in enumerate(cases):
            if not isinstance(case, dict):
                continue  # a structural error, reported already
            if case.get("task") is None:
                issues.append((("reward_checks", reward_name, i), "a reasoning_gym reward's case needs `task:`, the "
                               "entry it answers ({reasoning_gym: TASK, config: {...}, seed: S, size: N, index: I}), "
                               "from which the reward regenerates what it scores against"))
            elif (problem := task_problem(case["task"])) is not None:
                issues.append((("reward_checks", reward_name, i, "task"), problem))

    gyms = {n: s for n, s in data.items() if isinstance(s, ReasoningGymData)}
    for held_name, held in gyms.items():
        if held.role != "heldout":
            continue
        for other_name, other in gyms.items():
            same_task = (other.reasoning_gym, other.config) == (held.reasoning_gym, held.config)
            if other_name == held_name or other.role == "heldout" or not same_task:
                continue
            if held.seed < other.seed + other.n and other.seed < held.seed + held.n:
                issues.append((("data", held_name, "seed"), f"heldout dataset {held_name!r} shares entries with "
                               f"{other.role} dataset {other_name!r} (same task and config; reasoning-gym draws entry "
                               f"i from seed + i, so seeds {held.seed}..{held.seed + held.n - 1} and {other.seed}.."
                               f"{other.seed + other.n - 1} overlap): leakage guard; e.g. seed: "
                               f"{max(held.seed, other.seed + other.n)}"))
            elif held_name not in other.exclude and (shared := _shared_prompts(held, other)):
                issues.append((("data", other_name, "exclude"), f"{other.role} dataset {other_name!r} asks "
                               f"{shared} of heldout dataset {held_name!r}'s questions (the task's question space is "
                               f"small: disjoint seeds draw the same questions; compared as normalised text): leakage "
                               f"guard; add `exclude: [{held_name}]` to drop them from {other_name!r}"))
    return issues


def _shared_prompts(held: ReasoningGymData, other: ReasoningGymData) -> int:
    """How many of ``held``'s prompts ``other`` also holds (0 when either cannot be generated: reported elsewhere)."""
    try:
        held_prompts = {prompt_text(r) for r in load_records(held, Path("."))}
        return sum(prompt_text(r) in held_prompts for r in load_records(other, Path(".")))
    except Exception:  # an unknown task or config: its own check names it
        return 0


def _reward_model_issues(stages: dict, rewards: dict[str, RewardSpec], data: dict, raw_stages: dict,
                         raw_rewards: dict, raw_checks: dict) -> list[tuple[tuple, str]]:
    """Reward models are scorers, not policies; preference pairs are not conversations.

    A reference that must name a reward_model stage (eval's ``reward_model``, PPO's
    ``critic``, a ``fn: reward_model`` reward's ``stage``) names one, no other reference names
    one, and each stage reads the kind of dataset it trains on.
    """
    issues = []

    def kind_of(target):
        config = stages.get(target)
        return getattr(config, "kind", None)

    for name, config in stages.items():
        wants_rm = set(getattr(config, "reward_model_references", ()))
        for field_name, target in config.references().items():
            if not isinstance(target, str) or target == name or target not in stages:
                continue  # unknown or self references are reported above
            is_rm = kind_of(target) == "reward_model"
            if field_name in wants_rm and not is_rm:
                issues.append((("stages", name, field_name),
                               f"stage {target!r} is kind {kind_of(target)}; {field_name} needs a reward_model stage"))
            elif field_name not in wants_rm and is_rm:
                issues.append((("stages", name, field_name),
                               f"stage {target!r} is a reward model (a scorer, not a policy); it cannot be used as "
                               f"{field_name}"))
        wants_pairs = getattr(config, "data_records", "conversations") == "preferences"
        for data_name in config.dataset_names():
            if isinstance(data_name, str) and data_name in data and holds_preferences(data[data_name]) != wants_pairs:
                needed = ("preference pairs (`generator: arithmetic_preferences` or a file with "
                          "`records: preferences`)" if wants_pairs else "conversations, not preference pairs")
                issues.append((("stages", name, "data"), f"stage kind {config.kind} reads {needed}; "
                               f"dataset {data_name!r} does not hold them"))

    for reward_name, spec in rewards.items():
        if spec.fn != REWARD_MODEL_FN:
            continue
        where = ("rewards", reward_name, "stage")
        if spec.stage not in raw_stages:
            issues.append((where, f"unknown stage {spec.stage!r}{_did_you_mean(spec.stage, raw_stages)}; "
                                  f"stages: {', '.join(raw_stages)}"))
        elif spec.stage in stages and kind_of(spec.stage) != "reward_model":
            issues.append((where, f"stage {spec.stage!r} is kind {kind_of(spec.stage)}; a reward_model reward "
                                  "scores with a reward_model stage"))
        if reward_name in raw_checks:
            issues.append((("reward_checks", reward_name), "a reward_model reward has no model before its stage "
                           "has trained, so it cannot be checked against known cases"))
    return issues


def _vllm_issues(stages: dict, raw: dict) -> list[tuple[tuple, str]]:
    """A stage that must generate with vLLM and runs in this process needs vLLM here.

    A stage sent to a work pool (``resources.pool``) is checked where it runs: a GPU
    worker has vLLM, this machine need not. ``backend: auto`` never needs it. Whether vLLM
    can serve a particular model (vLLM's CPU kernels take only some head sizes) is known
    once the checkpoint exists, and checked by the stage.
    """
    from stages.generation import vllm_problem

    problem = vllm_problem()
    if problem is None:
        return []
    pooled_default = isinstance(raw.get("resources"), dict) and raw["resources"].get("pool")
    issues = []
    for name, config in stages.items():
        own = getattr(config, "resources", None)
        if (own.pool if isinstance(own, Resources) else pooled_default):
            continue
        if getattr(config, "backend", None) == "vllm":
            issues.append((("stages", name, "backend"), f"{problem}, and the stage runs in this process (no "
                           "`resources.pool`): use `backend: auto` or `hf`, or send it to a GPU pool"))
    return issues


def find_cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """Each distinct cycle in a stage -> upstream graph, as a closed path."""
    cycles, seen_sets = [], set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                key = frozenset(cycle)
                if key not in seen_sets:
                    seen_sets.add(key)
                    cycles.append(cycle)
            elif state.get(nxt) is None and nxt in edges:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in edges:
        if state.get(node) is None:
            visit(node)
    return cycles


# ------------------------------------------------------------------ entry point


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> LoadedPipeline:
    """Read, override and validate a pipeline file; raise SpecError with every issue."""
    path = Path(path)
    source = str(path)
    overrides = list(overrides or [])
    if not path.is_file():
        raise SpecError(source, [SpecIssue("", "pipeline file does not exist" if not path.exists() else "not a file")])
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PIPELINE_BYTES + 1)
        text = data.decode("utf-8")
    except OSError as error:
        raise SpecError(source, [SpecIssue("", f"cannot read the file ({error.strerror or error})")]) from None
    except UnicodeDecodeError as error:
        if len(data) > MAX_PIPELINE_BYTES:  # cut inside a character: it is too large anyway
            text = ""
        else:
            line = data[: error.start].count(b"\n") + 1
            raise SpecError(source, [SpecIssue("", f"cannot read the file: it is not utf-8 text (byte "
                                               f"0x{data[error.start]:02x})", line)]) from None
    if len(data) > MAX_PIPELINE_BYTES:
        raise SpecError(source, [SpecIssue("", f"the file is larger than {MAX_PIPELINE_BYTES // 1_000_000} MB; a "
                                           "pipeline is a few KB (data belongs in data files named under `data:`)")])
    raw, root, issues = read_yaml(text)
    if issues:
        raise SpecError(source, issues)
    if raw is None:
        raise SpecError(source, [SpecIssue("", "the file is empty; a pipeline needs name, model, data and stages")])
    if not isinstance(raw, dict):
        raise SpecError(source, [SpecIssue("", f"a pipeline is a mapping of keys, not a {type(raw).__name__}", 1)])

    lines = _line_index(root)
    issues = duplicate_key_issues(root)
    raw = unshared(raw)
    issues += apply_overrides(raw, overrides)
    spec = None
    try:
        spec = Pipeline.model_validate(raw)
    except ValidationError as error:
        issues.extend(_issues_from_validation(error, raw, lines))
    issues.extend(_semantic_issues(raw, path.parent.resolve(), lines))
    if issues:
        overridden = {item.partition("=")[0].strip() for item in overrides}
        for issue in issues:
            if any(issue.path == key or issue.path.startswith(key + ".") for key in overridden):
                issue.message += " (from --set)"
                issue.line = None
        raise SpecError(source, issues)
    return LoadedPipeline(spec=expand_rounds(spec), path=path.resolve(), overrides=overrides)
