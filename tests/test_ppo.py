"""stages/ppo.py on a real tiny model, with a real MLflow run as its tracking handle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stages.rewards.spec import RewardSpec
from stages.rl_common import rl_stage_config
from stages.context import StageInputs

STEP_METRICS = ["reward/mean", "reward/digits/mean", "reward/errors", "kl", "entropy", "clip_frac", "ratio/mean",
                "completion/mean_tokens", "completion/truncated_frac", "value_loss", "policy_loss", "kl_beta",
                "reward/zero_variance_group_frac"]


def digit_share(completions, **_):
    """Share of the completion's characters that are digits: learnable by a random tiny model."""
    return [sum(c.isdigit() for c in text) / len(text) if text else 0.0 for text in completions]


def exploding_reward(completions, **_):
    raise ZeroDivisionError("the reward divided by zero")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and far faster when other jobs share the cores
    (two spinning OpenMP threads on a busy 2-core box made a PPO step ~20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as handle:
        for a in range(10):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+1?"},
                                                  {"role": "assistant", "content": str(a + 1)}],
                                     "answer": str(a + 1)}) + "\n")
    return path


def ppo_config(**overrides):
    fields = dict(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["digits"],
                  prompts_per_step=4, ppo_epochs=2, minibatch_size=8, lr=1e-3, kl_beta=0.05, sample_every=2)
    sampling = {"attempts": 4, "max_tokens": 6, **overrides.pop("sampling", {})}
    return rl_stage_config(**{**fields, **overrides, "sampling": sampling})


def run_inputs(checkpoint, data, rewards=None):
    return StageInputs(policy=checkpoint, datasets={"data": data},
                       rewards=rewards or {"digits": RewardSpec(fn="test_ppo:digit_share")})


def test_ppo_smoke_changes_policy_logs_every_metric_and_saves(tiny_checkpoint, prompts_file, ctx_factory):
    from stages.models.loading import load_model_and_tokenizer
    from stages.ppo import train_ppo

    ctx = ctx_factory("ppo")
    config = ppo_config(max_steps=3, sampling={"temperature": 0.7}, kl_target=0.5, kl_horizon=100)
    outputs = train_ppo(config, run_inputs(tiny_checkpoint, prompts_file), ctx)

    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, tokenizer = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert tokenizer.chat_template == load_model_and_tokenizer(tiny_checkpoint)[1].chat_template
    changed = [not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values())]
    assert all(changed)
    for name in STEP_METRICS:
        history = ctx.metric_history(name)
        assert [m.step for m in history] == [1, 2, 3], name
    betas = [m.value for m in ctx.metric_history("kl_beta")]
    assert betas[0] == pytest.approx(0.05) and betas[1] != betas[0]  # the adaptive controller moved it
    # the first minibatch of every step sees the sampling policy: ratio 1 up to float error
    assert all(m.value < 1e-4 for m in ctx.metric_history("logprob/sampler_gap"))
    artifacts = {a.path for a in ctx.client.list_artifacts(ctx.run_id, "samples")}
    # the first step, every sample_every steps, and the last
    assert artifacts == {"samples/step_00001.json", "samples/step_00002.json", "samples/step_00003.json"}
    table = json.loads(Path(ctx.client.download_artifacts(ctx.run_id, "samples/step_00003.json")).read_text())
    assert {"prompt", "completion", "reward", "reward/digits", "truncated"} <= set(table["columns"])
    assert "curves.png" in {a.path for a in ctx.client.list_artifacts(ctx.run_id)}
    assert set(STEP_METRICS) <= set(outputs["metrics"])


def test_ppo_fails_when_reward_errors_pass_the_limit(tiny_checkpoint, prompts_file, ctx_factory):
    from stages.ppo import train_ppo

    rewards = {"boom": RewardSpec(fn="test_ppo:exploding_reward")}
    with pytest.raises(RuntimeError, match=r"reward 'boom' raised ZeroDivisionError.*on completion"):
        train_ppo(ppo_config(max_steps=1, rewards=["boom"]), run_inputs(tiny_checkpoint, prompts_file, rewards),
                  ctx_factory("ppo-boom"))
    # scored instead of failing: every completion scores 0 and the errors are counted
    ctx = ctx_factory("ppo-score")
    outputs = train_ppo(ppo_config(max_steps=1, rewards=["boom"], reward_errors="score"),
                        run_inputs(tiny_checkpoint, prompts_file, rewards), ctx)
    assert outputs["metrics"]["reward/errors"] == 16 and outputs["metrics"]["reward/mean"] == 0.0


