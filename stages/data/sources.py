"""Datasets: built-in generators and local JSONL / parquet files, in one canonical form (docs/algorithms.md)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from pathlib import Path

from stages.data.specs import (  # the declarations, read here and by flows/spec/loading.py
    ArithmeticData,
    ArithmeticPreferenceData,
    DataError,
    DataSpec,
    FileData,
    HubData,
    MixtureData,
    ReasoningGymData,
    holds_preferences,
)

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def generate_arithmetic(spec: ArithmeticData) -> list[dict]:
    if spec.generator == "arithmetic_chain":
        return generate_chains(spec)
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
        question = {"role": "user", "content": f"What is {a}{op}{b}?"}
        if spec.generator == "arithmetic_calculator":
            turns = [{"role": "assistant", "content": f'<tool_call>calculator("{a}{op}{b}")</tool_call>'},
                     {"role": "tool", "name": "calculator", "content": str(answer)}]
        else:
            turns = []
        records.append({"messages": [question, *turns, {"role": "assistant", "content": str(shown)}],
                        "answer": str(answer)})
    return records


def generate_chains(spec: ArithmeticData) -> list[dict]:
    """Chains of ``spec.terms`` numbers computed step by step ("12+5=17, 17+8=25"); with ``demo_error_rate``
    one step is off by 1 or 2, carried on (a wrong answer) or not (a right answer through a wrong step)."""
    rng = random.Random(spec.seed)
    records = []
    for _ in range(spec.n):
        numbers = [rng.randint(spec.min_operand, spec.max_operand) for _ in range(spec.terms)]
        ops = [rng.choice(spec.ops) for _ in range(spec.terms - 1)]
        wrong_at, carry_wrong, slip = None, False, 0
        if rng.random() < spec.demo_error_rate:
            wrong_at, carry_wrong, slip = rng.randrange(len(ops)), rng.random() < 0.5, rng.choice([-2, -1, 1, 2])
        running, answer, steps = numbers[0], numbers[0], []
        for i, (op, b) in enumerate(zip(ops, numbers[1:])):
            result = _OPS[op](running, b)
            answer = _OPS[op](answer, b)
            written = result + slip if i == wrong_at else result
            steps.append(f"{running}{op}{b}={written}")
            running = written if carry_wrong else result
        chain = str(numbers[0]) + "".join(f"{op}{b}" for op, b in zip(ops, numbers[1:]))
        question = {"role": "user", "content": f"Compute {chain} step by step, writing each running result "
                                               "(a+b=c), separated by commas."}
        records.append({"messages": [question, {"role": "assistant", "content": ", ".join(steps)}],
                        "answer": str(answer)})
    return records



def normalise_record(raw, where: str) -> dict:
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


def read_jsonl(path: Path, limit: int | None = None, normalise=normalise_record) -> list[dict]:
    return [record for _, record in located_jsonl(path, limit, normalise)]


def json_line(line: str, where: str, error: type[ValueError] = DataError):
    """The JSON value of one line of a JSONL file; ``error`` names ``where`` (``file:line``) when it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as caught:
        raise error(f"{where}: not valid JSON ({caught.msg})") from None


