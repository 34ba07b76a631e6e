"""``resources: {processes: 2}``: SFT really trains as two gloo processes on CPU, and its
loss matches the single-process run's (same global batch) within tolerance."""

from __future__ import annotations

import pytest

from conftest import run_cli, write

pytestmark = pytest.mark.slow

PIPELINE = """\
name: {name}
model: {{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
data:
  train: {{generator: arithmetic, n: 1024, role: train}}
stages:
  sft: {{kind: sft, data: train, max_steps: 40, batch_size: 16, lr: 3.0e-3, logging_steps: 10,
        resources: {{processes: {processes}}}}}
"""


def test_sft_on_two_processes_matches_one(home, prefect_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # run from a project with a flows/ of its own: the ranks (python -m flows.execution.rank) must not import it
    (tmp_path / "project" / "flows").mkdir(parents=True)
    (tmp_path / "project" / "flows" / "__init__.py").write_text("raise SystemExit('a project\'s own flows/')\n")
    monkeypatch.chdir(tmp_path / "project")
    runs = {}
    for processes in (1, 2):
        name = f"ddp{processes}"
        path = write(tmp_path / f"{name}.yaml", PIPELINE.format(name=name, processes=processes))
        assert run_cli("run", str(path)) == 0
        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        experiment = client.get_experiment_by_name(name).experiment_id
        (runs[processes],) = client.search_runs([experiment], "tags.`posttrain.stage` = 'sft'")
    assert runs[1].data.params["world_size"] == "1"
    assert runs[2].data.params["world_size"] == "2"  # both processes joined the gloo process group
    assert runs[2].data.metrics["steps"] == runs[1].data.metrics["steps"] == 40
    one, two = runs[1].data.metrics["final_loss"], runs[2].data.metrics["final_loss"]
    assert runs[2].data.metrics["first_loss"] == pytest.approx(runs[1].data.metrics["first_loss"], rel=0.05)
    assert two == pytest.approx(one, rel=0.1), (one, two)


def test_more_processes_than_sft_supports_is_refused(home, tmp_path, capsys):
    text = PIPELINE.format(name="bad", processes=3)
    assert run_cli("validate", str(write(tmp_path / "bad.yaml", text))) == 2
    assert "batch_size 16 must divide evenly over 3 processes" in capsys.readouterr().err


# ---------------------------------------------------------------- every training stage on two processes

STAGES = """\
name: {name}
model: {{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
data:
  train: {{generator: arithmetic, n: 64, role: train}}
  prefs: {{generator: arithmetic_preferences, n: 64, role: train}}
rewards:
  verifier: {{fn: exact_answer}}
resources: {{processes: {processes}}}
stages:
  sft: {{kind: sft, data: train, max_steps: 2, batch_size: 8, resources: {{processes: 1}}}}
  rm: {{kind: reward_model, model: sft, data: prefs, max_steps: 2, batch_size: 8, logging_steps: 1}}
  dpo: {{kind: dpo, model: sft, data: prefs, max_steps: 2, batch_size: 8, logging_steps: 1}}
"""
RL_STAGES = """\
  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [verifier], max_steps: 2,
         prompts_per_step: 2, sampling: {attempts: 4}}
  ppo: {kind: rl, algorithm: ppo, policy: sft, data: train, rewards: [verifier], max_steps: 2,
        prompts_per_step: 4, sampling: {attempts: 2}, minibatch_size: 8}
"""


def test_reward_model_dpo_grpo_and_ppo_on_two_processes(home, prefect_server, tmp_path):
    """Each stage joins a 2-process gloo group; rank 0 alone records (one run per stage, one value
    per logged step); reward_model's and dpo's first losses equal the 1-process run's on the same
    global batch within 1e-4 relative (the trainers shard each global batch in order). The rl
    stages run on 2 processes only (their rollouts differ with the process count; the PPO update
    itself is compared below)."""
    from mlflow.tracking import MlflowClient

    runs = {}
    for processes, stages in ((1, ("rm", "dpo")), (2, ("rm", "dpo", "grpo", "ppo"))):
        name = f"stages{processes}"
        text = STAGES.format(name=name, processes=processes) + (RL_STAGES if processes == 2 else "")
        assert run_cli("run", str(write(tmp_path / f"{name}.yaml", text))) == 0
        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        experiment = client.get_experiment_by_name(name).experiment_id
        for stage in stages:
            (runs[processes, stage],) = client.search_runs([experiment], f"tags.`posttrain.stage` = '{stage}'")
            assert runs[processes, stage].data.params["world_size"] == str(processes), stage
    for stage, loss in (("rm", "loss"), ("dpo", "loss"), ("grpo", "reward/mean"), ("ppo", "reward/mean")):
        two = runs[2, stage]
        assert len(client.get_metric_history(two.info.run_id, loss)) == 2, stage  # not once per rank
        assert two.data.metrics.get("steps", 2) == 2
    for stage in ("rm", "dpo"):
        one, two = runs[1, stage].data.metrics, runs[2, stage].data.metrics
        assert two["first_loss"] == pytest.approx(one["first_loss"], rel=1e-4), stage
    assert runs[2, "grpo"].data.params["generation_batch"] == "8"  # 2 prompts x 4, split over the 2 ranks
    assert runs[2, "ppo"].data.params["rollout_sequences"] == "8"
    assert not list((home / "work").glob("*/rank1/discard"))  # rank 1's scratch went with the stage's


def _ppo_update(rank: int, world: int, port: int, shared: str) -> None:
    """One PPO update (targets, then 2 epochs) on this rank's shard of a fixed rollout; rank 0 writes the result."""
    import json
    import os
    from pathlib import Path

    import torch

    from stages.context import StageInputs
    from stages.training.data_parallel import join_process_group, shard
    from stages.ppo import PPORun, build_rollout, compute_targets, ppo_update
    from stages.rl_common import rl_stage_config

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    join_process_group()
    fixed = torch.load(Path(shared) / "rollout.pt", weights_only=False)
    config = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["r"],
                           sampling={"attempts": 2}, prompts_per_step=4, minibatch_size=8, ppo_epochs=2, kl_beta=0.1)
    torch.manual_seed(0)
    run = PPORun.load(config, StageInputs(policy=fixed["checkpoint"]), seed=0)
    prompt_ids, groups = shard(fixed["prompt_ids"], world, rank), shard(fixed["groups"], world, rank)
    rollout = build_rollout(prompt_ids, groups, run.tokenizer.pad_token_id)
    scores = torch.tensor(shard(fixed["scores"], world, rank))
    targets = compute_targets(run.policy, run.reference, run.critic, rollout, scores, 0.1, config)
    update = ppo_update(run.policy, run.critic, run.optimizers, rollout, targets, config,
                        torch.Generator().manual_seed(0))
    weights = torch.cat([p.detach().flatten() for p in [*run.policy.parameters(), *run.critic.parameters()]])
    if rank == 0:
        torch.save(weights, Path(shared) / f"weights{world}.pt")
        (Path(shared) / f"update{world}.json").write_text(json.dumps(update))


