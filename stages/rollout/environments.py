"""Environments: what an agent's episode runs against, a registry like the rewards'. Design: docs/algorithms.md."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import operator
import re
import threading
import typing
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from pydantic import ConfigDict, Field

from stages.rewards.known_cases import KnownCase
from stages.rewards.registry import imported_attribute
from stages.spec_model import SpecModel

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


class EpisodeCase(KnownCase):
    """A scripted episode whose score is known before training."""

    prompt: str = Field(description="The user message the episode starts from.")
    answer: str | None = Field(None, description="Reference answer handed to the rewards.")
    turns: list[str] = Field(min_length=1, description="The model's turns, in order (tool calls as "
                             "<tool_call>...</tool_call>); the tools' results come from the environment.")
    min: float | None = Field(None, description="The episode's combined reward must be at least this.")
    max: float | None = Field(None, description="The episode's combined reward must be at most this.")
    ended: str | None = Field(None, pattern="^(answer|max_turns|token_budget)$",
                              description="How the episode must end.")
    tool_errors: int | None = Field(None, ge=0, description="How many tool errors the episode must record.")

    def model_post_init(self, __context) -> None:
        if self.min is None and self.max is None and self.ended is None and self.tool_errors is None:
            raise ValueError("an episode case needs an expectation: min, max, ended and/or tool_errors")


class EnvironmentSpec(SpecModel):
    """An environment and the fixed settings of its episodes (all of them enter the eval settings hash)."""

    model_config = ConfigDict(extra="forbid")

    fn: str = Field(description="Built-in environment (calculator, python) or dotted path `pkg.module:Class` "
                    "to a subclass of stages.rollout.environments.Environment.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's "
                                   "constructor (python: timeout_s, memory_mb).")
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode; an episode whose last allowed "
                           "turn still calls a tool ends on the turn budget (counted apart from wrong answers).")
    max_episode_tokens: int = Field(256, ge=1, le=32768, description="Token budget of an episode after its "
                                    "prompt, model and observation tokens together; the per-turn budget is the "
                                    "stage's completion budget. Hitting either ends the episode on the token budget.")
    require_tool: bool = Field(False, description="An episode that answers without one successful tool call is a "
                               "shortcut and scores 0 on every reward.")
    tool_timeout_s: float = Field(10.0, gt=0, le=600, description="Wall-clock limit of one tool call; past it the "
                                  "call is a tool error and the episode goes on.")
    max_observation_chars: int = Field(2000, ge=16, le=1_000_000, description="A tool result longer than this is "
                                       "cut (and marked cut) before it is rendered into the episode.")
    render_tools: bool = Field(True, description="Pass the tools' JSON schemas to the chat template (`tools=`). "
                               "Turn off when the policy learned its tools from demonstrations rendered without "
                               "them (an SFT stage renders no tools): the episode's prompt must be the one it saw.")
    checks: list[EpisodeCase] = Field(
        default_factory=list, exclude=True,  # known cases, not settings: never part of a hash or fingerprint
        description="Known episodes scored before training (`check_rewards: true` on the rl stage, and "
        "`posttrain check-reward`): scripted turns replayed through the environment, each with the score range, "
        "end and tool errors it must get.")


class EnvironmentLoadError(ValueError):
    """An environment that cannot be loaded or that broke its contract."""


class Environment:
    """Base class of environments: override ``tools`` (and ``start`` when episodes start differently)."""

    def __init__(self, **kwargs):
        if kwargs:
            raise EnvironmentLoadError(f"{type(self).__name__} takes no kwargs (got {sorted(kwargs)})")

    def tools(self) -> dict[str, Callable[..., Any]]:
        raise NotImplementedError

    def start(self, record: dict) -> list[dict]:
        """The conversation an episode starts from: the record's messages before its first assistant turn."""
        messages = record["messages"]
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        return [dict(m) for m in messages[:first]]

    def check(self) -> None:
        """Raise if the environment cannot run here (before any episode is sampled)."""

    def score(self, episode, answer: str | None, task: dict | None) -> float | None:
        """The environment's own score of a finished ``episode``, given the record's ``answer`` and ``task``;
        None when it cannot be scored (counted as unparsed). A stage lists ``environment`` to reward it."""
        raise NotImplementedError(f"{type(self).__name__} defines no score of its own")


def has_own_score(cls: type[Environment]) -> bool:
    return cls.score is not Environment.score


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_CALC_DIGITS = 200


def evaluate_arithmetic(expression: str):
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses), from its syntax tree."""
    if len(expression) > 500:
        raise ValueError(f"expression of {len(expression)} characters; at most 500")

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("exponent or base too large")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, int) and len(str(abs(result))) > MAX_CALC_DIGITS:
                raise ValueError(f"result has more than {MAX_CALC_DIGITS} digits")
            return result
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


class CalculatorEnvironment(Environment):
    """One tool, ``calculator(expression)``: exact arithmetic, so the model need not do it in its head."""

    def tools(self):
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: Numbers with + - * / // % ** and parentheses, e.g. "47*86".
            """
            return str(evaluate_arithmetic(expression))

        return {"calculator": calculator}

    def score(self, episode, answer: str | None, task: dict | None) -> float | None:
        """1 when the answer's integer (``exact_answer`` strict) equals the reference and a successful calculator
        call's result, else 0 (right but not computed with the tool: 0); None without an integer answer."""
        from stages.rewards.builtin_rewards import extract_integer

        if answer is None:
            raise ValueError("the calculator's score needs the record's reference answer")
        given = extract_integer(episode.answer or "")
        if given is None:
            return None
        results = {_number(r.content) for r in episode.tool_results if r.name == "calculator" and not r.error}
        return float(Fraction(given) == _number(str(answer)) and Fraction(given) in results)


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        return None


