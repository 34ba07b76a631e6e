"""The reward registry: a reward's name to its function, a built-in or a dotted path to a user function."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Any, Callable

from stages.rewards.builtin_rewards import environment, exact_answer, judge, length_penalty, regex_format, reward_model
from stages.rewards.spec import ENVIRONMENT_FN, JUDGE_FN, REASONING_GYM_FN, REWARD_MODEL_FN, RewardError


def _lazy(path: str) -> Callable[..., Any]:
    """A built-in kept in its own module, imported on first use (math-verify and SymPy import slowly)."""

    def call(completions, **columns):
        return load_reward_fn(path)(completions, **columns)

    call.__name__ = path.rpartition(":")[2]
    call.lazy_path = path  # the reward worker imports it before its time bound starts
    return call


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
    fn = imported_attribute(name, what, module_name, attr)
    if fn is None:
        raise RewardError(f"{what} {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(f"{what} {name!r} is not callable")
    return fn


def imported_attribute(name: str, what: str, module_name: str, attr: str,
                       error: type[ValueError] = RewardError) -> Any:
    """Attribute ``attr`` of module ``module_name`` (None where it has none), for the dotted path ``name`` of a
    ``what`` (a reward, an environment); ``error`` says why the module cannot be imported."""
    try:
        module = importlib.import_module(module_name)
    except Exception as caught:
        raise error(f"{what} {name!r}: cannot import module {module_name!r} "
                    f"({type(caught).__name__}: {caught})") from None
    return getattr(module, attr, None)


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