def test_rollouts_are_built_from_recorded_token_ids(tiny_checkpoint):
    """Training log-probs of the unchanged policy reproduce the sampler's, at temperature 0.7."""
    from stages.engines.hf_generate import HFEngine
    from stages.sampling import SamplingSettings
    from stages.models.loading import load_model_and_tokenizer
    from stages.ppo import build_rollout, completion_logits
    from stages.rl_math import token_logprobs
    from stages.engines.interface import prompt_token_ids

    model, tokenizer = load_model_and_tokenizer(tiny_checkpoint, for_generation=True)
    prompts = [[{"role": "user", "content": "What is 3+4?"}], [{"role": "user", "content": "Hi"}]]
    groups = HFEngine(model, tokenizer).generate(
        prompts, SamplingSettings(temperature=0.7, max_tokens=16, attempts=8, seed=1))
    rollout = build_rollout(prompt_token_ids(tokenizer, prompts), groups, tokenizer.pad_token_id)

    for row, sample in enumerate(rollout.samples):
        prompt = tokenizer.apply_chat_template(prompts[rollout.prompt_index[row]], tokenize=False,
                                               add_generation_prompt=True)
        real = rollout.input_ids_B_L[row][rollout.attention_mask_B_L[row].bool()].tolist()
        assert real == tokenizer(prompt, add_special_tokens=False)["input_ids"] + sample.token_ids
    assert any(not s.truncated for s in rollout.samples)  # an eos inside the batch: padding is exercised
    with torch.no_grad():
        logprobs = token_logprobs(completion_logits(model, rollout, slice(None), 0.7), rollout.completion_ids_B_T)
    mask = rollout.mask_B_T.bool()
    assert torch.allclose(logprobs[mask], rollout.sample_logprobs_B_T[mask], atol=1e-4)
    with torch.no_grad():  # and the temperature matters: at 1.0 they would not match
        untempered = token_logprobs(completion_logits(model, rollout, slice(None), 1.0), rollout.completion_ids_B_T)
    assert not torch.allclose(untempered[mask], rollout.sample_logprobs_B_T[mask], atol=1e-2)


def test_ppo_learns_a_trivial_reward(tiny_checkpoint, prompts_file, ctx_factory):
    """An untrained tiny model writes ~10% digits; PPO makes it write almost only digits,
    drifting away from the reference as it does."""
    from stages.ppo import train_ppo

    ctx = ctx_factory("ppo-learn")
    config = ppo_config(max_steps=15, lr=1e-2, kl_beta=0.02, sampling={"attempts": 8}, ppo_epochs=2, minibatch_size=16)
    train_ppo(config, run_inputs(tiny_checkpoint, prompts_file), ctx)
    rewards = [m.value for m in ctx.metric_history("reward/mean")]
    kls = [m.value for m in ctx.metric_history("kl")]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.3 and end > start + 0.5, rewards
    assert kls[0] < 1e-4 < kls[-1]  # step 1 samples from the reference itself


def with_generation_config(checkpoint: Path, target: Path, **fields) -> Path:
    """A copy of ``checkpoint`` whose generation_config.json also sets ``fields``, as hub checkpoints do."""
    import shutil

    shutil.copytree(checkpoint, target)
    path = target / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return target


