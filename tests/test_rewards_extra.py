"""code_tests (model code against asserts, in the real sandbox) and math_answer (math-verify)."""

from __future__ import annotations

import threading

import pytest

from stages.rewards.scoring import score_completions
from stages.rewards.spec import RewardSpec
from stages.rewards.code_tests import code_tests, extract_code
from stages.rewards.math_answer import math_answer

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nIt adds the numbers."


# ---------------------------------------------------------------- code_tests


def test_extract_code_prefers_the_last_python_block():
    text = "```text\nnot code\n```\n```python\nx = 1\n```\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nx = 3\n```") == "x = 3\n"
    assert extract_code("x = 4") == "x = 4"
    assert extract_code("```python\nx = 5") == "x = 5"  # truncated reply, unclosed fence
    assert extract_code("   ") is None and extract_code("```python\n\n```") is None


@pytest.mark.needs_bwrap
def test_code_tests_scores_right_wrong_and_unparsable():
    completions = [
        fenced("def add(a, b):\n    return a + b"),
        fenced("def add(a, b):\n    return a - b"),
        fenced("def add(a, b) return a + b"),  # SyntaxError
        "",
        "def add(a, b):\n    return a + b",  # no fence: the whole reply is the code
    ]
    result = code_tests(completions, tests=ADD_TESTS)
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.parsed == [True, True, False, False, True]


@pytest.mark.needs_bwrap
@pytest.mark.parametrize(
    "shortcut",
    [
        "import sys\ndef add(a, b): return 0\nsys.exit(0)",
        "import os\ndef add(a, b): return 0\nos._exit(0)",
        "def add(a, b): return 0\nraise SystemExit",
        "def add(a, b): return 0\nprint('OK')\nprint('All tests passed')",
        "def add(a, b): return 0\nprint(open(__import__('sys').argv[0]).read())",  # echo the harness
        "import os\ndef add(a, b): return 0\nfor f in os.listdir('.'): print(open(f).read())",  # nonce file?
        "import os, signal\ndef add(a, b): return 0\nos.kill(os.getpid(), signal.SIGKILL)",
    ],
)
def test_shortcuts_that_skip_the_tests_do_not_pass(shortcut):
    honest = code_tests([fenced("def add(a, b): return a + b")], tests=ADD_TESTS)
    assert honest.scores == [1.0]  # same harness, same tests: the shortcut below can fail
    result = code_tests([fenced(shortcut)], tests=ADD_TESTS)
    assert result.scores == [0.0] and result.parsed == [True]


@pytest.mark.needs_bwrap
def test_the_solution_cannot_read_the_tests_from_disk():
    # Hard-coding answers from the tests file would pass; the harness deletes it first.
    cheat = "import os\nTESTS = open('tests.py').read() if os.path.exists('tests.py') else ''\n" \
            "def add(a, b):\n    return 5 if 'add(2, 3) == 5' in TESTS else -1"
    assert code_tests([fenced(cheat)], tests="assert add(2, 3) == 5").scores == [0.0]


@pytest.mark.needs_bwrap
def test_code_tests_reads_tests_from_a_column_or_the_answer_column():
    square = fenced("def square(x):\n    return x * x")
    columns = {"tests": ["assert square(3) == 9", "assert square(3) == 10"]}
    assert code_tests([square, square], **columns).scores == [1.0, 0.0]
    assert code_tests([square], answer=["assert square(4) == 16"]).scores == [1.0]
    with pytest.raises(ValueError, match="needs tests"):
        code_tests([square])


@pytest.mark.needs_bwrap
def test_code_tests_times_out_slow_solutions():
    result = code_tests([fenced("def add(a, b):\n    while True:\n        pass")], tests=ADD_TESTS, timeout_s=1)
    assert result.scores == [0.0] and result.parsed == [True]


@pytest.mark.needs_bwrap
def test_code_tests_through_the_reward_registry():
    # a limit the right answer cannot reach on a loaded machine: this test is about scoring, not time
    specs = {"tests_pass": RewardSpec(fn="stages.rewards.code_tests:code_tests", kwargs={"timeout_s": 30})}
    columns = {"answer": [ADD_TESTS, ADD_TESTS, ADD_TESTS], "prompts": [[], [], []]}
    batch = score_completions(specs, [fenced("def add(a, b): return a + b"), fenced("def add(a, b): return 0"),
                                      "```python\ndef add(\n```"], columns)
    (component,) = batch.components
    assert component.scores == [1.0, 0.0, 0.0]
    assert component.parsed == [True, True, False]
    assert component.errors == [] and batch.total == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------- math_answer


def test_math_answer_equal_values_in_different_forms():
    result = math_answer(
        ["so the answer is \\boxed{\\frac{1}{2}}", "The answer is $0.5$.", "\\boxed{72}", "I get 71"],
        answer=["0.5", "\\frac{1}{2}", "72", "72"],
    )
    assert result.scores == [1.0, 1.0, 1.0, 0.0]
    assert result.parsed == [True, True, True, True]


def test_math_answer_unparsable_is_not_wrong():
    result = math_answer(["no idea", "\\boxed{3}"], answer=["0.5", "0.5"])
    assert result.scores == [0.0, 0.0]
    assert result.parsed == [False, True]


def test_math_answer_bare_reference_is_read_as_latex():
    result = math_answer(["the interval is $(1, 2)$", "\\boxed{2}"], answer=["(1, 2)", "(1, 2)"])
    assert result.scores == [1.0, 0.0]


def test_math_answer_unparsable_reference_is_an_error():
    with pytest.raises(ValueError, match="reference answer"):
        math_answer(["\\boxed{1}"], answer=[None])


def test_math_answer_works_off_the_main_thread():
    # math-verify's signal-based timeouts raise in worker threads (where Prefect runs tasks).
    results = []
    thread = threading.Thread(target=lambda: results.append(math_answer(["\\boxed{\\frac{1}{2}}"], answer=["0.5"])))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "math_answer did not return within 120 s in a worker thread"
    assert results and results[0].scores == [1.0]


def test_math_answer_through_the_reward_registry():
    specs = {"math": RewardSpec(fn="stages.rewards.math_answer:math_answer")}
    columns = {"answer": ["0.5", "0.5", None], "prompts": [[], [], []]}
    batch = score_completions(specs, ["\\boxed{\\frac{1}{2}}", "no idea", "\\boxed{1}"], columns)
    (component,) = batch.components
    assert component.scores == [1.0, 0.0, 0.0]
    assert component.parsed == [True, False, False]
    assert [index for index, _ in component.errors] == [2]  # bad reference: counted, not silent


def test_math_answer_parses_a_bare_completion_like_a_bare_reference():
    """A completion written exactly like the reference scores 1; "2x" is 2x, not the number 2."""
    result = math_answer(["x^2+1", "\\sqrt{2}", "\\pi", "2x", "2x", "x = 5", "I think it is 3"],
                         answer=["x^2+1", "\\sqrt{2}", "\\pi", "2", "2x", "5", "3"])
    assert result.scores == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert result.parsed == [True] * 7
