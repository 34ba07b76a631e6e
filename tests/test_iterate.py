"""Iterating from failure cases: the `iterate:` block's checks, the mix, the leakage guard,
and a real two-round run in which round 2's sft trains on round 1's probe failures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, write

TINY = """\
name: iterate-tiny
seed: 0
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train:   {generator: arithmetic, n: 64, seed: 0, max_operand: 9, role: train}
  probe:   {generator: arithmetic, n: 12, seed: 7, max_operand: 9, role: probe}
  # two-digit operands: no heldout prompt is a train or probe prompt, so one in training data is a leak
  heldout: {generator: arithmetic, n: 8, seed: 999, min_operand: 10, max_operand: 19, role: heldout}
stages:
  sft: {kind: sft, data: train, max_steps: 2, batch_size: 8, max_length: 32, logging_steps: 1, save_steps: null}
  eval_probe: {kind: eval, model: sft, data: probe, sampling: {attempts: 2, max_tokens: 3, seed: 1}}
  eval_heldout: {kind: eval, model: sft, data: heldout, sampling: {attempts: 2, max_tokens: 3, seed: 1}}
iterate: {rounds: 2, collect: eval_probe, train: sft, mix: 0.5}
"""

EXTRA_STAGES = """\
  eval_train: {kind: eval, model: sft, data: train}
  eval_base_probe: {kind: eval, model: base, data: probe}
