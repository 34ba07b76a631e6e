"""Datasets: built-in generators and local JSONL / parquet files, in one canonical form.

Every dataset is materialised to a JSONL file of records
``{"messages": [{"role": ..., "content": ...}, ...], "answer": str | None}``: the
conversation (ending with the assistant's demonstration when there is one) and the
reference answer a verifier checks against. Training stages read ``messages``; evaluation
drops a final assistant turn and samples its own. Preference datasets (``records:
preferences`` files and the ``arithmetic_preferences`` generator) are materialised as
``{"prompt": [...], "chosen": [...], "rejected": [...], "answer": ...}`` instead
(stages/preferences.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

Role = Literal["train", "probe", "heldout"]
ROLE_HELP = (
    "What the dataset is for: 'train' feeds training stages, 'probe' is evaluated to collect "
    "failure cases, 'heldout' is only ever evaluated (the validator refuses it in training)."
)


class ArithmeticData(BaseModel):
    """Generated arithmetic questions: 'What is a+b?' with the exact answer."""

    model_config = ConfigDict(extra="forbid")

    generator: Literal["arithmetic"] = Field(description="Built-in generator of arithmetic questions.")
    role: Role = Field(description=ROLE_HELP)
    n: int = Field(ge=1, le=1_000_000, description="Number of examples.")
    seed: int = Field(0, description="Seed of the generator; different seeds draw different samples.")
    min_operand: int = Field(0, ge=0, description="Smallest operand.")
    max_operand: int = Field(9, ge=0, le=10**9, description="Largest operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    demo_error_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of demonstrations whose assistant answer is wrong (an imperfect "
        "demonstrator); the reference `answer` stays correct.",
    )

    @model_validator(mode="after")
    def _operand_range(self):
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must be <= max_operand ({self.max_operand})"
            )
        return self


class FileData(BaseModel):
    """Local JSONL or parquet file with `messages` (chat turns) or `prompt` + `completion`/`answer`."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="JSONL or parquet file; relative paths are relative to the pipeline file.")
    role: Role = Field(description=ROLE_HELP)
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="File format; auto uses the suffix.")
    limit: int | None = Field(None, ge=1, description="Use only the first `limit` records.")
    records: Literal["conversations", "preferences"] = Field(
        "conversations",
        description="What each record is: `conversations` (messages, or prompt + completion) or `preferences` "
        "(prompt / chosen / rejected pairs, plain strings or chat messages) for reward_model and dpo stages.",
    )


class ArithmeticPreferenceData(BaseModel):
    """Generated preference pairs for the arithmetic world, labelled by the exact-answer verifier:
    a correct answer is preferred to a wrong one (a near miss, a far miss or a malformed reply)."""

    model_config = ConfigDict(extra="forbid")

    generator: Literal["arithmetic_preferences"] = Field(description="Built-in generator of preference pairs.")
    role: Role = Field(description=ROLE_HELP)
    n: int = Field(ge=1, le=1_000_000, description="Number of pairs.")
    seed: int = Field(0, description="Seed of the generator; different seeds draw different samples.")
    min_operand: int = Field(0, ge=0, description="Smallest operand.")
    max_operand: int = Field(9, ge=0, le=10**9, description="Largest operand.")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    near_miss_rate: float = Field(
        0.6, ge=0.0, le=1.0, description="Share of rejected answers that are off by 1 or 2 (the errors an "
        "imperfect policy makes)."
    )
    malformed_rate: float = Field(
        0.2, ge=0.0, le=1.0, description="Share of rejected replies that are not a bare number at all "
        "(the rest are numbers far from the answer)."
    )

    @model_validator(mode="after")
    def _rates_and_range(self):
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({self.min_operand}) must be <= max_operand ({self.max_operand})")
        if self.near_miss_rate + self.malformed_rate > 1.0:
            raise ValueError(f"near_miss_rate ({self.near_miss_rate}) + malformed_rate ({self.malformed_rate}) "
                             "must be <= 1")
        return self


def _data_source(value) -> str | None:
    if isinstance(value, ArithmeticData):
        return "generator"
    if isinstance(value, ArithmeticPreferenceData):
        return "preference_generator"
    if isinstance(value, FileData):
        return "path"
    if isinstance(value, dict):
        if value.get("generator") == "arithmetic_preferences":
            return "preference_generator"
        for key in ("generator", "path"):
            if key in value:
                return key
    return None


DataSpec = Annotated[
    Union[
        Annotated[ArithmeticData, Tag("generator")],
        Annotated[ArithmeticPreferenceData, Tag("preference_generator")],
        Annotated[FileData, Tag("path")],
    ],
    Discriminator(
        _data_source,
        custom_error_type="data_source",
        custom_error_message="a dataset needs a source: `generator: arithmetic`, "
        "`generator: arithmetic_preferences` or `path: FILE`",
    ),
]


