"""The rl stage with algorithm grpo (TRL GRPOTrainer underneath) and reward checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import QUICKSTART, run_cli
from stages.data.sources import ArithmeticData, materialize
from stages.rewards.known_cases import RewardCase
from stages.rewards.spec import RewardSpec
from stages.rl import RewardCheckFailed
from stages.rl_common import rl_stage_config
from stages.context import StageInputs

RL_METRICS = ["reward/mean", "reward/correct/mean", "reward/zero_variance_group_frac", "kl", "entropy",
              "clip_frac", "ratio/mean", "completion/mean_tokens", "completion/truncated_frac"]


# the fields that say where and how often resumable checkpoints are written: not what a step computes
CHECKPOINTING = ("output_dir", "logging_dir", "save_strategy", "save_steps", "save_total_limit")


def grpo_config(**overrides):
    fields = dict(kind="rl", algorithm="grpo", policy="base", data="train", rewards=["correct"], kl_beta=0.05,
                  sampling={"attempts": 4, "max_tokens": 3}, prompts_per_step=4, max_steps=3, sample_every=2)
    return rl_stage_config(**(fields | overrides))


def inputs_for(home, checkpoint, rewards=None, checks=None):
    data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
    return StageInputs(policy=checkpoint, datasets={"train": data},
                       rewards=rewards or {"correct": RewardSpec(fn="exact_answer")}, reward_checks=checks or {})


def test_grpo_stage_trains_and_logs_the_design_metrics(tiny_checkpoint, ctx_factory, home):
    from stages import rl
    from stages.models.loading import load_model_and_tokenizer

    ctx = ctx_factory("grpo")
    # an untrained model is never right, so add a length reward that varies within groups
    rewards = {"correct": RewardSpec(fn="exact_answer"),
               "short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    outputs = rl.run(grpo_config(rewards=["correct", "short"]), inputs_for(home, tiny_checkpoint, rewards), ctx)
    history = {name: ctx.metric_history(name) for name in RL_METRICS}
    assert all(len(points) == 3 for points in history.values()), {k: len(v) for k, v in history.items()}
    assert [p.step for p in history["kl"]] == [1, 2, 3]
    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))
    artifacts = {a.path for a in ctx.client.list_artifacts(ctx.run_id)}
    assert "curves.png" in artifacts
    tables = {a.path for a in ctx.client.list_artifacts(ctx.run_id, "samples")}
    assert tables == {"samples/step_00002.json", "samples/step_00003.json"}


@pytest.mark.parametrize("advantage", ["group_centered", "group_normalized"])
def test_group_advantages_by_hand(tiny_checkpoint, ctx_factory, home, tmp_path, advantage):
    """What TRL computes with advantage: group_centered is the seeds' unstandardised centring (reward minus
    the group mean); group_normalized also divides by the group's unbiased std (+ 1e-4, TRL's epsilon)."""
    import statistics

    from stages import rl

    ctx = ctx_factory(f"grpo-adv-{advantage}")
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    rl.run(grpo_config(max_steps=1, sample_every=1, rewards=["short"], advantage=advantage),
           inputs_for(home, tiny_checkpoint, rewards), ctx)
    path = ctx.client.download_artifacts(ctx.run_id, "samples/step_00001.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert len(rows) == 16
    spread = 0
    for start in range(0, 16, 4):
        group = rows[start:start + 4]
        mean = sum(r["reward/short"] for r in group) / 4
        scale = 1.0 if advantage == "group_centered" else statistics.stdev(r["reward/short"] for r in group) + 1e-4
        for r in group:
            assert r["advantage"] == pytest.approx((r["reward/short"] - mean) / scale, abs=1e-5)
        spread += max(r["reward/short"] for r in group) > min(r["reward/short"] for r in group)
    assert spread  # some group had different rewards, so the check is not trivially zero == zero
    (logged,) = ctx.metric_history("reward/zero_variance_group_frac")  # against a hand count of the same groups
    assert logged.value == pytest.approx((4 - spread) / 4)


def test_reused_samples_move_the_importance_ratio(tiny_checkpoint, ctx_factory, home):
    """With 2 updates per generated batch the second update is off-policy: ratio != 1."""
    from stages import rl

    ctx = ctx_factory("grpo-reuse")
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    rl.run(grpo_config(rewards=["short"], max_steps=4, updates_per_batch=2, lr=5e-2),
           inputs_for(home, tiny_checkpoint, rewards), ctx)
    ratios = {p.step: p.value for p in ctx.metric_history("ratio/mean")}
    assert ratios[1] == pytest.approx(1.0, abs=1e-6) and ratios[3] == pytest.approx(1.0, abs=1e-6)
    assert abs(ratios[2] - 1.0) > 1e-4 and abs(ratios[4] - 1.0) > 1e-4


def test_failing_reward_check_refuses_to_train(tiny_checkpoint, ctx_factory, home):
    from stages import rl

    lenient = {"correct": RewardSpec(fn="exact_answer", kwargs={"extract": "last_number"})}
    checks = {"correct": [RewardCase(case="shortcut", answer="7", completion="6 or 7", max=0.0)]}
    ctx = ctx_factory("grpo-checked")
    with pytest.raises(RewardCheckFailed, match="shortcut.*'6 or 7': score 1 > max 0"):
        rl.run(grpo_config(check_rewards=True), inputs_for(home, tiny_checkpoint, lenient, checks), ctx)
    assert not ctx.staged  # no checkpoint was even started


def exploding_reward(completions, **_):
    raise ValueError("verifier crashed")


def test_reward_exception_fails_the_stage_with_the_sample(tiny_checkpoint, ctx_factory, home):
    from stages import rl

    rewards = {"boom": RewardSpec(fn="test_grpo:exploding_reward")}
    with pytest.raises(RuntimeError, match="reward 'boom' raised ValueError: verifier crashed on completion '.*'"):
        rl.run(grpo_config(rewards=["boom"]), inputs_for(home, tiny_checkpoint, rewards), ctx_factory("boom"))


def test_algorithm_specific_fields_are_checked():
    """The rl config is a union told apart by `algorithm`: each algorithm's model holds its own fields only,
    and a field of the other algorithm is named as such (even at its default value)."""
    from stages.rl_common import GRPOStageConfig, PPOStageConfig

    assert type(grpo_config()) is GRPOStageConfig and not hasattr(grpo_config(), "gamma")
    ppo = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["correct"])
    assert type(ppo) is PPOStageConfig and not hasattr(ppo, "loss")
    with pytest.raises(ValueError, match="gamma only applies to algorithm ppo, not grpo"):
        grpo_config(gamma=1.0)
    with pytest.raises(ValueError, match="advantage only applies to algorithm grpo, not ppo"):
        rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["c"], advantage="group_centered")
    with pytest.raises(ValueError, match="sampling.attempts >= 2"):
        grpo_config(sampling={"attempts": 1})


def test_check_reward_command(home, capsys):
    assert run_cli("check-reward", str(QUICKSTART)) == 0
    assert "6 cases, 0 violations" in capsys.readouterr().out
    # a reward that reads the last number pays the hedging shortcut: caught before training
    assert run_cli("check-reward", str(QUICKSTART), "--set", "rewards.correct.kwargs.extract=last_number") == 1
    assert "VIOLATION: score 1 > max 0" in capsys.readouterr().out
    assert run_cli("check-reward", str(QUICKSTART), "--reward", "nope") == 2


def test_cispo_caps_the_weight_at_cispo_cap_not_at_clip_epsilon(tiny_checkpoint, ctx_factory, home):
    """TRL's CISPO reads epsilon_high as an absolute cap on the ratio: on-policy (ratio exactly 1)
    nothing may be clipped, where a cap of clip_epsilon (0.2) clipped every positive-advantage token."""
    from stages import rl

    ctx = ctx_factory("grpo-cispo")
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    rl.run(grpo_config(rewards=["short"], max_steps=2, loss="cispo"), inputs_for(home, tiny_checkpoint, rewards), ctx)
    clipped = [p.value for p in ctx.metric_history("clip_frac")]
    assert len(clipped) == 2 and clipped == [0.0, 0.0]


def test_cispo_cap_is_validated():
    from stages.grpo import build_grpo_config

    assert build_grpo_config(grpo_config(loss="cispo"), Path("out"), 0).epsilon_high == 5.0
    assert build_grpo_config(grpo_config(loss="cispo", cispo_cap=3.0), Path("out"), 0).epsilon_high == 3.0
    for bad in (1.0, 0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="cispo_cap"):
            grpo_config(loss="cispo", cispo_cap=bad)
    from flows.spec.validate import not_applicable

    assert not_applicable(grpo_config(loss="cispo", cispo_cap=3.0)) == []
    [(where, message)] = not_applicable(grpo_config(loss="dapo", cispo_cap=3.0))
    assert where == ("cispo_cap",) and "applies only when loss is cispo (here loss is dapo)" in message
    with pytest.raises(ValueError, match="cispo_cap only applies to algorithm grpo"):
        rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["correct"], cispo_cap=3.0)


def test_grpo_samples_without_the_checkpoints_generation_config(tiny_checkpoint, ctx_factory, home, tmp_path):
    """A generation_config.json that suppresses every token but "7" must not steer GRPO's rollouts."""
    from stages import rl
    from stages.models.loading import load_model_and_tokenizer

    from test_ppo import with_generation_config

    _, tokenizer = load_model_and_tokenizer(tiny_checkpoint)
    keep = {tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id}
    checkpoint = with_generation_config(tiny_checkpoint, tmp_path / "leaky",
                                        suppress_tokens=[i for i in range(len(tokenizer)) if i not in keep])
    ctx = ctx_factory("grpo-neutral")
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    outputs = rl.run(grpo_config(rewards=["short"], max_steps=1, sample_every=1),
                     inputs_for(home, checkpoint, rewards), ctx)
    table = json.loads(Path(ctx.client.download_artifacts(ctx.run_id, "samples/step_00001.json")).read_text())
    completions = [row[table["columns"].index("completion")] for row in table["data"]]
    assert len(completions) == 16 and any(set(c) - {"7"} for c in completions), completions
    saved = json.loads((Path(outputs["checkpoint"]) / "generation_config.json").read_text())
    assert len(saved["suppress_tokens"]) == len(tokenizer) - 2  # the checkpoint's own config is kept