"""


def tiny_with(iterate: str) -> str:
    text = TINY.replace("iterate: {rounds: 2, collect: eval_probe, train: sft, mix: 0.5}", iterate)
    return text.replace("iterate:", EXTRA_STAGES + "iterate:", 1) if "iterate:" in iterate else text


# ------------------------------------------------------------------ the validator


@pytest.mark.parametrize("iterate, path, message", [
    ("iterate: {rounds: 2, collect: eval_heldout, train: sft}", "iterate.collect",
     "evaluates dataset 'heldout', role heldout: its failures would feed training (leakage guard"),
    ("iterate: {rounds: 2, collect: eval_train, train: sft}", "iterate.collect",
     "evaluates dataset 'train', role train; failures are collected on a dataset with role probe"),
    ("iterate: {rounds: 2, collect: sft, train: sft}", "iterate.collect",
     "stage 'sft' is kind sft; iterate.collect must be an eval stage"),
    ("iterate: {rounds: 2, collect: eval_probe, train: eval_heldout}", "iterate.train",
     "stage 'eval_heldout' is kind eval; iterate.train must be a training stage"),
    ("iterate: {rounds: 2, collect: eval_base_probe, train: sft}", "iterate.collect",
     "eval stage 'eval_base_probe' does not evaluate a checkpoint of 'sft'"),
    ("iterate: {rounds: 2, collect: eval_prob, train: sft}", "iterate.collect", "unknown stage 'eval_prob'"),
    ("iterate: {rounds: 0, collect: eval_probe, train: sft}", "iterate.rounds", "must be >= 1 (got 0)"),
    ("iterate: {rounds: 2, collect: eval_probe, train: sft, mix: 1.5}", "iterate.mix", "must be <= 1"),
])
def test_validate_refuses_a_bad_iterate_block(tmp_path, capsys, iterate, path, message):
    file = write(tmp_path / "p.yaml", tiny_with(iterate))
    assert run_cli("validate", str(file)) == 2
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(file.read_text().splitlines(), start=1) if text.startswith("iterate:"))
    assert f"{file}:{line}: {path}: " in err, err
    assert message in err, err


def test_set_cannot_point_collect_at_heldout(tmp_path, capsys):
    file = write(tmp_path / "p.yaml", tiny_with("iterate: {rounds: 2, collect: eval_probe, train: sft}"))
    assert run_cli("validate", str(file)) == 0
    capsys.readouterr()
    assert run_cli("validate", str(file), "--set", "iterate.collect=eval_heldout") == 2
    assert "iterate.collect: eval stage 'eval_heldout' evaluates dataset 'heldout', role heldout" in \
        capsys.readouterr().err


def test_rounds_unroll_into_steps_that_read_the_previous_failures(tmp_path):
    from flows.planning.graph import upstream_of
    from flows.spec.loading import load_pipeline

    spec = load_pipeline(write(tmp_path / "p.yaml", TINY.replace("rounds: 2", "rounds: 3"))).spec
    assert list(spec.stages) == ["sft", "eval_probe", "eval_heldout", "sft@2", "eval_probe@2", "eval_heldout@2",
                                 "sft@3", "eval_probe@3", "eval_heldout@3"]
    edges = upstream_of(spec)
    assert edges["sft@2"] == ["eval_probe"] and edges["sft@3"] == ["eval_probe@2"]  # model: base is shared
    assert edges["eval_heldout@3"] == ["sft@3"]
    assert spec.stages["sft@3"].data == "train"  # the mix replaces it at run time


def test_shipped_iterate_pipeline_validates(capsys):
    assert run_cli("validate", str(ROOT / "pipelines" / "iterate.yaml")) == 0
    out = capsys.readouterr().out
    assert "sft@2 (sft) <- model=base, failures=eval_probe, data=train(train)" in out
    assert "eval_base@2" not in out  # upstream of sft: shared by both rounds


# ------------------------------------------------------------------ the mix


def failure_case(prompt: str, answer: str | None) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "answer": answer, "attempts": ["x", "y"],
            "rewards": [0.0, 0.0], "correct": [False, False]}


def original_records(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i}+0?"}, {"role": "assistant", "content": str(i)}],
             "answer": str(i)} for i in range(n)]


def test_sft_failures_become_demonstrations_of_the_expected_answer():
    from stages.data.failures import FailureSetError, failure_training_records

    (record,) = failure_training_records([failure_case("What is 3+4?", "7")], demonstrations=True)
    assert record["messages"] == [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    (prompt_only,) = failure_training_records([failure_case("What is 3+4?", "7")], demonstrations=False)
    assert prompt_only["messages"] == [{"role": "user", "content": "What is 3+4?"}] and prompt_only["answer"] == "7"
    with pytest.raises(FailureSetError, match="no expected answer"):
        failure_training_records([failure_case("Say hi", None)], demonstrations=True)


def test_mix_is_the_share_of_examples_from_the_failure_set():
    from stages.data.failures import failure_training_records, mix_records

    original = original_records(10)
    failures = failure_training_records([failure_case(f"What is {i}+9?", str(i + 9)) for i in range(3)], True)
    records, counts = mix_records(original, failures, 0.5, "0:2")
    assert counts == {"failure_prompts": 3, "failure_examples": 5, "original_examples": 5}
    assert len(records) == 10
    from_failures = [r["messages"][0]["content"] for r in records if r.get("origin") == "failure_set"]
    assert sorted({p: from_failures.count(p) for p in from_failures}.values()) == [1, 2, 2]  # spread evenly
    assert records == mix_records(original, failures, 0.5, "0:2")[0]  # seeded
    assert mix_records(original, failures, 1.0, "0:2")[1]["original_examples"] == 0
    assert mix_records(original, [], 0.5, "0:2")[0] == original  # nothing failed: the original data


# ------------------------------------------------------------------ the run-time leakage guard


def test_a_failure_set_from_heldout_data_never_becomes_training_data(home, tmp_path):
    from flows.planning.iterate import LeakageError, build_round_data, round_feed
    from flows.spec.loading import load_pipeline
    from stages.data.sources import materialize

    loaded = load_pipeline(write(tmp_path / "p.yaml", TINY))
    cache = home / "cache" / "data"
    feed = round_feed(loaded.spec, "sft@2")
    failures = write(tmp_path / "failures.jsonl", json.dumps(failure_case("What is 1+2?", "3")) + "\n")
    probe_file = materialize(loaded.spec.data["probe"], loaded.base_dir, cache)
    heldout_file = materialize(loaded.spec.data["heldout"], loaded.base_dir, cache)

    built = build_round_data(loaded, feed, failures, str(probe_file), cache)
    assert built.counts["failure_examples"] == 32
    with pytest.raises(LeakageError, match="evaluated heldout dataset 'heldout'"):
        build_round_data(loaded, feed, failures, str(heldout_file), cache)  # what the collect run recorded
    loaded.spec.data["probe"] = loaded.spec.data["probe"].model_copy(update={"role": "heldout"})
    with pytest.raises(LeakageError, match="role heldout; only a probe dataset's failures may feed training"):
        build_round_data(loaded, feed, failures, None, cache)


# ------------------------------------------------------------------ two rounds, for real


def prompts_of(path: str) -> list[str]:
    from stages.data.sources import read_materialized

    return [r["messages"][0]["content"] for r in read_materialized(Path(path))]


@pytest.mark.slow
def test_two_rounds_train_on_probe_failures_and_never_on_heldout(home, prefect_server, tmp_path, capsys,
                                                                 monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("POSTTRAIN_TORCH_THREADS", "1")
    file = write(tmp_path / "iterate.yaml", TINY)
    assert run_cli("run", str(file)) == 0
    out = capsys.readouterr().out
    assert "evaluation by round" in out

    client = MlflowClient()
    experiment = client.get_experiment_by_name("iterate-tiny")
    runs = {r.data.tags["posttrain.stage"]: r for r in
            client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'stage'")}
    assert set(runs) == {"sft", "eval_probe", "eval_heldout", "sft@2", "eval_probe@2", "eval_heldout@2"}
    for step, run in runs.items():
        assert run.info.status == "FINISHED"
        assert run.data.tags["posttrain.round"] == ("2" if step.endswith("@2") else "1")
        assert run.data.tags["posttrain.round_of"] == step.removesuffix("@2")

    # round 2's sft names the failure set it trained on: round 1's probe eval, its artifact, its hash
    probe_run = runs["eval_probe"].info.run_id
    trained = runs["sft@2"].data
    assert trained.tags["posttrain.failure_set"] == f"runs:/{probe_run}/outputs/failures.jsonl"
    assert json.loads(trained.tags["posttrain.upstream"])["eval_probe"] == probe_run
    failures_file = client.download_artifacts(probe_run, "outputs/failures.jsonl", str(tmp_path))
    assert trained.tags["posttrain.failure_set_sha256"] == hashlib.sha256(Path(failures_file).read_bytes()).hexdigest()
    assert trained.params["iterate.failure_set_run_id"] == probe_run
    failures = [json.loads(line) for line in Path(failures_file).read_text().splitlines()]
    assert failures, "a 2-step model should fail some probe prompts"
    assert trained.params["iterate.failure_prompts"] == str(len(failures))
    assert trained.params["iterate.failure_examples"] == "32"  # mix 0.5 of 64 examples

    # ... and its data holds those prompts, demonstrated with the expected answer
    from stages.data.sources import read_materialized

    round2 = read_materialized(Path(trained.params["input.data"]))
    assert len(round2) == 64
    demonstrations = {(r["messages"][0]["content"], r["messages"][-1]["content"]) for r in round2
                      if r.get("origin") == "failure_set"}
    assert demonstrations == {(f["messages"][0]["content"], f["answer"]) for f in failures}
    assert runs["sft"].data.params["input.data"] != trained.params["input.data"]

    # no heldout prompt ever reached training, in any round, although heldout failures existed
    heldout = set(prompts_of(runs["eval_heldout"].data.params["input.data"]))
    heldout_failures = client.download_artifacts(runs["eval_heldout"].info.run_id, "outputs/failures.jsonl",
                                                 str(tmp_path / "heldout"))
    assert Path(heldout_failures).read_text().strip()
    training = [r for r in runs.values() if r.data.tags["posttrain.kind"] in ("sft", "rl")]
    assert len(training) == 2
    for run in training:
        assert heldout.isdisjoint(prompts_of(run.data.params["input.data"])), run.data.tags["posttrain.stage"]

    # each round's evaluation side by side: summary.md of the pipeline run, and the Prefect artifact
    parent = client.get_run(runs["sft"].data.tags["mlflow.parentRunId"])
    summary = Path(client.download_artifacts(parent.info.run_id, "summary.md", str(tmp_path))).read_text()
    assert "| eval stage | metric | round 1 | round 2 |" in summary
    for stage in ("eval_probe", "eval_heldout"):
        first, second = (runs[s].data.metrics["pass_at_1"] for s in (stage, f"{stage}@2"))
        assert f"| {stage} | pass_at_1 | {first:.3f} | {second:.3f} |" in summary

    from prefect.artifacts import Artifact

    assert "Evaluation by round" in Artifact.get("posttrain-summary").data

    # the same two-round pipeline again: every step of both rounds is a cache hit
    assert run_cli("run", str(file)) == 0
    out = capsys.readouterr().out
    assert "nothing to launch" in out and "cached sft@2" in out
    assert len(client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'stage'")) == 6


def test_an_rl_stage_trains_on_failure_prompts_alone(home, tmp_path):
    from flows.planning.iterate import build_round_data, round_feed
    from flows.spec.loading import load_pipeline
    from stages.data.sources import materialize, read_materialized

    text = TINY.replace("  eval_probe: {kind: eval, model: sft,", "  grpo: {kind: rl, algorithm: grpo, policy: sft, "
                        "data: train, rewards: [exact_answer], max_steps: 1}\n  eval_probe: {kind: eval, model: grpo,")
    loaded = load_pipeline(write(tmp_path / "p.yaml", text.replace("train: sft", "train: grpo")))
    assert "sft@2" not in loaded.spec.stages and loaded.spec.stages["grpo@2"].policy == "sft"  # sft is shared
    cache = home / "cache" / "data"
    failures = write(tmp_path / "failures.jsonl", json.dumps(failure_case("What is 1+2?", "3")) + "\n")
    probe_file = materialize(loaded.spec.data["probe"], loaded.base_dir, cache)
    built = build_round_data(loaded, round_feed(loaded.spec, "grpo@2"), failures, str(probe_file), cache)
    mixed = [r for r in read_materialized(built.path) if r.get("origin") == "failure_set"]
    assert len(mixed) == 32
    assert mixed[0]["messages"] == [{"role": "user", "content": "What is 1+2?"}] and mixed[0]["answer"] == "3"