def test_ppo_update_on_two_processes_equals_one_process_on_the_same_rollout(tiny_checkpoint, tmp_path, monkeypatch):
    """The same 8 sampled sequences (4 prompts x 2), updated by one process or sharded over two gloo
    processes: advantages whitened over the global batch, losses normalised by the global token count,
    gradients summed. Losses and the weights after two epochs agree within 1e-5."""
    import json
    import socket

    import torch
    import torch.multiprocessing as mp

    from stages.engines.hf_generate import HFEngine

    from stages.engines.interface import prompt_token_ids
    from stages.sampling import SamplingSettings
    from stages.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_checkpoint)
    prompts = [[{"role": "user", "content": f"What is {i}+{i + 2}?"}] for i in range(4)]
    groups = HFEngine(model, tokenizer).generate(
        prompts, SamplingSettings(temperature=1.0, max_tokens=6, attempts=2, seed=3))
    scores = [float(i % 3) for i in range(8)]  # per sequence, in prompt order
    torch.save({"checkpoint": str(tiny_checkpoint), "prompt_ids": prompt_token_ids(tokenizer, prompts),
                "groups": groups, "scores": scores}, tmp_path / "rollout.pt")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _ppo_update(0, 1, 0, str(tmp_path))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_ppo_update, args=(2, port, str(tmp_path)), nprocs=2)
    one, two = (json.loads((tmp_path / f"update{w}.json").read_text()) for w in (1, 2))
    assert set(one) == set(two)
    for name in one:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name
    assert one["policy_loss"] != 0.0 and one["value_loss"] > 0.0
    weights_one, weights_two = (torch.load(tmp_path / f"weights{w}.pt") for w in (1, 2))
    assert torch.allclose(weights_one, weights_two, atol=1e-5)


