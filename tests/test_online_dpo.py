"""stages/online_dpo.py: pairs from scored samples, the DPO loss on one batch by hand, and real steps
on a tiny model with a real MLflow run as the tracking handle."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import torch_threads
from stages.context import StageInputs
from stages.online_dpo import OnlineDPOStageConfig
from stages.rewards.spec import RewardSpec


def digit_share(completions, **_):
    """Share of the completion's characters that are digits: differs between a random tiny model's samples."""
    return [sum(c.isdigit() for c in text) / len(text) if text else 0.0 for text in completions]


def constant(completions, **_):
    return [1.0] * len(completions)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as handle:
        for a in range(8):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+1?"}],
                                     "answer": str(a + 1)}) + "\n")
    return path


def config(**overrides) -> OnlineDPOStageConfig:
    fields = dict(kind="online_dpo", model="base", data="train", rewards=["digits"], prompts_per_step=4,
                  max_steps=2, beta=0.1, lr=1e-2, backend="hf", sample_every=1,
                  sampling={"attempts": 3, "max_tokens": 6, "temperature": 1.0})
    return OnlineDPOStageConfig(**{**fields, **overrides})


def test_pairs_take_the_best_and_worst_sample_and_skip_ties():
    from stages.preference_math import best_worst_pairs

    scores = [[1.0, 0.0, 1.0, 0.0],   # best: first of the 1s (0); worst: last of the 0s (3)
              [0.0, 0.0, 0.0, 0.0],   # tie
              [0.5, 2.0, 2.0, -1.0],  # best 1, worst 3
              [0.3, 0.3, 0.3, 0.3],   # tie
              [0.0, 0.25, 0.0, 0.0]]  # best 1, worst 3
    pairs, ties = best_worst_pairs(scores)
    assert pairs == [(0, 0, 3), (2, 1, 3), (4, 1, 3)]
    assert ties == [1, 3]
    assert all(scores[p][c] > scores[p][r] for p, c, r in pairs)
    with pytest.raises(ValueError, match="a pair needs at least 2"):
        best_worst_pairs([[1.0]])


def test_the_loss_is_dpo_computed_by_hand_on_one_batch(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from stages.online_dpo import dpo_step_loss, pair_batch

    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    with torch.no_grad():  # a policy that has moved from its reference
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    prompts, chosen, rejected = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 2]], [[15], [16, 17]]
    beta = 0.3
    loss, *_ = dpo_step_loss(policy, reference, pair_batch(prompts, chosen, rejected, pad_id=0), beta)

    def logp(model, prompt, reply):  # one unpadded sequence, token by token
        ids = torch.tensor([prompt + reply])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        return sum(float(torch.log_softmax(logits[len(prompt) + t - 1], -1)[token]) for t, token in enumerate(reply))

    by_hand = []
    for p, c, r in zip(prompts, chosen, rejected):
        margin = (logp(policy, p, c) - logp(reference, p, c)) - (logp(policy, p, r) - logp(reference, p, r))
        by_hand.append(-math.log(1 / (1 + math.exp(-beta * margin))))
    assert abs(sum(by_hand) / 2 - math.log(2)) > 1e-3  # the policy has moved: not the loss at the start
    assert float(loss.detach()) == pytest.approx(sum(by_hand) / 2, abs=1e-5)


def test_online_dpo_steps_change_the_policy_and_log_pairs_and_ties(tiny_checkpoint, prompts_file, ctx_factory):
    from stages.models.loading import load_model_and_tokenizer
    from stages.online_dpo import run

    ctx = ctx_factory("online-dpo")
    inputs = StageInputs(model=tiny_checkpoint, datasets={"train": prompts_file},
                         rewards={"digits": RewardSpec(fn="test_online_dpo:digit_share")})
    outputs = run(config(), inputs, ctx)

    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))
    pairs = [m.value for m in ctx.metric_history("pairs")]
    ties = [m.value for m in ctx.metric_history("pairs/tie_frac")]
    assert len(pairs) == 2 and all(p + t * 4 == 4 for p, t in zip(pairs, ties))  # every prompt: a pair or a tie
    assert outputs["metrics"]["pairs_trained"] == sum(pairs) > 0
    assert outputs["metrics"]["tied_prompts"] == sum(t * 4 for t in ties)
    first_loss = ctx.metric_history("loss")[0].value
    assert first_loss == pytest.approx(math.log(2), abs=1e-5)  # the policy starts at the reference
    for name in ("rewards/margin", "rewards/chosen", "rewards/rejected", "reward/chosen", "reward/rejected",
                 "reward/pair_margin", "reward/mean", "reward/digits/mean", "tokens_per_second", "kl"):
        assert ctx.metric_history(name), name
    chosen = [m.value for m in ctx.metric_history("reward/chosen")]
    rejected = [m.value for m in ctx.metric_history("reward/rejected")]
    assert all(c > r for c, r in zip(chosen, rejected))


def test_a_step_whose_prompts_all_tie_trains_nothing(tiny_checkpoint, prompts_file, ctx_factory):
    from stages.models.loading import load_model_and_tokenizer
    from stages.online_dpo import run

    ctx = ctx_factory("online-dpo-ties")
    inputs = StageInputs(model=tiny_checkpoint, datasets={"train": prompts_file},
                         rewards={"same": RewardSpec(fn="test_online_dpo:constant")})
    outputs = run(config(max_steps=1, rewards=["same"]), inputs, ctx)

    assert [m.value for m in ctx.metric_history("pairs/tie_frac")] == [1.0]
    assert outputs["metrics"]["pairs_trained"] == 0 and outputs["metrics"]["tied_prompts"] == 4
    assert not ctx.metric_history("loss")
    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def test_online_dpo_with_lora_trains_adapters_against_the_adapters_off_policy(tiny_checkpoint, prompts_file,
                                                                               ctx_factory):
    from stages.models.loading import load_model_and_tokenizer
    from stages.online_dpo import run

    ctx = ctx_factory("online-dpo-lora")
    inputs = StageInputs(model=tiny_checkpoint, datasets={"train": prompts_file},
                         rewards={"digits": RewardSpec(fn="test_online_dpo:digit_share")})
    outputs = run(config(max_steps=1, lora={"r": 4, "alpha": 8}), inputs, ctx)

    assert (Path(outputs["adapter"]) / "adapter_config.json").exists()
    assert ctx.metric_history("loss")[0].value == pytest.approx(math.log(2), abs=1e-5)  # reference = adapters off
    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))
