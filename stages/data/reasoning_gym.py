"""reasoning-gym tasks: their records, their answer formats, and the ``reasoning_gym`` reward (docs/algorithms.md)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import random
import re
from typing import Any

from stages.data.specs import DataError, ReasoningGymData
from stages.rewards.spec import RewardError, RewardOutput

INSTALL_HINT = ("reasoning-gym is not installed; it is an optional extra: pip install reasoning-gym "
                "(or pip install 'posttrain[reasoning]')")

DEFAULT_INSTRUCTIONS = {
    "answer_tags": "Give only the final answer, inside <answer></answer> tags.",
    "boxed": "Give only the final answer, inside \\boxed{}.",
    "whole": "Reply with the final answer only, nothing else.",
}


def _package():
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(INSTALL_HINT) from None
    return reasoning_gym


def reasoning_gym_version() -> str:
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def task_names() -> list[str]:
    """Every task reasoning-gym registers; raises DataError when it is not installed."""
    _package()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int):
    return _package().create_dataset(name, seed=seed, size=size, **json.loads(config_json))


@functools.lru_cache(maxsize=4096)
def _entry(name: str, config_json: str, seed: int, size: int, index: int) -> dict:
    return _dataset(name, config_json, seed, size)[index]


def _config_json(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def config_problem(spec: ReasoningGymData) -> str | None:
    """What reasoning-gym says against the task's config, or None (from its first entry only: cheap for any n)."""
    try:
        _entry(spec.reasoning_gym, _config_json(spec.config), spec.seed, spec.n, 0)
    except (TypeError, AssertionError, ValueError, KeyError) as error:
        message = f"reasoning-gym refuses this config for {spec.reasoning_gym}: {type(error).__name__}: {error}"
        if isinstance(error, TypeError):
            from reasoning_gym.factory import DATASETS

            config_cls = DATASETS[spec.reasoning_gym][1]
            keys = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
            message += f"; its config keys: {', '.join(keys)}"
        return message
    return None


def demonstration(answer: str, answer_format: str) -> str:
    """The reference answer written the way the model is asked to give it."""
    if answer_format == "answer_tags":
        return f"<answer>{answer}</answer>"
    if answer_format == "boxed":
        return f"\\boxed{{{answer}}}"
    return answer


_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance, stripped."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract(text: str, answer_format: str) -> str | None:
    """The answer in a reply, or None where it holds none in that format (empty tags or box: a format error)."""
    if answer_format == "answer_tags":
        from reasoning_gym.utils import extract_answer

        found = extract_answer(text, tag_name="answer")
    elif answer_format == "boxed":
        found = last_boxed(text)
    elif answer_format == "whole":
        found = text.strip()
    else:
        raise RewardError(f"unknown answer_format {answer_format!r}; one of {', '.join(DEFAULT_INSTRUCTIONS)}")
    return found if found and found.strip() else None


def _answer_text(entry: dict) -> str | None:
    return None if entry["answer"] is None else str(entry["answer"])


def wrong_answer(answer: str, dataset, index: int, rng: random.Random) -> str:
    """An imperfect demonstrator's answer, never the right one: a number off by 1 or 10, else another entry's."""
    try:
        value = int(answer)
    except ValueError:
        value = None
    if value is not None:
        return str(value + rng.choice([-10, -1, 1, 10]))
    for _ in range(32):
        other = _answer_text(dataset[rng.randrange(len(dataset))])
        if other is not None and other != answer:
            return other
    return answer + "?"  # a dataset whose entries all share one answer: still not it


def generate_reasoning_gym(spec: ReasoningGymData) -> list[dict]:
    """The dataset's canonical records: question + format instruction, the demonstration, the task."""
    dataset = _dataset(spec.reasoning_gym, _config_json(spec.config), spec.seed, spec.n)
    instruction = DEFAULT_INSTRUCTIONS[spec.answer_format] if spec.instruction is None else spec.instruction
    records = []
    slips = random.Random(f"demo-errors:{spec.seed}")
    for index in range(spec.n):
        entry = dataset[index]
        answer = _answer_text(entry)
        shown = answer
        if answer is not None and spec.demo_error_rate and slips.random() < spec.demo_error_rate:
            shown = wrong_answer(answer, dataset, index, slips)
        question = entry["question"].rstrip()
        messages = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt is not None else []
        messages.append({"role": "user", "content": f"{question}\n\n{instruction}" if instruction else question})
        if answer is not None:  # a task with no single reference answer has nothing to demonstrate
            messages.append({"role": "assistant", "content": demonstration(shown, spec.answer_format)})
        task = {"reasoning_gym": spec.reasoning_gym, "config": spec.config, "seed": spec.seed, "size": spec.n,
                "index": index, "answer_format": spec.answer_format}
        records.append({"messages": messages, "answer": answer, "task": task})
    return records


