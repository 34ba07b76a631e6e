"""Hugging Face datasets as pipeline data: read from a Hugging Face cache laid out here (no network),
refused offline without one, mapped from the hub's conventions (GSM8K, UltraFeedback, HH-RLHF), and
identified by their resolved commit so a new revision reruns what reads it."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli, write

from stages.data.specs import DataError, HubData
from stages.data.sources import located_file_records

REV_1, REV_2 = "1a" * 20, "2b" * 20
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def gsm8k_rows(n: int, start: int = 0) -> dict:
    sums = [(a + 1, a % 5 + 2) for a in range(start, start + n)]  # every question distinct
    return {"question": [f"Tom has {a} apples and buys {b}. How many now?" for a, b in sums],
            "answer": [f"He has {a} + {b} = {a + b} apples.\n#### {a + b:,}" for a, b in sums]}


def cache_snapshot(cache, repo: str, revision: str, files: dict[str, dict | str], branch: str = "main"):
    """A dataset snapshot in huggingface_hub's cache layout, ``branch`` pointing at it."""
    root = cache / f"datasets--{repo.replace('/', '--')}"
    for name, content in files.items():
        path = root / "snapshots" / revision / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            pq.write_table(pa.table(content), path)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / branch).write_text(revision)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache, the only one huggingface_hub looks in; the hub is unreachable."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def gsm8k_cache(cache, revision: str = REV_1, start: int = 0):
    cache_snapshot(cache, "openai/gsm8k", revision, {"README.md": GSM8K_CARD,
                                                     "main/train-00000-of-00001.parquet": gsm8k_rows(40, start),
                                                     "main/test-00000-of-00001.parquet": gsm8k_rows(6, 500)})


PIPELINE = """\
name: hubdata
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {hub: openai/gsm8k, config: main, split: train, role: train, n: 32, answer_from: gsm8k,
          columns: {prompt: question, completion: answer, answer: answer}}
  heldout: {hub: openai/gsm8k, config: main, split: test, role: heldout, answer_from: gsm8k,
            columns: {prompt: question, answer: answer}}
rewards:
  correct: {fn: exact_answer}
stages:
  sft: {kind: sft, data: train, max_steps: 2, batch_size: 8, max_length: 128}
  eval_sft: {kind: eval, model: sft, data: heldout, rewards: [correct], sampling: {max_tokens: 2, attempts: 2}}
"""