def test_grpo_turns_the_checkpoints_dropout_off(tiny_checkpoint, ctx_factory, home, tmp_path):
    """At step 1 the policy is the reference: the KL must be 0, not the noise of dropout in the policy."""
    import shutil

    from stages import rl

    checkpoint = tmp_path / "dropout"
    shutil.copytree(tiny_checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    ctx = ctx_factory("grpo-dropout")
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    rl.run(grpo_config(rewards=["short"], max_steps=1), inputs_for(home, checkpoint, rewards), ctx)
    (kl,) = ctx.metric_history("kl")
    assert kl.value == pytest.approx(0.0, abs=1e-6)


def plain_length_penalty(completions, **_):
    """A TRL user's reward: minus half a point per character (an untrained model is never right, so the
    reward must vary within groups for the steps to move the policy)."""
    return [-0.5 * len(c[-1]["content"]) for c in completions]


PARITY = {  # the stage's fields -> what a TRL user sets for them
    "dapo": ({}, {}),
    "cispo": ({"loss": "cispo"}, {"loss_type": "cispo", "epsilon_high": 5.0}),
    "grpo-normalized": ({"loss": "grpo", "advantage": "group_normalized"},
                        {"loss_type": "grpo", "scale_rewards": "group"}),
    "dr_grpo": ({"loss": "dr_grpo"}, {"loss_type": "dr_grpo"}),
    # two updates per batch: the second is off-policy, and its ratios pass a cap of 1.01
    "cispo-reused": ({"loss": "cispo", "cispo_cap": 1.01, "updates_per_batch": 2},
                     {"loss_type": "cispo", "epsilon_high": 1.01, "num_iterations": 2}),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_the_grpo_stage_computes_what_trl_computes_on_the_same_batches(tiny_checkpoint, ctx_factory, home, tmp_path,
                                                                         case):
    """Parity with TRL's GRPOTrainer driven directly, as a TRL user would (a plain GRPOConfig written out,
    a plain reward, the checkpoint loaded with transformers): same seed, data and settings give the same
    loss, KL, gradient norm, reward and clipped fraction at every step (relative 1e-5: float32 on one
    machine, the same kernels), for each loss, both advantages and reused batches, so a change to how the
    stage samples, scores or logs cannot silently change the algorithm. The stage's rollouts are drawn by
    posttrain's rollout layer (stages/rollout/policy_rollouts.py ``PolicyRollouts`` on HF generate, from the
    trainer's random stream), TRL's by its own generate: equal rewards at every step say the draws are
    the same (a draw seeded per call, as the other places sample, fails this)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from stages import rl
    from stages.data.sources import read_materialized
    from stages.grpo import build_grpo_config

    steps, seed = 4, 0
    ours_fields, trl_fields = PARITY[case]
    config = grpo_config(max_steps=steps, kl_beta=0.05, lr=5e-2 if "reused" in case else 5e-3, seed=seed,
                         prompts_per_step=4, rewards=["short"],
                         sampling={"attempts": 4, "max_tokens": 3, "temperature": 1.0}, **ours_fields)
    plain = GRPOConfig(**{
        **dict(output_dir=str(tmp_path / "trl"), max_steps=steps, learning_rate=config.lr, lr_scheduler_type="constant",
               per_device_train_batch_size=16, gradient_accumulation_steps=1, steps_per_generation=1,
               num_generations=4, max_completion_length=3, temperature=1.0, top_p=1.0, beta=0.05, loss_type="dapo",
               scale_rewards="none", epsilon=0.2, logging_steps=1, save_strategy="no", report_to="none", seed=seed,
               data_seed=seed, use_cpu=True, bf16=False, gradient_checkpointing=False, disable_dropout=True,
               log_completions=False, dataloader_num_workers=0),
        **trl_fields})
    ours_args = build_grpo_config(config, tmp_path / "ours", seed).to_dict()
    # where checkpoints go, not what is computed; and ours takes its rows in posttrain's order, which must be the
    # order TRL's own sampler draws (stages/data/prompt_order.py): the equal histories below say it is
    differ = {k: (v, plain.to_dict().get(k)) for k, v in ours_args.items()
              if k not in (*CHECKPOINTING, "shuffle_dataset") and v != plain.to_dict().get(k)}
    assert ours_args["shuffle_dataset"] is False and plain.shuffle_dataset is True
    assert not differ, differ

    inputs = inputs_for(home, tiny_checkpoint,
                        {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})})
    ctx = ctx_factory(f"grpo-parity-{case}")
    rl.run(config, inputs, ctx)
    ours = {name: [p.value for p in sorted(ctx.metric_history(name), key=lambda p: p.step)]
            for name in ("loss", "kl", "grad_norm", "reward/mean", "clip_frac")}

    logged: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(dict(logs))

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokenizer.padding_side = "left"
    records = read_materialized(inputs.datasets["train"])
    dataset = Dataset.from_list([{"prompt": r["messages"][:-1], "answer": r["answer"]} for r in records])
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_checkpoint),
                          reward_funcs=[plain_length_penalty], args=plain, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Keep()])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    keys = {"loss": "loss", "kl": "kl", "grad_norm": "grad_norm", "reward/mean": "reward",  # rewards: per generation
            "clip_frac": "cispo_clip_ratio" if config.loss == "cispo" else "clip_ratio/region_mean"}
    theirs = {name: [x[key] for x in logged if key in x] for name, key in keys.items()}

    assert len(logged) == steps and all(len(ours[name]) == steps for name in ("loss", "grad_norm", "clip_frac"))
    for name in ours:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-8), (name, ours[name], theirs[name])
    assert any(g > 0 for g in ours["grad_norm"]) and any(k > 0 for k in ours["kl"][1:])  # the steps did something
    if "reused" in case:  # the reused batches (steps 2 and 4) went past the cap, the fresh ones did not
        assert ours["clip_frac"][0] == ours["clip_frac"][2] == 0.0
        assert ours["clip_frac"][1] > 0 and ours["clip_frac"][3] > 0, ours["clip_frac"]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo"])
def test_sampler_weights_folded_into_advantages_are_trls_own_vllm_correction(tiny_checkpoint, tmp_path, loss_type):
    """The stage corrects engine samples by weighting each token's advantage (TRL takes (B, T) advantages);
    TRL's own correction multiplies each token's loss by the same weight, but only under its use_vllm. On
    one batch, through TRL's _compute_loss both ways, the loss and every gradient agree: the KL term is
    weighted by neither, and a weight of 0 (a masked sequence) takes the token out of both."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=3,
                      beta=0.05, loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None,
                      report_to="none", use_cpu=True, bf16=False, disable_dropout=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_checkpoint), args=args,
                          reward_funcs=[plain_length_penalty], processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1"}]}] * 4))
    generator = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    batch = {"prompt_ids": torch.randint(0, vocab, (4, 5), generator=generator), "prompt_mask": torch.ones(4, 5, dtype=torch.long),
             "completion_ids": torch.randint(0, vocab, (4, 3), generator=generator),
             "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]),
             "advantages": torch.tensor([0.5, -0.5, 1.0, -1.0]), "num_items_in_batch": torch.tensor(9),
             "ref_per_token_logps": -torch.rand(4, 3, generator=generator) - 8.0,
             # a previous update's log-probs, so the ratio is off 1 and the clipping takes part
             "old_per_token_logps": -torch.rand(4, 3, generator=generator) - 8.0}
    weights = torch.tensor([[0.5, 2.0, 3.0], [1.0, 0.0, 0.0], [0.25, 0.0, 0.0], [0.0, 0.0, 0.0]])

    def loss_and_grads(inputs, use_vllm):
        trainer.model.zero_grad()
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = use_vllm
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    trl_loss, trl_grads = loss_and_grads({**batch, "importance_sampling_ratio": weights}, use_vllm=True)
    ours_loss, ours_grads = loss_and_grads({**batch, "advantages": batch["advantages"].unsqueeze(1) * weights},
                                           use_vllm=False)
    trainer.use_vllm = False
    assert ours_loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-8)
    assert len(ours_grads) == len(trl_grads) > 0
    # float32 sums in another order: each gradient within 1e-5 of the largest entry of its tensor
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours_grads, trl_grads))
    assert worst < 1e-5, worst
    plain_loss, _ = loss_and_grads(batch, use_vllm=False)
    assert plain_loss != pytest.approx(trl_loss, rel=1e-3)  # the weights changed the loss: the test can fail


