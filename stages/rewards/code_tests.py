"""``code_tests``: run the model's Python against test asserts in the sandbox. Design: docs/algorithms.md."""

from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from stages.rewards.spec import RewardError, RewardOutput
from stages.rewards.sandbox import ISOLATION_MODES, SandboxUnavailable, ensure_available, run_sandboxed

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}
_NONCE_FILE = ".posttrain_nonce"
_SOLUTION_FILE = "solution.py"
_TESTS_FILE = "tests.py"

# The harness's source holds no secret: it reads the nonce, the solution and the tests into memory and deletes
# their files before any solution code runs, so the solution cannot read the nonce or expected values from disk.
_HARNESS = f"""\
import os as _os
import sys as _sys

def _take(path):
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    _os.unlink(path)
    return text

def _main():
    nonce = _take({_NONCE_FILE!r})
    solution = compile(_take({_SOLUTION_FILE!r}), {_SOLUTION_FILE!r}, "exec")
    tests = compile(_take({_TESTS_FILE!r}), {_TESTS_FILE!r}, "exec")
    write = _os.write
    namespace = {{"__name__": "__main__", "__builtins__": __builtins__}}
    exec(solution, namespace)
    exec(tests, namespace)
    try:
        _sys.stdout.flush()
    except Exception:
        pass
    write(1, ("\\n" + nonce + "\\n").encode())

_main()
"""


def extract_code(text: str) -> str | None:
    """A reply's last python-tagged fenced block, else its last fenced block, else all of it; None when empty."""
    blocks = _FENCE.findall(text)
    if blocks:
        tagged = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
        code = (tagged or [body for _, body in blocks])[-1]
    else:
        code = text
    return code if code.strip() else None


def compiles(code: str) -> bool:
    try:
        compile(code, "<completion>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: NUL bytes
        return False
    return True


def code_tests(
    completions: list[str],
    answer: list[str | None] | None = None,
    tests: list[str | None] | str | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    workers: int = 4,
    sandbox: str = "bubblewrap",
    **_,
) -> RewardOutput:
    """1.0 when the completion's code passes its ``tests`` (python asserts; else the ``answer`` column) in the
    sandbox, else 0.0. ``sandbox``: ``bubblewrap`` (else the reward raises) or ``rlimits-only``, the weaker opt-out."""
    require_sandbox(sandbox)
    per_completion_tests = _tests_per_completion(len(completions), tests, answer)
    codes = [extract_code(text) for text in completions]
    parsed = [code is not None and compiles(code) for code in codes]

    def score(i: int) -> float:
        if not parsed[i]:
            return 0.0
        ok = passes(codes[i], per_completion_tests[i], timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox)
        return 1.0 if ok else 0.0

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        scores = list(pool.map(score, range(len(completions))))
    return RewardOutput(scores, parsed)


def require_sandbox(sandbox: str) -> None:
    """Raise RewardError (the stage stops, never a silent zero) if the sandbox cannot run, before any completion."""
    if sandbox not in ISOLATION_MODES:
        raise RewardError(f"code_tests: sandbox must be one of {', '.join(ISOLATION_MODES)}, got {sandbox!r}")
    try:
        ensure_available(sandbox)
    except SandboxUnavailable as error:
        hint = ("" if sandbox != "bubblewrap" else
                " To run model-written code without bubblewrap anyway, opt out explicitly in the pipeline: "
                "`kwargs: {sandbox: rlimits-only}` on this reward (resource limits, a throwaway dir and a "
                "scrubbed environment, but no network or filesystem isolation).")
        raise RewardError(f"code_tests refuses to run model-written code: {error}{hint}") from None


def passes(code: str, tests: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
           sandbox: str = "bubblewrap") -> bool:
    """Run ``code`` then ``tests`` in the sandbox; True only if the harness reached its end."""
    nonce = secrets.token_hex(16)
    result = run_sandboxed(
        _HARNESS,
        files={_SOLUTION_FILE: code, _TESTS_FILE: tests, _NONCE_FILE: nonce},
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        isolation=sandbox,
    )
    return result.returncode == 0 and not result.timed_out and nonce in result.stdout.splitlines()


def _tests_per_completion(n: int, tests, answer) -> list[str]:
    if tests is None:
        tests = answer
    if tests is None:
        raise ValueError("code_tests needs tests: a `tests` column, a `tests` kwarg, or the `answer` column")
    if isinstance(tests, str):
        tests = [tests] * n
    tests = list(tests)
    if len(tests) != n:
        raise ValueError(f"code_tests: {len(tests)} tests for {n} completions")
    for i, source in enumerate(tests):
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"code_tests: completion {i} has no tests (got {source!r})")
        if not compiles(source):
            raise ValueError(f"code_tests: the tests for completion {i} do not compile: {source[:200]!r}")
    return tests
