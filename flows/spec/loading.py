"""The pipeline spec: YAML -> typed pydantic models, with every error reported at once.

Each error names its YAML path (``stages.grpo.kl_beta``) and, where the file has it, its
line. Structural errors (unknown keys, wrong types, out-of-range values) and semantic ones
(unknown references, cycles, heldout data feeding training, rewards that do not import,
data files that do not parse) are collected together so a user fixes a file in one pass.

Three modules: the schema (``flows/spec/schema.py``), the cross-field checks by concern
(``flows/spec/validate.py``), and this one, the loader: the YAML read bounded and with line
numbers, ``--set`` overrides, pydantic's errors turned into issues, and ``load_pipeline``.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from flows.planning.graph import BASE, expand_rounds
from flows.spec.schema import (  # the schema, re-exported: flows.spec.loading is where callers load pipelines from
    LoadedPipeline,
    Pipeline,
    SpecError,
    SpecIssue,
    did_you_mean,
    dotted,
    line_for,
    unwrap_type,
)
from flows.spec.validate import semantic_issues
from stages.registry import STAGE_KINDS
from stages.rl_common import RL_ALGORITHMS
from stages.spec_model import HUB_ID_PATTERN, NAME_PATTERN, name_problem

__all__ = ["BASE", "LoadedPipeline", "Pipeline", "SpecError", "SpecIssue", "did_you_mean", "load_pipeline"]


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


def _children(node, path: tuple):
    """(key node, or None for a list item; child node; child's path) of a composed mapping or list."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key, value, path + (_key_text(key),)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield None, item, path + (i,)


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
            issues.append(SpecIssue(dotted(path), "a YAML alias refers to a collection that contains it (a "
                                    "recursive structure); a pipeline is a finite tree", _line(node)))
            raise _Refused
        if len(path) > MAX_DEPTH:
            issues.append(SpecIssue(dotted(path[:2]), f"nests deeper than {MAX_DEPTH} levels; a pipeline needs a "
                                    "handful", _line(node)))
            raise _Refused
        on_path.add(id(node))
        total = 1
        for key, child, child_path in _children(node, path):
            problem = None if key is None else _key_problem(key)
            if problem:
                issues.append(SpecIssue(dotted(child_path), problem, _line(key)))
            total += size(child, child_path)
        on_path.discard(id(node))
        sizes[id(node)] = total
        if total > MAX_VALUES:
            issues.append(SpecIssue(dotted(path), f"holds more than {MAX_VALUES} values once its YAML aliases are "
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
        for key, child, child_path in _children(node, path):
            if key is not None:
                lines[child_path] = _line(key)
            walk(child, child_path)

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
        first: dict[str, int] = {}
        for key, child, child_path in _children(node, path):
            if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                line = _line(key)
                if key.value in first:
                    issues.append(SpecIssue(dotted(child_path), f"duplicate key (first given at line "
                                            f"{first[key.value]}); YAML would keep only this one", line))
                first.setdefault(key.value, line)
            walk(child, child_path)

    if root is not None:
        walk(root, ())
    return issues


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
    """Apply ``dotted.path=value`` overrides in place (a number indexes a list); values are parsed as YAML."""
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
        problem = _set_at(raw, parts, value)
        if problem:
            issues.append(SpecIssue(f"--set {key}", problem))
    return issues


def _set_at(raw: dict, parts: list[str], value) -> str | None:
    """Set ``value`` at ``parts`` below ``raw``: a mapping's key (made where missing) or a list's index
    (``stages.grpo.rewards.0``); why it cannot be set, or None."""
    node = raw
    for depth, part in enumerate(parts):
        last, where = depth == len(parts) - 1, ".".join(parts[:depth])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return f"{where} is a list of {len(node)}: index it with 0 to {len(node) - 1}, not {part!r}" \
                    if node else f"{where} is an empty list: set it whole ({where}=[...])"
            part = int(part)
        elif not isinstance(node, dict):
            return f"{where} is not a mapping, cannot set inside it"
        if last:
            node[part] = value
            return None
        if isinstance(node, dict) and node.get(part) is None:
            node[part] = {}
        node = node[part]
    return None


# ------------------------------------------------------------------ pydantic errors -> issues




def _walk_loc(loc: tuple, raw: Any) -> tuple[tuple, Any]:
    """Follow a pydantic error location through Pipeline's types.

    Returns the user-facing path (union tags dropped) and the model class at the end,
    so unknown keys can be matched against that model's real fields.
    """
    tp: Any = Pipeline
    path: list = []
    i = 0
    while i < len(loc):
        tp, members = unwrap_type(tp)
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
    tp, members = unwrap_type(tp) if tp is not None else (None, None)
    if members is not None:
        tp = next(iter(members.values()))
    return tuple(path), tp




def _describe(error: dict, model_cls) -> str:
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        options = list(model_cls.model_fields) if isinstance(model_cls, type) and issubclass(model_cls, BaseModel) else []
        allowed = f"; allowed: {', '.join(options)}" if options else ""
        return f"unknown key{did_you_mean(error['loc'][-1], options)}{allowed}"
    if kind == "missing":
        return "required key is missing"
    if kind in ("union_tag_invalid", "union_tag_not_found") and "algorithm" in str(ctx.get("discriminator")):
        known = sorted(RL_ALGORITHMS)
        if kind == "union_tag_invalid":
            return (f"unknown rl algorithm {ctx.get('tag')!r}{did_you_mean(ctx.get('tag'), known)}; "
                    f"algorithms: {', '.join(known)}")
        given = value.get("algorithm") if isinstance(value, dict) else None
        if given is not None:
            return f"`algorithm:` must be one of {', '.join(known)} (got {given!r})"
        return f"an rl stage needs `algorithm:` (one of {', '.join(known)})"
    if kind == "union_tag_invalid":
        known = sorted(STAGE_KINDS)
        return f"unknown stage kind {ctx.get('tag')!r}{did_you_mean(ctx.get('tag'), known)}; known kinds: {', '.join(known)}"
    if kind == "union_tag_not_found":
        given = value.get("kind") if isinstance(value, dict) else None
        if given is not None:
            return f"`kind:` must be one of {', '.join(sorted(STAGE_KINDS))} (got {given!r})"
        return f"a stage needs `kind:` (one of {', '.join(sorted(STAGE_KINDS))})"
    if kind == "string_pattern_mismatch" and tuple(error["loc"]) == ("name",):
        return f"pipeline {name_problem(value, NAME_PATTERN)}"
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == HUB_ID_PATTERN:
        return (f"{value!r} is not a Hugging Face repository id: `name` or `owner/name`, letters, digits, '_', '.' "
                "and '-', with no '..' or '--' and no other '/'")
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
        issues.append(SpecIssue(dotted(path), _describe(item, model_cls), line_for(lines, path)))
    return issues


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
    issues.extend(semantic_issues(raw, path.parent.resolve(), lines))
    if issues:
        overridden = {item.partition("=")[0].strip() for item in overrides}
        for issue in issues:
            if any(issue.path == key or issue.path.startswith(key + ".") for key in overridden):
                issue.message += " (from --set)"
                issue.line = None
        raise SpecError(source, issues)
    return LoadedPipeline(spec=expand_rounds(spec), path=path.resolve(), overrides=overrides)