def regenerate(task: Any) -> tuple[Any, dict]:
    """(dataset, entry) named by a ``task`` dict; ValueError saying what is wrong with it."""
    if not isinstance(task, dict):
        raise ValueError(f"a task is a mapping {{reasoning_gym, config, seed, size, index}}, got {task!r}")
    unknown = sorted(set(task) - {"reasoning_gym", "config", "seed", "size", "index", "answer_format"})
    missing = [key for key in ("reasoning_gym", "size", "index") if key not in task]
    if unknown or missing:
        problems = [f"{what} {', '.join(keys)}" for what, keys in (("missing", missing), ("unknown", unknown)) if keys]
        raise ValueError(f"task {task!r}: {'; '.join(problems)}")
    size, index, seed = task["size"], task["index"], task.get("seed", 0)
    if not all(isinstance(v, int) for v in (size, index, seed)) or not 0 <= index < size:
        raise ValueError(f"task {task!r}: seed, size and index must be integers with 0 <= index < size")
    config = task.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"task {task!r}: config must be a mapping")
    names = task_names()
    if task["reasoning_gym"] not in names:
        raise ValueError(f"unknown reasoning-gym task {task['reasoning_gym']!r}")
    key = (task["reasoning_gym"], _config_json(config), seed, size)
    return _dataset(*key), _entry(*key, index)


def task_problem(task: Any) -> str | None:
    """What is wrong with a hand-written ``task`` (a reward case's), or None."""
    try:
        regenerate(task)
        if task.get("answer_format", "answer_tags") not in DEFAULT_INSTRUCTIONS:
            return f"answer_format must be one of {', '.join(DEFAULT_INSTRUCTIONS)} (got {task['answer_format']!r})"
    except DataError as error:
        return str(error)
    except (TypeError, AssertionError, ValueError, KeyError) as error:
        return f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
    return None


def reasoning_gym_answer(completions: list[str], answer: list[str | None], task: list[dict | None] | None = None,
                         binary: bool = False, **_) -> RewardOutput:
    """reasoning-gym's own ``score_answer`` on the answer extracted per the task's answer_format;
    ``binary``: 1.0 at full credit, else 0.0 (what RL should train on)."""
    if task is None or any(t is None for t in task):
        raise RewardError("the reasoning_gym reward scores reasoning_gym datasets only (`data: {reasoning_gym: "
                          "TASK, ...}`): these completions have no `task` column to regenerate their entry from")
    try:
        _package()
    except DataError as error:
        raise RewardError(str(error)) from None
    scores, parsed = [], []
    for text, reference, ref in zip(completions, answer, task):
        try:
            dataset, entry = regenerate(ref)
        except ValueError as error:
            raise RewardError(f"reasoning_gym reward: {error}") from None
        if reference is not None and _answer_text(entry) != reference:
            raise RewardError(
                f"reasoning_gym reward: the installed reasoning-gym {reasoning_gym_version()} generates different "
                f"data than the materialised dataset: entry {ref['index']} of {ref['reasoning_gym']} (seed "
                f"{ref.get('seed', 0)}) now has answer {_answer_text(entry)!r}, the dataset says {reference!r}; "
                "rebuild the dataset with this version (its cache key includes the version) or install the one "
                "it was built with")
        extracted = extract(text, ref.get("answer_format", "answer_tags"))
        try:
            score = dataset.score_answer(extracted, entry)
        except Exception:  # a few tasks' parsers raise on a malformed answer: the task could not read it
            extracted, score = None, dataset.score_answer(None, entry)
        scores.append((1.0 if score >= 1.0 else 0.0) if binary else float(score))
        parsed.append(extracted is not None)
    return RewardOutput(scores, parsed)