class PythonEnvironment(Environment):
    """One tool, ``python(code)``: the code runs in the bubblewrap sandbox; its stdout is the result."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256, isolation: str = "bubblewrap"):
        self.timeout_s, self.memory_mb, self.isolation = float(timeout_s), int(memory_mb), isolation

    def check(self) -> None:
        from stages.rewards.sandbox import ensure_available

        ensure_available(self.isolation)

    def tools(self):
        from stages.rewards.sandbox import run_sandboxed

        def python(code: str) -> str:
            """Run a Python program (standard library only) and return what it prints.

            Args:
                code: The program; print the result.
            """
            result = run_sandboxed(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                   max_output_bytes=100_000, isolation=self.isolation)
            if result.killed_reason or result.returncode != 0:
                tail = result.stderr.strip().splitlines()[-1:] or [""]
                raise RuntimeError(result.killed_reason or f"exit status {result.returncode}: {tail[0]}")
            return result.stdout.strip()

        return {"python": python}


BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {
    "calculator": CalculatorEnvironment,
    "python": PythonEnvironment,
}

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED_PATH = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}")


@functools.lru_cache(maxsize=None)
def load_environment_class(name: str) -> type[Environment]:
    """A built-in name or a dotted path ``pkg.module:Class`` (importable module only, never a file)."""
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    if not _DOTTED_PATH.fullmatch(name):
        raise EnvironmentLoadError(f"unknown environment {name!r}: not a built-in ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}) "
                                "and not a dotted path like `my_pkg.envs:MyEnvironment`")
    module_name, _, attr = name.partition(":")
    cls = imported_attribute(name, "environment", module_name, attr, EnvironmentLoadError)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(f"environment {name!r} is not a subclass of stages.rollout.environments.Environment")
    return cls


def build_environment(spec: EnvironmentSpec) -> Environment:
    try:
        environment = load_environment_class(spec.fn)(**spec.kwargs)
    except TypeError as error:
        raise EnvironmentLoadError(f"environment {spec.fn!r}: bad kwargs {spec.kwargs}: {error}") from None
    tools = environment.tools()
    if not tools or not all(callable(t) for t in tools.values()):
        raise EnvironmentLoadError(f"environment {spec.fn!r}: tools() must return a non-empty {{name: callable}}")
    return environment


def tool_schemas(tools: dict[str, Callable[..., Any]]) -> list[dict]:
    """The tools as JSON schemas for the chat template's ``tools=`` (from their type hints and docstrings)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools.values()]


@dataclass
class ToolCall:
    name: str | None
    args: list
    kwargs: dict
    error: str | None  # why the call could not be parsed


@dataclass
class ToolResult:
    name: str
    content: str
    error: bool


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """The calls in a model turn, or None when it holds none (the turn is an answer)."""
    if TOOL_CALL_OPEN not in text:
        return None
    bodies = TOOL_CALL.findall(text)
    if not bodies:
        return [ToolCall(None, [], {}, "unclosed <tool_call>")]
    return [_parse_call(body.strip()) for body in bodies]


def _parse_call(body: str) -> ToolCall:
    if body.startswith("{"):
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
            return ToolCall(name, [], arguments, None)
        except (ValueError, KeyError, TypeError) as error:
            return ToolCall(None, [], {}, f"unparsable tool call {body[:80]!r}: {error}")
    try:
        node = ast.parse(body, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError("expected name(arguments)")
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        return ToolCall(node.func.id, args, kwargs, None)
    except (SyntaxError, ValueError, TypeError) as error:
        return ToolCall(None, [], {}, f"unparsable tool call {body[:80]!r}: {error}")


_SIMPLE_TYPES = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}


def execute_tool_call(call: ToolCall, tools: dict[str, Callable[..., Any]], timeout_s: float,
                      max_chars: int) -> ToolResult:
    """Run one call, contained: every failure is a ``ToolResult`` with ``error=True``, never an exception."""
    name = call.name or "unknown"
    if call.error:
        return ToolResult(name, f"error: {call.error}", True)
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(name, f"error: no tool {call.name!r} (tools: {', '.join(tools)})", True)
    try:
        bound = inspect.signature(fn).bind(*call.args, **call.kwargs)
    except TypeError as error:
        return ToolResult(name, f"error: {error}", True)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: the arguments are passed unchecked
        hints = {}
    for param, value in bound.arguments.items():
        expected = _SIMPLE_TYPES.get(hints.get(param))
        if expected and (not isinstance(value, expected) or (bool not in expected and isinstance(value, bool))):
            return ToolResult(name, f"error: {param} must be {hints[param].__name__}, got {type(value).__name__}", True)
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn(*bound.args, **bound.kwargs)
        except BaseException as error:  # the tool's failure is the observation
            outcome["error"] = f"{type(error).__name__}: {error}"

    worker = threading.Thread(target=target, daemon=True, name=f"tool-{name}")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return ToolResult(name, f"error: {name} ran past {timeout_s:g} s and was abandoned", True)
    if "error" in outcome:
        return ToolResult(name, "error: " + _cut(outcome["error"], max_chars), True)
    return ToolResult(name, _cut(str(outcome.get("value")), max_chars), False)


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    marker = f"...[cut {len(text) - max_chars} chars]"
    return text[: max(0, max_chars - len(marker))] + marker