def test_rollouts_drawn_on_the_training_model_carry_its_log_probs_and_weights_version(tiny_checkpoint, tmp_path):
    """GRPO's single completions on HF generate come from the rollout layer (TRL's ``rollout_func`` contract:
    called with the step's prompts and the trainer): each carries its token ids, the log-probs the training
    model gave them as it sampled (its own forward pass over prompt and completion gives the same, 1e-5),
    and the version of the weights (the trainer's optimizer steps); the draws continue the trainer's random
    stream, so the same stream state draws the same completions and the next call draws others."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from stages.rollout.episodes import EpisodeRunner
    from stages.sampling import SamplingSettings
    from stages.rollout.policy_rollouts import PolicyRollouts

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompts = [[{"role": "user", "content": f"{a}+{a}"}] for a in range(3)]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=12, num_generations=4,
                      max_completion_length=5, report_to="none", use_cpu=True, bf16=False, disable_dropout=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_checkpoint), args=args,
                          reward_funcs=[plain_length_penalty], processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    rollouts = PolicyRollouts(EpisodeRunner.completions(tokenizer), tokenizer,
                              SamplingSettings(attempts=4, max_tokens=5, temperature=1.0, seed=0), trainer_stream=True)
    step_prompts = [p for p in prompts for _ in range(4)]
    state = torch.random.get_rng_state()
    out = rollouts(step_prompts, trainer)
    torch.random.set_rng_state(state)
    assert rollouts(step_prompts, trainer) == out  # the trainer's stream, as it stood, drew them
    assert rollouts(step_prompts, trainer)["completion_ids"] != out["completion_ids"]  # and moves on

    model = trainer.model
    for prompt_ids, completion_ids, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        assert len(completion_ids) == len(logprobs) > 0
        ids = torch.tensor([prompt_ids + completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
        own = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)
        assert own.tolist() == pytest.approx(logprobs, abs=1e-5)

    trainer.state.global_step = 3  # three optimizer steps on: the samples say so
    with rollouts.engine_for(trainer) as engine:
        groups = EpisodeRunner.completions(tokenizer).run(engine, prompts[:1], rollouts.settings)
    assert [episode.weights_version for episode in groups[0]] == [3] * 4