def holds_preferences(spec) -> bool:
    """Whether a dataset is preference pairs (for reward_model / dpo) rather than conversations."""
    return isinstance(spec, ArithmeticPreferenceData) or (isinstance(spec, FileData) and spec.records == "preferences")


class DataError(ValueError):
    """A dataset file that cannot be read, with the file and line it went wrong at."""


# ---------------------------------------------------------------- generators

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def generate_arithmetic(spec: ArithmeticData) -> list[dict]:
    rng = random.Random(spec.seed)
    records = []
    for _ in range(spec.n):
        a = rng.randint(spec.min_operand, spec.max_operand)
        b = rng.randint(spec.min_operand, spec.max_operand)
        op = rng.choice(spec.ops)
        answer = _OPS[op](a, b)
        shown = answer
        if rng.random() < spec.demo_error_rate:
            shown = answer + rng.choice([-2, -1, 1, 2])
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a}{op}{b}?"},
                    {"role": "assistant", "content": str(shown)},
                ],
                "answer": str(answer),
            }
        )
    return records


# ---------------------------------------------------------------- files


def _normalise_record(raw, where: str) -> dict:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    answer = raw.get("answer")
    answer = None if answer is None else str(answer)
    if "messages" in raw:
        messages = raw["messages"]
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise DataError(f"{where}: `messages` must be a non-empty list of {{role, content}} strings")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "answer": answer}
    if isinstance(raw.get("prompt"), str):
        messages = [{"role": "user", "content": raw["prompt"]}]
        completion = raw.get("completion")
        if completion is not None:
            if not isinstance(completion, str):
                raise DataError(f"{where}: `completion` must be a string")
            messages.append({"role": "assistant", "content": completion})
        return {"messages": messages, "answer": answer}
    raise DataError(f"{where}: a record needs `messages` (list of turns) or `prompt` (string)")


def read_jsonl(path: Path, limit: int | None = None, normalise=_normalise_record) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_no}: not valid JSON ({error.msg})") from None
            records.append(normalise(raw, f"{path}:{line_no}"))
            if limit and len(records) >= limit:
                break
    return records


def read_parquet(path: Path, limit: int | None = None, normalise=_normalise_record) -> list[dict]:
    from datasets import Dataset

    try:
        table = Dataset.from_parquet(str(path))
    except Exception as error:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({error})") from None
    rows = table.select(range(min(limit, len(table)))) if limit else table
    return [normalise(row, f"{path}: row {i}") for i, row in enumerate(rows)]


def resolve_path(spec: FileData, base_dir: Path) -> Path:
    path = Path(spec.path).expanduser()
    return path if path.is_absolute() else (base_dir / path)


def load_records(spec, base_dir: Path) -> list[dict]:
    """The dataset's canonical records; raises DataError naming the file (and line)."""
    if isinstance(spec, ArithmeticData):
        return generate_arithmetic(spec)
    if isinstance(spec, ArithmeticPreferenceData):
        from stages.preferences import generate_arithmetic_preferences

        return generate_arithmetic_preferences(spec)
    path = resolve_path(spec, base_dir)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    fmt = spec.format if spec.format != "auto" else ("parquet" if path.suffix == ".parquet" else "jsonl")
    normalise = _normalise_record
    if spec.records == "preferences":
        from stages.preferences import normalise_preference

        normalise = normalise_preference
    records = read_parquet(path, spec.limit, normalise) if fmt == "parquet" else read_jsonl(path, spec.limit, normalise)
    if not records:
        raise DataError(f"data file {str(path)!r} holds no records")
    return records


def data_key(spec, base_dir: Path) -> str:
    """Content key of a dataset: its spec, plus the file's bytes for file datasets."""
    digest = hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode())
    if isinstance(spec, FileData):
        path = resolve_path(spec, base_dir)
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def materialize(spec, base_dir: Path, cache_dir: Path) -> Path:
    """Write the dataset's canonical JSONL once (atomically) and return its path."""
    target = cache_dir / f"{data_key(spec, base_dir)}.jsonl"
    if target.exists():
        return target
    records = load_records(spec, base_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".writing-", suffix=".jsonl", dir=cache_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    os.replace(tmp, target)
    return target


def read_materialized(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def prompt_messages(record: dict) -> list[dict]:
    """The conversation up to where the model should answer (drops a final assistant turn)."""
    messages = record["messages"]
    return messages[:-1] if messages[-1]["role"] == "assistant" else messages