def located_jsonl(path: Path, limit: int | None = None, normalise=normalise_record) -> list[tuple[str, dict]]:
    """(``file:line``, record) for every record of a JSONL file; DataError names the line that is wrong."""
    records = []
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise DataError(f"data file {str(path)!r} cannot be read ({error.strerror or error})") from None
    with handle:
        for line_no, data in enumerate(handle, start=1):
            try:
                line = data.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{line_no}: not utf-8 text (byte 0x{data[error.start]:02x} at column "
                                f"{error.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                raw = json_line(line, f"{path}:{line_no}")
            except RecursionError:
                raise DataError(f"{path}:{line_no}: JSON nested too deeply to be a record") from None
            records.append((f"{path}:{line_no}", normalise(raw, f"{path}:{line_no}")))
            if limit and len(records) >= limit:
                break
    return records


def read_parquet(path: Path, limit: int | None = None, normalise=normalise_record) -> list[dict]:
    return [record for _, record in located_parquet(path, limit, normalise)]


def located_parquet(path: Path, limit: int | None = None, normalise=normalise_record) -> list[tuple[str, dict]]:
    from datasets import Dataset

    try:
        table = Dataset.from_parquet(str(path))
    except Exception as error:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({error})") from None
    rows = table.select(range(min(limit, len(table)))) if limit else table
    return [(f"{path}: row {i}", normalise(row, f"{path}: row {i}")) for i, row in enumerate(rows)]


def resolve_path(spec: FileData, base_dir: Path) -> Path:
    path = Path(spec.path).expanduser()
    return path if path.is_absolute() else (base_dir / path)


def mix_datasets(spec: MixtureData, sources: dict[str, list[dict]]) -> tuple[list[dict], dict[str, int]]:
    """(records, realised count per source), drawn with the declared probabilities, each source shuffled."""
    empty = [name for name in spec.mixture if not sources.get(name)]
    if empty:
        raise DataError(f"mixture component(s) {', '.join(empty)} hold no records")
    rng = random.Random(f"mixture:{spec.seed}")
    names = list(spec.mixture)
    picks = rng.choices(names, weights=[spec.mixture[name] for name in names], k=spec.n)
    orders: dict[str, list[dict]] = {name: [] for name in names}
    records = []
    for name in picks:
        if not orders[name]:
            orders[name] = list(sources[name])
            rng.shuffle(orders[name])
        records.append(orders[name].pop())
    return records, {name: picks.count(name) for name in names}


def load_records(spec, base_dir: Path, datasets: dict | None = None) -> list[dict]:
    """The dataset's canonical records (``datasets``, by name, for a mixture); DataError names file and line."""
    if isinstance(spec, MixtureData):
        sources = {name: load_records(_component(spec, name, datasets), base_dir, datasets) for name in spec.mixture}
        return mix_datasets(spec, sources)[0]
    if isinstance(spec, ArithmeticData):
        return generate_arithmetic(spec)
    if isinstance(spec, ArithmeticPreferenceData):
        from stages.data.preferences import generate_arithmetic_preferences

        return generate_arithmetic_preferences(spec)
    if isinstance(spec, ReasoningGymData):
        from stages.data.reasoning_gym import generate_reasoning_gym

        return generate_reasoning_gym(spec)
    return [record for _, record in located_file_records(spec, base_dir)]


def located_file_records(spec: FileData | HubData, base_dir: Path) -> list[tuple[str, dict]]:
    """(where, canonical record) for a dataset read from files or the hub; DataError names what is wrong."""
    if isinstance(spec, HubData):
        from stages.data.hub import located_hub_records

        return located_hub_records(spec, base_dir, normalise_record)
    path = resolve_path(spec, base_dir)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    fmt = spec.format if spec.format != "auto" else ("parquet" if path.suffix == ".parquet" else "jsonl")
    normalise = normalise_record
    if spec.records == "preferences":
        from stages.data.preferences import normalise_preference

        normalise = normalise_preference
    elif spec.records == "steps":
        normalise = normalise_step_record
    read = located_parquet if fmt == "parquet" else located_jsonl
    records = read(path, spec.limit, normalise)
    if not records:
        raise DataError(f"data file {str(path)!r} holds no records")
    return records


def normalise_step_record(raw, where: str) -> dict:
    """A step-rated record (PRM800K's shape) as a conversation: the reply its steps, one a line, ``step_ratings``."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    prompt, steps, ratings = raw.get("prompt"), raw.get("steps"), raw.get("ratings")
    if not isinstance(prompt, str):
        raise DataError(f"{where}: a step-rated record needs `prompt` (a string)")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s.strip() for s in steps):
        raise DataError(f"{where}: `steps` must be a non-empty list of non-empty strings")
    broken = [i for i, s in enumerate(steps) if "\n" in s.strip()]
    if broken:
        raise DataError(f"{where}: step {broken[0]} holds a line break; each step is one line (the steps are "
                        "joined one per line)")
    if not isinstance(ratings, list) or len(ratings) != len(steps) or not all(
            r in (-1, 0, 1) and not isinstance(r, bool) for r in ratings):
        raise DataError(f"{where}: `ratings` must hold one of -1, 0, 1 per step ({len(steps)} steps), got {ratings!r}")
    answer = raw.get("answer")
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": "\n".join(s.strip() for s in steps)}],
            "answer": None if answer is None else str(answer), "step_ratings": list(ratings)}


def prompt_text(record: dict) -> str:
    """A record's prompt as one normalised string (case and whitespace folded): what leakage is checked on."""
    turns = record["prompt"] if "prompt" in record else prompt_messages(record)
    if isinstance(turns, str):
        text = turns
    else:
        text = "\n".join(f"{t.get('role')}: {t.get('content')}" for t in turns if isinstance(t, dict))
    return " ".join(text.casefold().split())


def _component(spec: MixtureData, name: str, datasets: dict | None):
    component = (datasets or {}).get(name)
    if component is None or isinstance(component, MixtureData):
        raise DataError(f"mixture component {name!r} is not a declared dataset (or is itself a mixture)")
    return component


def data_key(spec, base_dir: Path, datasets: dict | None = None) -> str:
    """Content key of a dataset: its spec and what else decides its records (file bytes, hub commit, versions)."""
    digest = hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode())
    if isinstance(spec, MixtureData):
        digest.update(json.dumps({name: _materialized_key(_component(spec, name, datasets), base_dir, datasets)
                                  for name in spec.mixture}, sort_keys=True).encode())
    if isinstance(spec, ReasoningGymData):
        from stages.data.reasoning_gym import reasoning_gym_version

        digest.update(f"reasoning-gym {reasoning_gym_version()}".encode())
    if isinstance(spec, FileData):
        path = resolve_path(spec, base_dir)
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    if isinstance(spec, HubData):
        from stages.data.hub import identity

        digest.update(str(identity(spec, base_dir)).encode())
    return digest.hexdigest()[:16]


