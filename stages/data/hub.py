"""Hugging Face datasets (``data: {hub: ID}`` or ``{folder: DIR}``) as posttrain's records (docs/algorithms.md)."""

from __future__ import annotations

import hashlib
import itertools
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from stages.data.specs import DataError, HubData

DISK_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # what save_to_disk writes
HUB_TIMEOUT_SECONDS = 3.0
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def describe(spec: HubData) -> str:
    """How errors name the dataset: ``openai/gsm8k [main, train]`` or its folder."""
    where = ", ".join(p for p in (spec.config, spec.split) if p)
    return f"{spec.hub or spec.folder} [{where}]"


def folder_path(spec: HubData, base_dir: Path) -> Path:
    path = Path(spec.folder).expanduser()
    return path if path.is_absolute() else base_dir / path


def hub_answers(timeout: float = HUB_TIMEOUT_SECONDS) -> bool:
    """Whether the hub may be asked: not offline by setting, and its host accepts a connection in ``timeout``."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


def resolve(spec: HubData, base_dir: Path) -> tuple[Path, str]:
    """(the folder the records are read from, the dataset's identity); DataError where neither cache nor hub has it."""
    if spec.folder is not None:
        path = folder_path(spec, base_dir)
        if not path.is_dir():
            raise DataError(f"dataset folder {str(path)!r} does not exist")
        return path, f"folder:{folder_digest(path)}"
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(spec.hub, repo_type="dataset", revision=spec.revision, local_files_only=True))
    except LocalEntryNotFoundError:
        if not hub_answers():
            from huggingface_hub import constants

            at = f" at revision {spec.revision!r}" if spec.revision else ""
            raise DataError(
                f"hub dataset {spec.hub!r}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                "hub does not answer (offline or HF_HUB_OFFLINE=1): on a machine with the hub run `hf download "
                f"{spec.hub} --repo-type dataset` and copy its cache here, or point HF_HOME at a cache that holds "
                "it") from None
        try:
            path = Path(snapshot_download(spec.hub, repo_type="dataset", revision=spec.revision))
        except Exception as error:  # the hub answered but refused: unknown id, gated, a bad revision
            raise DataError(f"hub dataset {spec.hub!r} could not be downloaded: {error}") from None
    return path, f"hub:{spec.hub}@{path.name}"  # snapshots/<commit>


def folder_digest(path: Path) -> str:
    """SHA-256 (16 hex digits) of a folder's files: their relative paths and bytes."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.relative_to(path).parts):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def identity(spec: HubData, base_dir: Path) -> str | None:
    """The dataset's identity (``hub:ID@COMMIT`` or ``folder:DIGEST``), or None where it cannot be resolved."""
    try:
        return resolve(spec, base_dir)[1]
    except DataError:
        return None


def _rows(spec: HubData, path: Path):
    """The split's rows, streamed where ``datasets`` can."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if any((path / marker).is_file() for marker in DISK_MARKERS):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if spec.split not in loaded:
                    raise DataError(f"dataset {describe(spec)}: no split {spec.split!r}; splits: {', '.join(loaded)}")
                loaded = loaded[spec.split]
            return iter(loaded)
        return iter(datasets.load_dataset(str(path), spec.config, split=spec.split, streaming=True))
    except DataError:
        raise
    except Exception as error:  # datasets raises ValueError / FileNotFoundError / its own types for a bad pick
        raise DataError(f"dataset {describe(spec)} cannot be read: {type(error).__name__}: {error}") from None


def located_hub_records(spec: HubData, base_dir: Path, normalise_record) -> list[tuple[str, dict]]:
    """(``dataset record i``, canonical record) for the first ``n`` rows; DataError names what is wrong.
    ``normalise_record``: sources.py's, for conversation rows (passed in: stages.data.sources imports this module)."""
    from stages.data.preferences import normalise_preference

    path, _ = resolve(spec, base_dir)
    rows = itertools.islice(_rows(spec, path), spec.n)
    located = []
    for i, row in enumerate(rows):
        where = f"dataset {describe(spec)} record {i}"
        if spec.records == "preferences":
            located.append((where, normalise_preference(preference_fields(spec, row, where), where)))
        else:
            located.append((where, normalise_record(conversation_fields(spec, row, where), where)))
    if not located:
        raise DataError(f"dataset {describe(spec)} holds no records")
    return located