def test_a_hub_dataset_in_the_cache_trains_sft_and_its_commit_is_recorded(home, prefect_server, tmp_path, hf_cache):
    from mlflow.tracking import MlflowClient

    gsm8k_cache(hf_cache)
    assert run_cli("run", str(write(tmp_path / "p.yaml", PIPELINE))) == 0
    client = MlflowClient()
    experiment = client.get_experiment_by_name("hubdata")
    runs = {r.data.tags["posttrain.stage"]: r for r in
            client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'stage'")}
    # 6 heldout questions x 2 attempts, scored 0 or 1 by exact_answer: pass@1 is its mean score
    evaluated = runs["eval_sft"].data.metrics
    assert runs["sft"].info.status == "FINISHED" and evaluated["pass_at_1"] == pytest.approx(evaluated["reward/correct/mean"])
    (dataset,) = runs["sft"].inputs.dataset_inputs
    profile = json.loads(dataset.dataset.profile)
    assert profile["num_rows"] == 32 and profile["spec"]["resolved"] == f"hub:openai/gsm8k@{REV_1}"
    records = [json.loads(line) for line in open(json.loads(dataset.dataset.source)["uri"].removeprefix("file://"))]
    assert records[0] == {"messages": [{"role": "user", "content": "Tom has 1 apples and buys 2. How many now?"},
                                       {"role": "assistant", "content": "He has 1 + 2 = 3 apples.\n#### 3"}],
                          "answer": "3"}

    def resolved(stage):
        found = client.search_runs([experiment.experiment_id], f"tags.`posttrain.stage` = '{stage}' and "
                                   "attributes.status = 'FINISHED'", order_by=["attributes.start_time ASC"])
        return [json.loads(r.inputs.dataset_inputs[0].dataset.profile)["spec"]["resolved"] for r in found]

    path = tmp_path / "p.yaml"
    assert run_cli("run", str(path)) == 0  # the same snapshot: every stage cached
    assert resolved("sft") == [f"hub:openai/gsm8k@{REV_1}"]
    gsm8k_cache(hf_cache, REV_2, start=3)  # the cache's `main` moves to a new commit: what reads it reruns
    assert run_cli("run", str(path)) == 0
    assert resolved("sft") == [f"hub:openai/gsm8k@{REV_1}", f"hub:openai/gsm8k@{REV_2}"]
    assert len(resolved("eval_sft")) == 2


def test_a_new_revision_in_the_cache_reruns_the_stages_that_read_it(home, tmp_path, hf_cache):
    from flows.planning.lineage import fingerprint
    from flows.spec.loading import load_pipeline
    from stages.data.hub import identity

    gsm8k_cache(hf_cache)
    file = write(tmp_path / "p.yaml", PIPELINE)
    before = fingerprint(load_pipeline(file), "sft", {})
    cache_snapshot(hf_cache, "other/sums", REV_2, {"train.jsonl": '{"prompt": "1+1", "completion": "2"}\n'})
    assert fingerprint(load_pipeline(file), "sft", {}) == before  # another dataset's snapshot: not this stage's input
    gsm8k_cache(hf_cache, REV_2, start=3)  # the cache's `main` moves to a new commit
    assert fingerprint(load_pipeline(file), "sft", {}) != before
    assert identity(HubData(hub="openai/gsm8k", role="train"), tmp_path) == f"hub:openai/gsm8k@{REV_2}"
    pinned = HubData(hub="openai/gsm8k", revision=REV_1, role="train")  # a pinned commit reads that snapshot
    assert identity(pinned, tmp_path) == f"hub:openai/gsm8k@{REV_1}"


def test_offline_without_the_dataset_in_the_cache_is_refused_at_validation(home, tmp_path, hf_cache, capsys):
    started = time.monotonic()
    assert run_cli("validate", str(write(tmp_path / "p.yaml", PIPELINE))) == 2
    err = capsys.readouterr().err
    assert "data.train.hub: hub dataset 'openai/gsm8k' is not in the Hugging Face cache" in err, err
    assert "hf download openai/gsm8k --repo-type dataset" in err
    assert time.monotonic() - started < 30  # offline never hangs
    assert not home.exists()  # refused input leaves nothing behind


def test_a_missing_column_names_the_dataset_the_record_and_the_column(home, tmp_path, hf_cache, capsys):
    gsm8k_cache(hf_cache)
    bad = PIPELINE.replace("columns: {prompt: question, completion: answer", "columns: {prompt: query, completion: answer")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", bad))) == 2
    err = capsys.readouterr().err
    assert ("data.train.hub: dataset openai/gsm8k [main, train] record 0: no column 'query' (columns: prompt: query); "
            "the dataset's columns are question, answer") in err, err


def test_gsm8k_and_boxed_answers_are_extracted(hf_cache, tmp_path):
    gsm8k_cache(hf_cache)
    spec = HubData(hub="openai/gsm8k", config="main", split="train", role="train", n=3, answer_from="gsm8k",
                   columns={"prompt": "question", "answer": "answer"})
    assert [r["answer"] for _, r in located_file_records(spec, tmp_path)] == ["3", "5", "7"]
    folder = tmp_path / "math"
    folder.mkdir()
    pq.write_table(pa.table({"problem": ["p1", "p2"], "solution": ["so \\boxed{\\frac{1}{2}}", "no box here"]}),
                   folder / "train.parquet")
    boxed = HubData(folder=str(folder), role="train", answer_from="boxed", columns={"prompt": "problem",
                                                                                   "answer": "solution"})
    with pytest.raises(DataError, match=r"record 1: answer_from boxed found no \\boxed\{\} in 'no box here'"):
        located_file_records(boxed, tmp_path)
    assert located_file_records(boxed.model_copy(update={"n": 1}), tmp_path)[0][1]["answer"] == "\\frac{1}{2}"


def test_ultrafeedback_and_hh_rlhf_preferences_map_to_a_shared_prompt_and_two_replies(hf_cache, tmp_path):
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    cache_snapshot(hf_cache, "HuggingFaceH4/ultrafeedback_binarized", REV_1, {"data/train_prefs-00000-of-00001.parquet": {
        "prompt": ["Name a prime."], "chosen": [[turn("user", "Name a prime."), turn("assistant", "7")]],
        "rejected": [[turn("user", "Name a prime."), turn("assistant", "8")]], "score_chosen": [9.0]}})
    spec = HubData(hub="HuggingFaceH4/ultrafeedback_binarized", split="train_prefs", role="train", records="preferences")
    ((_, pair),) = located_file_records(spec, tmp_path)
    assert pair == {"prompt": [turn("user", "Name a prime.")], "chosen": [turn("assistant", "7")],
                    "rejected": [turn("assistant", "8")], "answer": None}

    folder = tmp_path / "hh"
    folder.mkdir()
    shared = "\n\nHuman: What is 2+2?\n\nAssistant: Let me think.\n\nHuman: Well?\n\nAssistant:"
    (folder / "train.jsonl").write_text(json.dumps({"chosen": shared + " 4", "rejected": shared + " 5"}) + "\n")
    hh = HubData(folder=str(folder), role="train", records="preferences")
    ((_, pair),) = located_file_records(hh, tmp_path)
    assert pair["prompt"] == [turn("user", "What is 2+2?"), turn("assistant", "Let me think."), turn("user", "Well?")]
    assert (pair["chosen"], pair["rejected"]) == ([turn("assistant", "4")], [turn("assistant", "5")])


def test_a_save_to_disk_folder_is_a_dataset_identified_by_its_content(tmp_path):
    from datasets import Dataset, DatasetDict

    from stages.data.hub import identity

    folder = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_dict({"prompt": ["a?", "b?"], "answer": ["1", "2"]})}).save_to_disk(folder)
    spec = HubData(folder=str(folder), role="train")
    assert [r["answer"] for _, r in located_file_records(spec, tmp_path)] == ["1", "2"]
    before = identity(spec, tmp_path)
    DatasetDict({"train": Dataset.from_dict({"prompt": ["a?", "b?"], "answer": ["1", "3"]})}).save_to_disk(folder)
    assert identity(spec, tmp_path) != before and before.startswith("folder:")
    with pytest.raises(DataError, match="no split 'test'; splits: train"):
        located_file_records(spec.model_copy(update={"split": "test"}), tmp_path)


def test_a_chat_dataset_maps_its_messages_column(tmp_path):
    from stages.data.sources import located_file_records

    folder = tmp_path / "chat"
    folder.mkdir()
    turns = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}]]
    pq.write_table(pa.table({"conversation": turns, "label": [4]}), folder / "train.parquet")
    spec = HubData(folder=str(folder), role="train", columns={"messages": "conversation", "answer": "label"})
    ((_, record),) = located_file_records(spec, tmp_path)
    assert record == {"messages": turns[0], "answer": "4"}
    not_chat = HubData(folder=str(folder), role="train", columns={"messages": "label"})  # a number, not turns
    with pytest.raises(DataError, match=r"record 0: `messages` must be a non-empty list of \{role, content\} strings"):
        located_file_records(not_chat, tmp_path)
