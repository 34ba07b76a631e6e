"""Failure sets as training data: what round r of an ``iterate:`` pipeline trains on. Design: docs/algorithms.md."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

from stages.data.sources import json_line

FROM_FAILURES = "failure_set"  # the ``origin`` of a record drawn from the failure set


class FailureSetError(ValueError):
    """A failure set that cannot become training data (unreadable, or no answer to demonstrate)."""


def read_failures(path: Path) -> list[dict]:
    cases = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            case = json_line(line, f"{path}:{line_no}", FailureSetError)
            if not isinstance(case, dict) or not isinstance(case.get("messages"), list) or not case["messages"]:
                raise FailureSetError(f"{path}:{line_no}: a failure case needs its prompt `messages`")
            cases.append(case)
    return cases


def failure_training_records(cases: list[dict], demonstrations: bool, where: str = "failure set") -> list[dict]:
    """Records of failure cases: the prompt alone (rl), or with the expected answer replied (``demonstrations``)."""
    records = []
    for i, case in enumerate(cases, start=1):
        prompt = [m for m in case["messages"]]
        if prompt and prompt[-1].get("role") == "assistant":  # never train on a recorded attempt
            prompt = prompt[:-1]
        answer = case.get("answer")
        answer = None if answer is None else str(answer)
        task = case.get("task")
        if demonstrations:
            if answer is None:
                raise FailureSetError(f"{where}: case {i} has no expected answer, so no demonstration can be built "
                                      "for an sft stage; iterate an rl stage, or give the probe data answers")
            reply = answer
            if isinstance(task, dict) and "answer_format" in task:
                from stages.data.reasoning_gym import demonstration

                reply = demonstration(answer, task["answer_format"])
            messages = [*prompt, {"role": "assistant", "content": reply}]
        else:
            messages = prompt
        record = {"messages": messages, "answer": answer, "origin": FROM_FAILURES}
        records.append(record if task is None else {**record, "task": task})
    return records


def mix_records(original: list[dict], from_failures: list[dict], mix: float,
                seed: str | int) -> tuple[list[dict], dict[str, int]]:
    """(the round's training records, counts): ``mix`` of ``len(original)`` slots from failures."""
    total = len(original)
    rng = random.Random(seed)
    if not from_failures or mix <= 0 or total == 0:
        return list(original), {"failure_prompts": len(from_failures), "failure_examples": 0,
                                "original_examples": total}
    n_failures = min(total, max(1, round(mix * total)))
    order = list(from_failures)
    rng.shuffle(order)
    failures_B = [order[i % len(order)] for i in range(n_failures)]
    original_B = rng.sample(original, total - n_failures)
    records = failures_B + original_B
    rng.shuffle(records)
    return records, {"failure_prompts": len(from_failures), "failure_examples": n_failures,
                     "original_examples": total - n_failures}


def write_records(records: list[dict], target: Path) -> Path:
    """Write JSONL atomically (a reader never sees half a file); return ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".writing-", suffix=".jsonl", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    os.replace(tmp, target)
    return target
