"""Every file in pipelines/ runs end to end in the suite, shrunk through overrides (the real file, the real
stages, in this process without Prefect), and shows what it is for at that scale.

Run elsewhere: quickstart.yaml (tests/test_pipeline.py, tests/test_run_output.py), rlhf.yaml and dpo.yaml
(tests/test_rlhf_pipeline.py). Here: ppo, iterate, agent, agent-ppo, judge, smollm2-reasoning, process and
gsm8k (a GPU-worker pipeline on hub data: here from a Hugging Face cache the test lays out);
``test_every_shipped_pipeline_is_run_by_a_test`` keeps the list whole.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from conftest import ROOT
from test_hub_data import hf_cache  # noqa: F401 (a fixture: an empty Hugging Face cache, the hub off)

pytestmark = pytest.mark.slow

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64"]
EVAL = ["sampling.attempts=2", "sampling.max_tokens=4", "max_prompts=6"]
RUN_ELSEWHERE = {"quickstart": "tests/test_pipeline.py", "rlhf": "tests/test_rlhf_pipeline.py",
                 "dpo": "tests/test_rlhf_pipeline.py"}
RUN_HERE = ("ppo", "iterate", "agent", "agent-ppo", "judge", "smollm2-reasoning", "process", "gsm8k")


def stage_overrides(stages: dict[str, list[str]]) -> list[str]:
    return [f"stages.{stage}.{item}" for stage, items in stages.items() for item in items]


@pytest.fixture()
def run(home, monkeypatch):
    """Runs a shipped pipeline with overrides in a fresh home, one torch thread; (report rows by stage, client)."""
    import torch
    from mlflow.tracking import MlflowClient

    from flows.recording.home import configure_environment
    from flows.planning.lineage import RunOptions
    from flows.execution.pipeline import run_pipeline
    from flows.spec.loading import load_pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    configure_environment()

    def run_shipped(name: str, overrides: list[str]):
        report = run_pipeline(load_pipeline(ROOT / "pipelines" / f"{name}.yaml", overrides), RunOptions(), home)
        assert not report.failed, [(r.stage, r.note) for r in report.rows]
        assert all(r.status == "ran" for r in report.rows), [(r.stage, r.status) for r in report.rows]
        return {row.stage: row for row in report.rows}, MlflowClient()

    yield run_shipped
    torch.set_num_threads(threads)


def test_every_shipped_pipeline_is_run_by_a_test():
    shipped = {path.stem for path in (ROOT / "pipelines").glob("*.yaml")}
    assert shipped == set(RUN_ELSEWHERE) | set(RUN_HERE)


def test_ppo_pipeline_trains_a_critic_and_evaluates_the_policy(run):
    rows, client = run("ppo", TINY + ["data.train.n=200", "data.heldout.n=8"] + stage_overrides({
        "sft": ["max_steps=10"], "ppo": ["max_steps=2", "prompts_per_step=4", "minibatch_size=8"],
        "eval_sft": EVAL, "eval_ppo": EVAL}))
    assert list(rows) == ["sft", "eval_sft", "ppo", "eval_ppo"]
    metrics = client.get_run(rows["ppo"].run_id).data.metrics
    assert {"value_loss", "policy_loss", "kl", "reward/mean", "reward/correct/unparsed_frac"} <= set(metrics)
    upstream = json.loads(client.get_run(rows["eval_ppo"].run_id).data.tags["posttrain.upstream"])
    assert upstream == {"ppo": rows["ppo"].run_id}


def test_process_pipeline_trains_a_prm_and_ppo_on_step_scores_beside_ppo_on_the_outcome(run):
    arms = ("ppo_outcome", "ppo_process", "ppo_prm")
    rows, client = run("process", TINY + ["data.train.n=200", "data.heldout.n=8"] + stage_overrides({
        "sft": ["max_steps=10"], "prm": ["max_steps=4"], "eval_sft": EVAL,
        **{f"eval_{arm}": EVAL for arm in arms},
        **{arm: ["max_steps=2", "prompts_per_step=4", "minibatch_size=8"] for arm in arms}}))
    assert set(rows) == {"sft", "prm", "eval_sft", *arms, *(f"eval_{arm}" for arm in arms)}
    prm = client.get_run(rows["prm"].run_id).data.metrics
    assert {"heldout_step_accuracy", "heldout_right_step_share", "heldout_first_wrong_step_detection"} <= set(prm)
    process = client.get_run(rows["ppo_process"].run_id).data
    assert process.params["process_weight"] == "1.0" and "reward/steps/mean" in process.metrics
    assert "reward/prm_steps/mean" in client.get_run(rows["ppo_prm"].run_id).data.metrics
    assert "reward/steps/mean" not in client.get_run(rows["ppo_outcome"].run_id).data.metrics
    for arm in ("eval_sft", *(f"eval_{arm}" for arm in arms)):  # every arm at the same evaluation settings
        metrics = client.get_run(rows[arm].run_id).data.metrics
        assert {"pass_at_1", "steps/steps/all_right_rate", "steps/steps/correct_with_wrong_step_frac"} <= set(metrics)


def test_iterate_pipeline_trains_round_two_on_round_ones_probe_failures(run):
    rows, client = run("iterate", TINY + ["data.train.n=200", "data.heldout.n=8", "data.probe.n=8"] + stage_overrides({
        "sft": ["max_steps=4"], "grpo": ["max_steps=1", "prompts_per_step=2", "check_rewards=false"],
        "eval_base": EVAL, "eval_sft": EVAL, "eval_grpo": EVAL}))
    assert {"sft", "sft@2", "eval_probe", "eval_probe@2", "grpo@2"} <= set(rows)
    trained = client.get_run(rows["sft@2"].run_id).data
    assert trained.tags["posttrain.failure_set"] == f"runs:/{rows['eval_probe'].run_id}/outputs/failures.jsonl"
    assert int(trained.params["iterate.failure_prompts"]) > 0  # a 4-step model fails probe prompts


@pytest.mark.parametrize("name, trainer", [("agent", "grpo"), ("agent-ppo", "ppo")])
def test_agent_pipelines_replay_their_known_episodes_and_train_in_the_calculator(run, tmp_path, name, trainer):
    extra = ["minibatch_size=8"] if trainer == "ppo" else []
    rows, client = run(name, TINY + ["data.train.n=64", "data.heldout.n=4"] + stage_overrides({
        "sft": ["max_steps=4"], trainer: ["max_steps=2", "prompts_per_step=2", *extra],
        "eval_sft": ["sampling.attempts=2", "sampling.max_tokens=12"],
        f"eval_{trainer}": ["sampling.attempts=2", "sampling.max_tokens=12"]}))
    trained = client.get_run(rows[trainer].run_id)
    checks = client.download_artifacts(trained.info.run_id, "environment_checks.json", str(tmp_path))
    table = json.loads(Path(checks).read_text(encoding="utf-8"))
    assert len(table["data"]) == 6 and all(row[table["columns"].index("violations")] == "" for row in table["data"])
    assert any(key.startswith("env/") for key in trained.data.metrics), sorted(trained.data.metrics)
    assert {"pass_at_1", "format_error_rate"} <= set(rows[f"eval_{trainer}"].metrics)


def test_judge_pipeline_audits_the_smollm2_judge_against_the_verifier(run, smollm2):
    rows, client = run("judge", TINY + ["data.noisy.n=64", "data.clean.n=16", "data.train.n=64",
                                        "data.heldout.n=4"] + stage_overrides({
        "sft": ["max_steps=4"], "eval_sft": ["sampling.attempts=2", "max_prompts=3"],
        "online_dpo": ["max_steps=2", "prompts_per_step=2", "sampling.attempts=2"],
        "eval_online_dpo": ["sampling.attempts=2", "max_prompts=3"]}))
    metrics = client.get_run(rows["eval_sft"].run_id).data.metrics
    audited = {key for key in metrics if key.startswith("audit/judge/correct/")}
    assert {"audit/judge/correct/both_pass", "audit/judge/correct/judge_only"} <= audited, sorted(metrics)
    assert sum(metrics[k] for k in audited if not k.endswith(("agreement", "judge_errors"))) == 6  # 3 x 2 judged
    assert "pairs_trained" in client.get_run(rows["online_dpo"].run_id).data.metrics


def test_smollm2_reasoning_pipeline_runs_sft_and_grpo_on_the_pretrained_model(run, smollm2):
    evaluate = ["max_prompts=2", "sampling.attempts=2", "sampling.max_tokens=12"]
    rows, client = run("smollm2-reasoning", ["data.train.n=32", "data.heldout.n=4"] + stage_overrides({
        "sft": ["max_steps=2", "batch_size=2"],
        "grpo": ["max_steps=1", "prompts_per_step=1", "sampling.attempts=2", "sampling.max_tokens=12",
                 "dynamic_sampling=null"],
        "eval_base": evaluate, "eval_sft": evaluate, "eval_grpo": evaluate}))
    assert list(rows) == ["eval_base", "sft", "eval_sft", "grpo", "eval_grpo"]
    grpo = client.get_run(rows["grpo"].run_id).data
    assert grpo.metrics["steps"] == 1 and "reward/correct/mean" in grpo.metrics
    assert {"checkpoint", "adapter"} <= set(rows["grpo"].outputs)  # LoRA: merged policy and the adapter alone
    settings = {client.get_run(rows[s].run_id).data.tags["posttrain.eval_settings"]
                for s in ("eval_base", "eval_sft", "eval_grpo")}
    assert len(settings) == 1  # the three evaluations compare like for like
    from stages.models.pretrained import machine_cache_dir  # the conversion, kept for the machine's other homes

    assert list((machine_cache_dir() / "models").glob("gguf-*/posttrain_source.json"))


def test_gsm8k_pipeline_reads_the_hub_cache_offline_and_benchmarks_with_lm_evals_own_gsm8k(run, tiny_checkpoint,
                                                                                          hf_cache, capsys):
    """The GPU-worker pipeline on this machine: the model and GSM8K from a Hugging Face cache with the hub off
    (a tiny chat model and GSM8K-shaped rows), the stages here instead of on the `gpu` pool, and lm-eval's shipped
    gsm8k task (its prompt, filters and metric) reading the cached snapshot, which `datasets` alone cannot."""
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-evaluation-harness is not installed (the bench extra)")
    from test_hub_data import gsm8k_cache
    from test_model_sources import make_hub_cache

    from flows.cli import main

    pipeline = str(ROOT / "pipelines" / "gsm8k.yaml")
    assert main(["validate", pipeline]) == 2  # nothing cached: every piece that must be is named
    refused = capsys.readouterr().err
    assert "model.hub: hub model 'Qwen/Qwen2.5-0.5B-Instruct' is not in the local Hugging Face cache" in refused
    assert "data.train.hub: hub dataset 'openai/gsm8k' is not in the Hugging Face cache" in refused
    gsm8k_cache(hf_cache)
    make_hub_cache(hf_cache, "Qwen/Qwen2.5-0.5B-Instruct", tiny_checkpoint)  # a stand-in, to validate the file
    assert main(["validate", pipeline]) == 0, capsys.readouterr().err
    make_hub_cache(hf_cache, "posttrain-tests/tiny-chat", tiny_checkpoint)  # what the shrunk run trains
    bench = ["lm_eval.limit=2", "lm_eval.num_fewshot=1", "lm_eval.backend=hf", "lm_eval.gen_kwargs={max_gen_toks: 8}"]
    evaluate = ["sampling.attempts=2", "sampling.max_tokens=8"]
    rows, client = run("gsm8k", ["model.hub=posttrain-tests/tiny-chat", "resources=null", "data.train.n=16",
                                 "data.heldout.n=4"] + stage_overrides({
        "bench_base": bench, "bench_grpo": bench, "eval_base": evaluate, "eval_grpo": evaluate,
        "grpo": ["max_steps=1", "prompts_per_step=2", "sampling.attempts=2", "sampling.max_tokens=8",
                 "dynamic_sampling=null"]}))
    assert list(rows) == ["bench_base", "eval_base", "grpo", "eval_grpo", "bench_grpo"]
    assert "reward/correct/mean" in client.get_run(rows["grpo"].run_id).data.metrics
    base, trained = (client.get_run(rows[s].run_id).data for s in ("bench_base", "bench_grpo"))
    assert base.params["datasets_from_cache"] == "openai/gsm8k@" + "1a" * 20  # the snapshot, not the hub
    for data in (base, trained):
        assert {"lm_eval/gsm8k/exact_match_strict-match", "lm_eval/gsm8k/exact_match_strict-match_stderr",
                "lm_eval/gsm8k/exact_match_flexible-extract"} <= set(data.metrics), sorted(data.metrics)
    assert base.tags["posttrain.eval_settings"] == trained.tags["posttrain.eval_settings"]  # like for like
    samples = json.loads(Path(client.download_artifacts(rows["bench_base"].run_id, "lm_eval/gsm8k.json")).read_text())
    assert {row[samples["columns"].index("doc_id")] for row in samples["data"]} == {0, 1}  # limit 2
    prompts = [row[samples["columns"].index("prompt")] for row in samples["data"]]  # lm-eval's prompt, one shot
    assert all(p.count("Question: Tom has") == 2 and p.endswith("Answer:<|end|><|assistant|>") for p in prompts)