FAILING_ON_RANK_1 = '''\
import os


def score(completions, **columns):
    if os.environ.get("RANK") == "1":
        raise ValueError("this reward breaks on rank 1's shard")
    return [0.0 for _ in completions]
'''


def test_one_ranks_failure_fails_the_stage_once_with_that_ranks_error(home, prefect_server, tmp_path, monkeypatch):
    """A reward that raises on rank 1 only: the stage fails once, its run says rank 1 failed first
    and carries rank 1's error and traceback, not rank 0's lost-peer aftermath."""
    from mlflow.tracking import MlflowClient

    (tmp_path / "rank_rewards.py").write_text(FAILING_ON_RANK_1)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    text = STAGES.format(name="fails", processes=2).split("  sft:")[0] + (
        "  ppo: {kind: rl, algorithm: ppo, policy: base, data: train, rewards: [flaky], max_steps: 1,\n"
        "        prompts_per_step: 4, sampling: {attempts: 2}, minibatch_size: 8}\n")
    text = text.replace("rewards:\n", "rewards:\n  flaky: {fn: 'rank_rewards:score'}\n")
    assert run_cli("run", str(write(tmp_path / "fails.yaml", text))) == 1
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fails").experiment_id
    (run,) = client.search_runs([experiment], "tags.`posttrain.stage` = 'ppo'")
    assert run.info.status == "FAILED"
    error = run.data.tags["posttrain.error"]
    assert "rank 1 of 2 training processes failed first" in error
    assert "this reward breaks on rank 1's shard" in error
    assert "Traceback" in error and "in count_reward_errors" in error  # rank 1's own traceback


REFUSED = """\
name: refused
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {generator: arithmetic, n: 64, role: train}
  prefs: {generator: arithmetic_preferences, n: 64, role: train}
  heldout: {generator: arithmetic, n: 8, seed: 9, role: heldout}
rewards:
  verifier: {fn: exact_answer}
stages:
  sft: {kind: sft, data: train, max_steps: 2, resources: {processes: 2, strategy: fsdp}}
  kto: {kind: kto, model: sft, data: prefs, batch_size: 2, resources: {processes: 2}}
  dpo: {kind: dpo, model: sft, data: prefs, batch_size: 8, resources: {gpus: 2, strategy: zero3}}
  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [verifier], prompts_per_step: 3,
         sampling: {attempts: 3}, dynamic_sampling: {}, resources: {processes: 2}}
  ppo: {kind: rl, algorithm: ppo, policy: sft, data: train, rewards: [verifier], backend: vllm,
        resources: {gpus: 2}}
  eval: {kind: eval, model: sft, data: heldout, rewards: [verifier], resources: {processes: 2}}
  kto_old: {kind: kto, model: sft, data: prefs, resources: {gpus: 2, accelerate_config: ddp}}
"""


def test_layouts_that_cannot_work_are_refused_at_validation(home, tmp_path, capsys):
    assert run_cli("validate", str(write(tmp_path / "refused.yaml", REFUSED))) == 2
    err = " ".join(capsys.readouterr().err.split())
    for expected in (
            "stage 'sft' (sft) on 2 processes: strategy fsdp needs GPUs",
            "stage 'kto' (kto) on 2 processes: kto estimates its KL reference point within each process's share",
            "stage 'dpo' (dpo) on 2 processes: strategy zero3 needs DeepSpeed, which is not installed here",
            "grpo samples prompts_per_step x sampling.attempts = 9 completions per step, which must divide evenly over 2",
            "`dynamic_sampling` is not supported on several processes",
            "ppo trains on several CPU processes (`processes: N`, DDP) only",
            "`backend` is not supported on several processes",
            "stage 'eval' (eval) on 2 processes: more than one process or GPU is for training stages",
            "accelerate_config was renamed (did you mean strategy?)"):
        assert expected in err, expected