def _materialized_key(spec, base_dir: Path, datasets: dict | None) -> str:
    """``data_key``, extended by the keys of the datasets a spec ``exclude``s (what its file is named by)."""
    key = data_key(spec, base_dir, datasets)
    excluded = {name: datasets[name] for name in getattr(spec, "exclude", [])} if datasets else {}
    if excluded:
        key = hashlib.sha256(json.dumps([key, {n: data_key(s, base_dir) for n, s in sorted(excluded.items())}])
                             .encode()).hexdigest()[:16]
    return key


def materialize(spec, base_dir: Path, cache_dir: Path, datasets: dict | None = None) -> Path:
    """The dataset's canonical JSONL, written once (atomically); ``datasets`` (by name): for ``exclude``, mixtures."""
    if isinstance(spec, MixtureData):
        return _materialize_mixture(spec, base_dir, cache_dir, datasets)
    excluded = {name: datasets[name] for name in getattr(spec, "exclude", [])} if datasets else {}
    target = cache_dir / f"{_materialized_key(spec, base_dir, datasets)}.jsonl"
    if target.exists():
        return target
    records = load_records(spec, base_dir)
    if excluded:
        seen = {prompt_text(r) for other in excluded.values() for r in load_records(other, base_dir)}
        records = [r for r in records if prompt_text(r) not in seen]
        if not records:
            raise DataError(f"every entry's prompt appears in {', '.join(sorted(excluded))} (exclude): nothing is left")
    _write_atomic(target, "".join(json.dumps(record) + "\n" for record in records))
    return target


def _write_atomic(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".writing-", suffix=target.suffix, dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, target)


def _materialize_mixture(spec: MixtureData, base_dir: Path, cache_dir: Path, datasets: dict | None) -> Path:
    """The mixture's JSONL, and beside it ``<key>.mixture.json``: the recipe and the realised counts."""
    target = cache_dir / f"{data_key(spec, base_dir, datasets)}.jsonl"
    if target.exists() and mixture_report_path(target).exists():
        return target
    sources = {name: read_materialized(materialize(_component(spec, name, datasets), base_dir, cache_dir, datasets))
               for name in spec.mixture}
    records, counts = mix_datasets(spec, sources)
    report = {"recipe": spec.probabilities(), "n": spec.n, "seed": spec.seed, "counts": counts,
              "available": {name: len(rows) for name, rows in sources.items()}}
    _write_atomic(mixture_report_path(target), json.dumps(report, sort_keys=True))
    _write_atomic(target, "".join(json.dumps(record) + "\n" for record in records))
    return target


def mixture_report_path(materialized: Path) -> Path:
    return materialized.with_name(materialized.stem + ".mixture.json")


def read_materialized(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def prompt_messages(record: dict) -> list[dict]:
    """The conversation up to where the model should answer (drops a final assistant turn)."""
    messages = record["messages"]
    return messages[:-1] if messages[-1]["role"] == "assistant" else messages
