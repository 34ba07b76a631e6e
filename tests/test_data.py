"""Local JSONL / parquet datasets: read through `datasets`, bad files named with their line."""

from __future__ import annotations

import json

import pytest

from conftest import write
from flows.spec.loading import SpecError, load_pipeline
from stages.data.sources import DataError, FileData, load_records, materialize, read_materialized

PIPELINE = """\
name: files
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}
data:
  mine: {path: DATA, role: train}
stages:
  sft: {kind: sft, data: mine, max_steps: 1}
"""


def test_jsonl_messages_and_prompt_completion_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
        + "\n"
        + json.dumps({"prompt": "What is 2+2?", "completion": "4", "answer": 4}) + "\n"
    )
    records = load_records(FileData(path="d.jsonl", role="train"), tmp_path)
    assert records[1] == {"messages": [{"role": "user", "content": "What is 2+2?"},
                                       {"role": "assistant", "content": "4"}], "answer": "4"}
    assert records[0]["answer"] is None


def test_parquet_through_datasets(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]).to_parquet(str(tmp_path / "d.parquet"))
    spec = FileData(path="d.parquet", role="heldout", limit=3)
    path = materialize(spec, tmp_path, tmp_path / "cache")
    assert [r["answer"] for r in read_materialized(path)] == ["0", "1", "2"]
    assert materialize(spec, tmp_path, tmp_path / "cache") == path  # content-keyed, written once


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', "d.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}\n[1, 2]\n', "d.jsonl:2: expected a JSON object"),
        ('{"question": "a"}\n', "d.jsonl:1: a record needs `messages`"),
        ('{"messages": []}\n', "d.jsonl:1: `messages` must be a non-empty list"),
        ("\n\n", "holds no records"),
    ],
)
def test_bad_files_are_refused_at_validation_with_their_line(tmp_path, content, fragment):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(DataError, match=fragment.replace("[", r"\[")):
        load_records(FileData(path="d.jsonl", role="train"), tmp_path)
    pipeline = write(tmp_path / "p.yaml", PIPELINE.replace("DATA", "d.jsonl"))
    with pytest.raises(SpecError) as caught:
        load_pipeline(pipeline)
    assert caught.value.issues[0].path == "data.mine.path"
    assert fragment in caught.value.issues[0].message


def test_relative_paths_resolve_against_the_pipeline_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    pipeline = write(tmp_path / "sub" / "p.yaml", PIPELINE.replace("DATA", "d.jsonl"))
    monkeypatch.chdir(tmp_path)
    assert load_pipeline(pipeline).spec.data["mine"].path == "d.jsonl"
