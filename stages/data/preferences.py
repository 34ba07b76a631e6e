"""Preference data: prompt / chosen / rejected pairs for reward-model training and DPO. Design: docs/algorithms.md."""

from __future__ import annotations

import random

from stages.data.specs import ArithmeticPreferenceData, DataError
from stages.rewards.builtin_rewards import exact_answer

FIELDS = ("prompt", "chosen", "rejected")

# Replies the verifier cannot parse: words, hedges, echoes, trailing junk, nothing at all.
MALFORMED = (
    lambda a, b, op, ans: "",
    lambda a, b, op, ans: "?",
    lambda a, b, op, ans: f"{a}{op}{b}",
    lambda a, b, op, ans: f"{ans}?",
    lambda a, b, op, ans: f"{ans - 1} {ans}",
    lambda a, b, op, ans: f"{ans} or {ans + 1}",
    lambda a, b, op, ans: "What is",
    lambda a, b, op, ans: f"={ans}",
)


def _messages(value, field: str, default_role: str, where: str) -> list[dict]:
    """A plain string or a list of {role, content} messages, as messages; refuses empty ones."""
    if value is None:
        raise DataError(f"{where}: missing field `{field}` (a preference record needs prompt, chosen and rejected)")
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: `{field}` is empty")
        return [{"role": default_role, "content": value}]
    if isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        if not value or not any(m["content"].strip() for m in value):
            raise DataError(f"{where}: `{field}` is empty")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: `{field}` must be a string or a list of {{role, content}} messages, "
                    f"got {type(value).__name__}")


def normalise_preference(raw, where: str) -> dict:
    """One file record -> the canonical pair; raises DataError naming ``where`` (file:line)."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    missing = [f for f in FIELDS if raw.get(f) is None]
    if missing:
        raise DataError(f"{where}: missing field{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(f'`{f}`' for f in missing)} (a preference record needs prompt, chosen and "
                        "rejected)")
    record = {
        "prompt": _messages(raw["prompt"], "prompt", "user", where),
        "chosen": _messages(raw["chosen"], "chosen", "assistant", where),
        "rejected": _messages(raw["rejected"], "rejected", "assistant", where),
    }
    if record["chosen"] == record["rejected"]:
        raise DataError(f"{where}: `chosen` and `rejected` are identical; a pair must prefer one reply to another")
    answer = raw.get("answer")
    record["answer"] = None if answer is None else str(answer)
    return record


_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _rejected_reply(rng: random.Random, a: int, b: int, op: str, answer: int, spec: ArithmeticPreferenceData) -> str:
    draw = rng.random()
    if draw < spec.near_miss_rate:
        return str(answer + rng.choice([-2, -1, 1, 2]))
    if draw < spec.near_miss_rate + spec.malformed_rate:
        return rng.choice(MALFORMED)(a, b, op, answer)
    far = answer
    while abs(far - answer) <= 2:
        far = rng.randint(min(0, answer) - 10, max(answer, 2 * spec.max_operand) + 10)
    return str(far)


def generate_arithmetic_preferences(spec: ArithmeticPreferenceData) -> list[dict]:
    """``spec.n`` pairs: a reply the verifier scores correct, preferred to one it scores wrong or cannot parse."""
    rng = random.Random(spec.seed)
    records = []
    while len(records) < spec.n:
        a = rng.randint(spec.min_operand, spec.max_operand)
        b = rng.randint(spec.min_operand, spec.max_operand)
        op = rng.choice(spec.ops)
        answer = _OPS[op](a, b)
        candidates = [str(answer), _rejected_reply(rng, a, b, op, answer, spec)]
        verdict = exact_answer(candidates, [str(answer)] * 2)
        if verdict.scores != [1.0, 0.0]:  # the verifier decides; a draw it does not separate is skipped
            continue
        records.append({
            "prompt": [{"role": "user", "content": f"What is {a}{op}{b}?"}],
            "chosen": [{"role": "assistant", "content": candidates[0]}],
            "rejected": [{"role": "assistant", "content": candidates[1]}],
            "answer": str(answer),
        })
    return records


def split_heldout(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, heldout): a seeded shuffle, ``fraction`` of the pairs held out (at least one when > 0)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_heldout = 0 if fraction <= 0 else max(1, round(len(records) * fraction))
    if n_heldout >= len(records):
        raise ValueError(f"heldout_fraction {fraction} leaves no pairs to train on ({len(records)} pairs)")
    heldout = [records[i] for i in order[:n_heldout]]
    train = [records[i] for i in order[n_heldout:]]
    return train, heldout


def trl_dataset(records: list[dict]):
    """A ``datasets.Dataset`` of conversational pairs (prompt / chosen / rejected), as TRL takes them."""
    from datasets import Dataset

    return Dataset.from_list([{f: r[f] for f in FIELDS} for r in records])


def check_preference_records(records: list[dict], where: str) -> None:
    """A stage given conversations where it needs pairs fails with what to change."""
    if records and not all(f in records[0] for f in FIELDS):
        raise DataError(f"{where}: not a preference dataset (records need prompt, chosen and rejected); use "
                        "`generator: arithmetic_preferences` or a file with `records: preferences`")