def test_the_checkpoints_generation_config_does_not_leak_into_sampling(tiny_checkpoint, tmp_path):
    """min_p, repetition_penalty and top_k in a checkpoint's generation_config.json are not our settings
    (not hashed, ignored by vLLM): the sampler's log-probs must be the tempered distribution's."""
    from stages.engines.hf_generate import HFEngine
    from stages.sampling import SamplingSettings
    from stages.models.loading import load_model_and_tokenizer
    from stages.ppo import build_rollout, completion_logits
    from stages.rl_math import token_logprobs
    from stages.engines.interface import prompt_token_ids

    checkpoint = with_generation_config(tiny_checkpoint, tmp_path / "leaky", min_p=0.2, repetition_penalty=1.3,
                                        top_k=5)
    model, tokenizer = load_model_and_tokenizer(checkpoint, for_generation=True)
    prompts = [[{"role": "user", "content": "What is 3+4?"}], [{"role": "user", "content": "Hi"}]]
    groups = HFEngine(model, tokenizer).generate(
        prompts, SamplingSettings(temperature=1.0, max_tokens=12, attempts=8, seed=1))
    rollout = build_rollout(prompt_token_ids(tokenizer, prompts), groups, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = token_logprobs(completion_logits(model, rollout, slice(None), 1.0), rollout.completion_ids_B_T)
    mask = rollout.mask_B_T.bool()
    assert torch.allclose(logprobs[mask], rollout.sample_logprobs_B_T[mask], atol=1e-4)
    # the checkpoint keeps its own generation config (saved with it, for whoever serves it)
    assert model.generation_config.min_p == 0.2 and model.generation_config.repetition_penalty == 1.3


def test_ppo_with_top_p_trains_against_the_distribution_it_records(tiny_checkpoint, prompts_file, ctx_factory):
    """Sampled with top_p 0.9, the first update must still start at ratio 1: the old log-probs are the
    full tempered distribution the loss uses, not the sampler's nucleus-renormalised one."""
    from stages.ppo import train_ppo

    ctx = ctx_factory("ppo-top-p")
    config = ppo_config(max_steps=1, sampling={"temperature": 0.7, "top_p": 0.9}, ppo_epochs=1, minibatch_size=16)
    outputs = train_ppo(config, run_inputs(tiny_checkpoint, prompts_file), ctx)
    assert outputs["metrics"]["ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert outputs["metrics"]["clip_frac"] == 0.0
    # what the nucleus changed is still measured: the sampler's log-probs are higher than the full distribution's
    assert outputs["metrics"]["logprob/sampler_gap"] > 0.01


def test_ppo_entropy_is_the_rollout_policys(tiny_checkpoint, prompts_file, ctx_factory):
    """The same first rollout batch under two learning rates: its entropy cannot depend on the update."""
    from stages.ppo import train_ppo

    entropies = []
    for lr in (1e-6, 0.3):
        config = ppo_config(max_steps=1, lr=lr, ppo_epochs=1, minibatch_size=4)
        outputs = train_ppo(config, run_inputs(tiny_checkpoint, prompts_file), ctx_factory(f"ppo-entropy-{lr}"))
        entropies.append(outputs["metrics"]["entropy"])
    assert entropies[0] == pytest.approx(entropies[1], abs=1e-5)


def test_vf_coef_is_refused_with_the_reason():
    """Policy and critic have their own Adam optimisers, so a constant weight on the value loss changes nothing."""
    with pytest.raises(ValueError, match="vf_coef has no effect.*critic_lr"):
        ppo_config(vf_coef=0.5)


@pytest.mark.parametrize("whiten", [False, True])
def test_ppo_advantages_by_hand_with_and_without_whitening(tiny_checkpoint, whiten):
    """With the reference equal to the policy (KL 0) and the critic's zero head (values 0), each token's reward
    is the task score at the last action, so GAE(gamma 1, lambda 0.95) gives advantage 0.95^(last - t) * score;
    ``whiten_advantages: false`` keeps exactly that, ``true`` whitens it over the batch's actions."""
    from stages.engines.hf_generate import HFEngine
    from stages.sampling import SamplingSettings
    from stages.models.loading import load_model_and_tokenizer
    from stages.models.critic import ValueModel
    from stages.models.loading import load_frozen_reference
    from stages.ppo import build_rollout, compute_targets
    from stages.engines.interface import prompt_token_ids
    from stages.rl_math import masked_whiten

    policy, tokenizer = load_model_and_tokenizer(tiny_checkpoint, for_generation=True)
    prompts = [[{"role": "user", "content": "What is 3+4?"}], [{"role": "user", "content": "Hi"}]]
    groups = HFEngine(policy, tokenizer).generate(
        prompts, SamplingSettings(temperature=1.0, max_tokens=6, attempts=4, seed=1))
    rollout = build_rollout(prompt_token_ids(tokenizer, prompts), groups, tokenizer.pad_token_id)
    config = ppo_config(whiten_advantages=whiten, gamma=1.0, lam=0.95)
    scores_B = torch.linspace(-1.0, 2.0, len(rollout.samples))
    targets = compute_targets(policy, load_frozen_reference(tiny_checkpoint), ValueModel.from_policy_checkpoint(
        tiny_checkpoint), rollout, scores_B, 0.05, config)

    mask = rollout.mask_B_T
    assert targets.k1.abs().max() < 1e-6 and targets.old_values.abs().max() == 0  # KL 0, values 0
    last_B = mask.sum(-1).long() - 1  # single-turn: the actions are the first tokens of each row
    hand = torch.zeros_like(mask, dtype=torch.float32)
    for b in range(mask.shape[0]):
        for t in range(int(last_B[b]) + 1):
            hand[b, t] = 0.95 ** (int(last_B[b]) - t) * float(scores_B[b])
    expected = masked_whiten(hand, mask) * mask if whiten else hand
    assert torch.allclose(targets.advantages * mask, expected, atol=1e-5)
    assert torch.allclose(targets.returns * mask, hand, atol=1e-5)  # returns = advantages + values, unwhitened