def _column(spec: HubData, row: dict, field: str, where: str, required: bool = False):
    """The value of ``field``'s column (``columns[field]``, else the column of its own name)."""
    column = spec.columns.get(field, field)
    if column not in row:
        if required or field in spec.columns:
            mapped = f" (columns: {field}: {column})" if field in spec.columns else ""
            raise DataError(f"{where}: no column {column!r}{mapped}; the dataset's columns are "
                            f"{', '.join(map(str, row))}")
        return None
    return row[column]


def extract_answer(text, how: str | None, where: str) -> str | None:
    """The reference answer in ``text`` by ``answer_from``: ``gsm8k`` (after ``####``), ``boxed`` (last \\boxed{})."""
    if text is None or how is None:
        return None if text is None else str(text)
    text = str(text)
    if how == "gsm8k":
        if "####" not in text:
            raise DataError(f"{where}: answer_from gsm8k needs '####' before the final answer in {text[-80:]!r}")
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    start = text.rfind("\\boxed{")
    if start < 0:
        raise DataError(f"{where}: answer_from boxed found no \\boxed{{}} in {text[-80:]!r}")
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    raise DataError(f"{where}: answer_from boxed found an unclosed \\boxed{{ in {text[-80:]!r}")


def conversation_fields(spec: HubData, row: dict, where: str) -> dict:
    """A row as the fields ``stages.data.sources.normalise_record`` reads: messages, or prompt (+ completion); answer."""
    answer = extract_answer(_column(spec, row, "answer", where), spec.answer_from, where)
    messages = _column(spec, row, "messages", where)
    if messages is not None:
        return {"messages": messages, "answer": answer}
    prompt = _column(spec, row, "prompt", where, required=True)
    if not isinstance(prompt, str):
        raise DataError(f"{where}: column {spec.columns.get('prompt', 'prompt')!r} must be text, got "
                        f"{type(prompt).__name__}")
    fields = {"prompt": prompt, "answer": answer}
    completion = _column(spec, row, "completion", where)
    if completion is not None:
        fields["completion"] = completion
    system = _column(spec, row, "system", where)
    if system:
        turns = [{"role": "system", "content": str(system)}, {"role": "user", "content": prompt}]
        if completion is not None:
            turns.append({"role": "assistant", "content": completion})
        return {"messages": turns, "answer": answer}
    return fields


def hh_turns(text: str) -> list[dict]:
    """An HH-RLHF transcript (``\\n\\nHuman: ...\\n\\nAssistant: ...``) as chat messages."""
    parts = _HH_TURN.split(text)
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[speaker], "content": content.strip()} for speaker, content in zip(parts[1::2], parts[2::2])]


def preference_fields(spec: HubData, row: dict, where: str) -> dict:
    """A row as prompt / chosen / rejected: the turns chosen and rejected share are the prompt."""
    chosen = _column(spec, row, "chosen", where, required=True)
    rejected = _column(spec, row, "rejected", where, required=True)
    prompt = _column(spec, row, "prompt", where)
    if isinstance(chosen, str) and isinstance(rejected, str) and _HH_TURN.search(chosen) and _HH_TURN.search(rejected):
        chosen, rejected = hh_turns(chosen), hh_turns(rejected)
    if isinstance(chosen, list) and isinstance(rejected, list):
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared:
            prompt = prompt if prompt is not None and not isinstance(prompt, str) else chosen[:shared]
            chosen, rejected = chosen[shared:], rejected[shared:]
    answer = extract_answer(_column(spec, row, "answer", where), spec.answer_from, where)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "answer": answer}
