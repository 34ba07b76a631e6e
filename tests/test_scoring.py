"""The one scorer (stages/rewards/scoring.py) and rewards under a wall-clock bound (stages/rewards/worker.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from stages.rewards.scoring import reward_columns, score_component
from stages.rewards.spec import RewardError, RewardSpec
from stages.rewards.scoring import RewardErrorPolicy, Scorer

# A power tower: math-verify evaluates it as a big-integer power inside one C call, which holds the GIL
# for minutes (in a thread it also freezes every other thread of the process) and ignores signal.alarm.
HANGING = "9^{9^{9^{9}}}"
BOUND_S = 2.0


def in_a_worker_thread(fn):
    """``fn()`` in a thread other than the main one, as Prefect runs a stage: (its result, wall seconds)."""
    out = {}

    def target():
        started = time.perf_counter()
        try:
            out["result"] = fn()
        except BaseException as error:  # handed back to the test
            out["error"] = error
        out["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the scoring call never returned"
    if "error" in out:
        raise out["error"]
    return out["result"], out["seconds"]


def test_a_hanging_math_expression_is_a_reward_error_within_the_bound_in_any_thread():
    """``max_seconds`` bounds the reward's own work on a chunk, from the moment the worker holds the reward: a new
    worker's start and its import of math-verify and SymPy (seconds on a loaded machine) are not counted, so the
    right answers of the chunk are scored and only the hanging expression is an error."""
    spec = RewardSpec(fn="math_answer", max_seconds=BOUND_S)
    texts = ["\\boxed{2}", HANGING, "3", "no idea"]
    columns = reward_columns([{"answer": a} for a in ("2", "1", "3", "4")], [[]] * 4, 1)
    scored, seconds = in_a_worker_thread(lambda: score_component("math", spec, texts, columns))
    # the chunk of 4 passes the bound, then each completion alone: only the hanging one passes it again
    assert seconds < 4 * BOUND_S + 10, seconds
    assert scored.scores == [1.0, 0.0, 1.0, 0.0] and scored.parsed == [True, False, True, False]
    assert [i for i, _ in scored.errors] == [1]
    assert "took longer than 2 s" in scored.errors[0][1]
    print(f"hanging expression: bound {BOUND_S} s, scored in {seconds:.1f} s")


def test_the_fail_policy_names_the_completion_that_passed_the_bound():
    specs = {"math": RewardSpec(fn="math_answer", max_seconds=BOUND_S)}
    scorer = Scorer(specs, RewardErrorPolicy("fail", 0))
    columns = reward_columns([{"answer": "1"}], [[]], 1)
    with pytest.raises(RuntimeError, match=r"reward 'math' raised took longer than 2 s .* on completion "
                                           r"'9\^\{9\^\{9\^\{9\}\}\}' \(1 reward errors so far, max_reward_errors is 0\)"):
        in_a_worker_thread(lambda: scorer.score([HANGING], columns))
    # the worker was replaced: the next batch is scored as usual
    assert scorer.score(["\\boxed{1}"], columns).total == [1.0]


def test_the_score_policy_counts_errors_across_batches_and_goes_on():
    policy = RewardErrorPolicy("score", 0)
    scorer = Scorer({"boom": RewardSpec(fn="test_scoring:raises_on_odd")}, policy)
    for _ in range(2):
        scored = scorer.score(["a", "bb", "ccc"], reward_columns([{}] * 3, [[]] * 3, 1))
        assert scored.total == [1.0, 0.0, 1.0]
    assert scorer.errors == 2
    fail = Scorer({"boom": RewardSpec(fn="test_scoring:raises_on_odd")}, RewardErrorPolicy("fail", 1))
    fail.score(["bb"], reward_columns([{}], [[]], 1))  # 1 error: within max_reward_errors 1
    with pytest.raises(RuntimeError, match=r"raised ValueError: odd length 2 on completion 'dd' \(2 reward errors"):
        fail.score(["dd"], reward_columns([{}], [[]], 1))


def raises_on_odd(completions, **_):
    for text in completions:
        if len(text) % 2 == 0:
            raise ValueError(f"odd length {len(text)}")
    return [1.0] * len(completions)


def broken_contract(completions, **_):
    raise RewardError("this reward is wired wrong")


def test_a_broken_reward_in_the_worker_is_a_reward_error_not_a_sample_error():
    with pytest.raises(RewardError, match="wired wrong"):
        score_component("broken", RewardSpec(fn="test_scoring:broken_contract"), ["x"], {"answer": [None]})


def test_columns_carry_the_task_only_for_generated_tasks():
    plain = reward_columns([{"answer": "3"}, {"answer": "4"}], ["p", "q"], 2)
    assert plain == {"answer": ["3", "3", "4", "4"], "prompts": ["p", "p", "q", "q"]}
    tasked = reward_columns([{"answer": "3", "task": {"index": 0}}, {"answer": "4"}], ["p", "q"], 1)
    assert tasked["task"] == [{"index": 0}, None]


def test_max_seconds_is_refused_on_rewards_the_stage_runs_itself_and_never_hashed():
    from flows.spec.validate import not_applicable

    [(where, message)] = not_applicable(RewardSpec(fn="judge", judge_fn="judges:always_yes", rubric="{completion}",
                                                   max_seconds=5))
    assert where == ("max_seconds",) and "judge and environment rewards run in the stage's own process" in message
    assert not_applicable(RewardSpec(fn="exact_answer", max_seconds=5)) == []
    assert RewardSpec(fn="exact_answer", max_seconds=5).identity() == RewardSpec(fn="exact_answer").identity()


WORKER_THEN_DIE = """
import os, signal, sys
from stages.rewards.scoring import score_component
from stages.rewards.spec import RewardSpec
from stages.rewards.worker import worker
score_component("m", RewardSpec(fn="exact_answer"), ["3"], {"answer": ["3"]})
print(worker().process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_worker_dies_with_its_stage_process_even_on_kill_9():
    child = subprocess.run([sys.executable, "-c", WORKER_THEN_DIE], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    pid = int(child.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), f"reward worker {pid} outlived its stage process"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def reads_the_environment(completions, **_):
    import os

    return [float(os.environ.get("POSTTRAIN_TEST_REWARD_VALUE", "-1"))] * len(completions)


def test_the_worker_reads_the_stage_process_environment_as_it_is_at_each_call(monkeypatch):
    spec = RewardSpec(fn="test_scoring:reads_the_environment")
    assert score_component("env", spec, ["x"], {"answer": [None]}).scores == [-1.0]
    monkeypatch.setenv("POSTTRAIN_TEST_REWARD_VALUE", "0.5")  # set after the worker started
    assert score_component("env", spec, ["x"], {"answer": [None]}).scores == [0.5]
