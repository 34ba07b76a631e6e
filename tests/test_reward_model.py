"""The reward_model and dpo stages on a tiny model, the reward model as a PPO reward and
critic, and best-of-N evaluation, each with a real MLflow run as its tracking handle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torch_threads
from stages.data.sources import ArithmeticData, ArithmeticPreferenceData, materialize, read_materialized
from stages.rewards.spec import RewardSpec
from dataclasses import replace
from stages.context import StageInputs


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def preference_file(home, n=320, **fields):
    spec = ArithmeticPreferenceData(generator="arithmetic_preferences", n=n, seed=0, role="train", **fields)
    return materialize(spec, Path("."), home / "data")


def digit_share(completions, **_):
    """Share of the completion's characters that are digits (varies even for an untrained model)."""
    return [sum(c.isdigit() for c in text) / len(text) if text else 0.0 for text in completions]


def train_reward_model(tiny_checkpoint, ctx, data, **overrides):
    from stages import reward_model

    fields = {"kind": "reward_model", "data": "prefs", "max_steps": 40, "batch_size": 16, "lr": 1e-2,
              "eval_every": 20, "logging_steps": 10, "heldout_fraction": 0.15}
    config = reward_model.RewardModelStageConfig(**{**fields, **overrides})
    return config, reward_model.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": data}), ctx)


def test_reward_model_training_raises_heldout_accuracy(tiny_checkpoint, ctx_factory, home):
    """Malformed replies against right answers: learnable in seconds, from a coin flip to > 0.9."""
    from stages.preference_math import bradley_terry_loss
    from stages.data.preferences import split_heldout
    from stages.reward_model import RewardModelScorer

    ctx = ctx_factory("rm")
    data = preference_file(home, near_miss_rate=0.0, malformed_rate=1.0)
    config, outputs = train_reward_model(tiny_checkpoint, ctx, data)
    metrics = outputs["metrics"]
    assert metrics["initial_heldout_pairwise_accuracy"] < 0.75
    assert metrics["heldout_pairwise_accuracy"] > 0.9, metrics
    assert metrics["heldout_reward_margin"] > 0.5
    history = ctx.metric_history("heldout_pairwise_accuracy")
    assert [m.step for m in history] == [0, 20, 40, 40]  # before, every eval_every steps, and the final check
    assert {m.step for m in ctx.metric_history("train/pairwise_accuracy")} == {10, 20, 30, 40}

    checkpoint = Path(outputs["checkpoint"])
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(checkpoint)
    assert saved.architectures == ["LlamaForSequenceClassification"] and saved.num_labels == 1
    assert saved.pad_token_id is not None
    # scored the way training rendered the pairs: the scorer reproduces TRL's held-out loss with our
    # Bradley-Terry function
    _, heldout = split_heldout(read_materialized(data), config.heldout_fraction, seed=0)
    scorer = RewardModelScorer(checkpoint, batch_size=7)  # batches of 7: padding is exercised
    chosen = scorer.raw_scores([r["prompt"] for r in heldout], [r["chosen"][0]["content"] for r in heldout])
    rejected = scorer.raw_scores([r["prompt"] for r in heldout], [r["rejected"][0]["content"] for r in heldout])
    ours = bradley_terry_loss(torch.tensor(chosen), torch.tensor(rejected)).item()
    assert ours == pytest.approx(ctx.metric_history("heldout_loss")[-1].value, rel=1e-4)


def test_the_reward_model_as_ppo_reward_and_critic(tiny_checkpoint, ctx_factory, home, tmp_path):
    from stages.models.critic import ValueModel
    from stages.ppo import train_ppo
    from stages.reward_model import RewardModelReward, RewardModelScorer, load_sequence_scorer
    from stages.rl_common import rl_stage_config

    _, outputs = train_reward_model(tiny_checkpoint, ctx_factory("rm"), preference_file(home, n=160), max_steps=10)
    rm_path = outputs["checkpoint"]
    # the critic starts as the reward model: same backbone and head, so the same score at the last token
    critic = ValueModel.from_reward_model(Path(rm_path))
    scorer_model, tokenizer = load_sequence_scorer(Path(rm_path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"},
                                         {"role": "assistant", "content": "4"}], tokenize=True,
                                        return_dict=True)["input_ids"]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        value = critic(input_ids, torch.ones_like(input_ids), torch.arange(len(ids))[None])[0, -1]
        score = scorer_model(input_ids=input_ids).logits[0, 0]
    assert value.item() == pytest.approx(score.item(), abs=1e-5)

    # running normalisation: every batch is rescaled by the statistics of all scores so far
    spec = RewardSpec(fn="reward_model", stage="rm", normalize="running")
    reward = RewardModelReward(RewardModelScorer(Path(rm_path)), spec)
    prompts = [[{"role": "user", "content": f"What is {a}+1?"}] for a in range(6)]
    first = reward([str(a + 1) for a in range(6)], prompts=prompts)
    assert sum(first) == pytest.approx(0.0, abs=1e-5) and torch.tensor(first).std(unbiased=False) == pytest.approx(1.0)

    prompts_file = materialize(ArithmeticData(generator="arithmetic", n=20, role="train"), Path("."), home / "data")
    rewards = {"rm": spec, "digits": RewardSpec(fn="test_reward_model:digit_share", weight=0.0)}
    config = rl_stage_config(kind="rl", algorithm="ppo", policy="base", data="train", rewards=["rm", "digits"],
                           critic="rm", sampling={"attempts": 4, "max_tokens": 6}, prompts_per_step=4, max_steps=2,
                           minibatch_size=8, lr=1e-3)
    ctx = ctx_factory("ppo-rm")
    result = train_ppo(config, StageInputs(policy=tiny_checkpoint, datasets={"train": prompts_file}, rewards=rewards,
                                           critic=rm_path, scorer_checkpoints={"rm": rm_path}), ctx)
    # trained on the reward model alone: the weight-0 reward is logged, and so is its correlation
    correlations = {m.step: m.value for m in ctx.metric_history("reward/rm/corr/digits")}
    assert list(correlations) == [1, 2]
    for step in (1, 2):
        # the correlation of the step's 16 samples, each scored by both (its sample table holds all 16)
        table = json.loads(Path(ctx.client.download_artifacts(ctx.run_id, f"samples/step_{step:05d}.json")).read_text())
        rm_scores, digits = ([row[table["columns"].index(name)] for row in table["data"]]
                             for name in ("reward/rm", "reward/digits"))
        by_hand = torch.corrcoef(torch.tensor([rm_scores, digits], dtype=torch.float64))[0, 1].item()
        assert len(rm_scores) == 16 and correlations[step] == pytest.approx(by_hand, abs=1e-6)
        rm_mean = next(m.value for m in ctx.metric_history("reward/rm/mean") if m.step == step)
        total = next(m.value for m in ctx.metric_history("reward/mean") if m.step == step)
        assert total == pytest.approx(rm_mean, abs=1e-6)
    assert result["metrics"]["steps"] == 2


def test_eval_reports_best_of_n_and_hashes_the_selection_not_the_selectors_checkpoint(tiny_checkpoint, ctx_factory,
                                                                                      home):
    from stages import eval as eval_stage
    from stages.eval import EvalConfig

    prefs = preference_file(home, n=160)
    _, outputs = train_reward_model(tiny_checkpoint, ctx_factory("rm"), prefs, max_steps=5)
    _, other_outputs = train_reward_model(tiny_checkpoint, ctx_factory("rm-other"), prefs, max_steps=5, lr=1e-3)
    heldout = materialize(ArithmeticData(generator="arithmetic", n=6, seed=9, role="heldout"), Path("."),
                          home / "data")
    sampling = {"temperature": 1.0, "max_tokens": 4, "attempts": 4, "seed": 1}
    inputs = StageInputs(model=tiny_checkpoint, datasets={"heldout": heldout},
                         rewards={"correct": RewardSpec(fn="exact_answer")})
    plain_ctx = ctx_factory("eval")
    plain = eval_stage.run(EvalConfig(kind="eval", model="base", data="heldout", rewards=["correct"],
                                      sampling=sampling), inputs, plain_ctx)
    ctx = ctx_factory("eval-best-of-n")
    config = EvalConfig(kind="eval", model="base", data="heldout", rewards=["correct"], sampling=sampling,
                        select="reward_model", reward_model="rm")
    selected = eval_stage.run(config, replace(inputs, reward_model=Path(outputs["checkpoint"])), ctx)
    # a pick is right only where one of the prompt's 4 attempts is: never above pass@4, in sixths (6 prompts)
    best = selected["metrics"]["best_of_n_accuracy"]
    assert best <= selected["metrics"]["pass_at_4"] and (best * 6) == pytest.approx(round(best * 6))
    assert selected["metrics"]["pass_at_1"] == plain["metrics"]["pass_at_1"]  # same samples, same pass@k
    assert "best_of_n_accuracy" not in plain["metrics"]
    other_ctx = ctx_factory("eval-best-of-n-other")
    other = eval_stage.run(config, replace(inputs, reward_model=Path(other_outputs["checkpoint"])), other_ctx)
    assert other["metrics"]["pass_at_1"] == plain["metrics"]["pass_at_1"]
    settings = [ctx.client.get_run(c.run_id).data.tags["posttrain.eval_settings"] for c in (plain_ctx, ctx, other_ctx)]
    assert settings[0] != settings[1]  # selecting best-of-N changes what is measured: another settings hash
    # another selector checkpoint (another seed's reward model) is another model evaluated, not another protocol:
    # one seed's best-of-N compares with another's
    assert settings[1] == settings[2]
    failures = [json.loads(line) for line in Path(selected["failures"]).read_text().splitlines()]
    assert all(0 <= case["best_of_n_pick"] < 4 for case in failures)


def test_dpo_moves_implicit_rewards_apart_and_its_loss_is_the_dpo_loss(tiny_checkpoint, ctx_factory, home):
    from stages import dpo
    from stages.models.loading import load_model_and_tokenizer

    data = preference_file(home, n=200, near_miss_rate=0.0, malformed_rate=1.0)
    ctx = ctx_factory("dpo")
    config = dpo.DPOStageConfig(kind="dpo", model="base", data="prefs", max_steps=20, batch_size=16, lr=3e-3,
                                beta=0.1, logging_steps=5)
    outputs = dpo.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": data}), ctx)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "loss"):
        assert [m.step for m in ctx.metric_history(name)] == [5, 10, 15, 20], name
    margins = [m.value for m in ctx.metric_history("rewards/margin")]
    assert margins[-1] > 0.05 and outputs["metrics"]["final_loss"] < outputs["metrics"]["first_loss"]
    assert outputs["metrics"]["heldout_pairwise_accuracy"] > 0.6
    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert all(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))

    # TRL's loss on a batch equals our dpo_loss on sequence log-probs computed here by hand
    loss, ours = trl_and_our_dpo_loss(after, before, data, beta=0.1)
    assert loss == pytest.approx(ours, rel=1e-4) and abs(loss - 0.6931) > 0.01


def trl_and_our_dpo_loss(policy, reference, data, beta, loss="sigmoid", sft_weight=0.0):
    """(TRL's loss on one batch of 8 pairs, the same loss computed here by hand from sequence log-probs)
    for the stage's ``loss`` and ``sft_weight`` (through the stage's own DPOConfig)."""
    from transformers import AutoTokenizer
    from trl import DPOTrainer

    from stages.dpo import DPOStageConfig, build_dpo_config
    from stages.preference_math import dpo_loss
    from stages.data.preferences import trl_dataset

    tokenizer = AutoTokenizer.from_pretrained(policy.config._name_or_path)
    args = build_dpo_config(DPOStageConfig(kind="dpo", model="base", data="prefs", batch_size=8, beta=beta, loss=loss,
                                           sft_weight=sft_weight), Path(policy.config._name_or_path) / "_trainer", 0)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                         train_dataset=trl_dataset(read_materialized(data)[:8]), processing_class=tokenizer)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    policy.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(inputs)).item()

        mask = inputs["completion_mask"][:, 1:]

        def token_logps(model):
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)

        policy_tokens = token_logps(policy)
        policy_c, policy_r = (policy_tokens * mask).sum(-1).chunk(2)
        reference_c, reference_r = (token_logps(reference) * mask).sum(-1).chunk(2)
    delta = (policy_c - reference_c) - (policy_r - reference_r)
    if loss == "sigmoid":
        ours = dpo_loss(policy_c, policy_r, reference_c, reference_r, beta)[0]
    elif loss == "hinge":  # SLiC: max(0, 1 - beta * delta)
        ours = torch.relu(1 - beta * delta).mean()
    else:  # IPO (Azar et al., eq. 17) on per-token means of the log-ratios (TRL's length normalisation)
        length_c, length_r = mask.sum(-1).clamp(min=1).chunk(2)
        ipo_delta = (policy_c - reference_c) / length_c - (policy_r - reference_r) / length_r
        ours = ((ipo_delta - 1 / (2 * beta)) ** 2).mean()
    if sft_weight:  # RPO: the chosen replies' token-mean negative log-likelihood
        chosen_tokens, chosen_mask = policy_tokens.chunk(2)[0], mask.chunk(2)[0].bool()
        ours = ours + sft_weight * -chosen_tokens[chosen_mask].mean()
    return trl_loss, ours.item()


def moved_policy(checkpoint):
    """(the checkpoint as a frozen reference, a policy whose weights moved off it by seeded noise)."""
    from stages.models.loading import load_model_and_tokenizer

    reference, _ = load_model_and_tokenizer(checkpoint)
    policy, _ = load_model_and_tokenizer(checkpoint)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return reference, policy


@pytest.mark.parametrize("loss, sft_weight", [("ipo", 0.0), ("hinge", 0.0), ("sigmoid", 0.5), ("ipo", 2.0)])
def test_dpo_loss_variants_are_the_losses_they_name(tiny_checkpoint, home, loss, sft_weight):
    """``loss: ipo``, ``hinge`` and ``sft_weight`` reach TRL as the losses the stage's docs name: TRL's value on a
    batch equals the formula computed here by hand (a policy whose weights moved off the reference's)."""
    data = preference_file(home, n=16, near_miss_rate=0.0, malformed_rate=1.0)
    reference, policy = moved_policy(tiny_checkpoint)
    trl_loss, ours = trl_and_our_dpo_loss(policy, reference, data, beta=0.1, loss=loss, sft_weight=sft_weight)
    assert trl_loss == pytest.approx(ours, rel=1e-4)
    assert abs(trl_loss - trl_and_our_dpo_loss(policy, reference, data, beta=0.1)[0]) > 1e-3  # not the sigmoid


def test_kto_trains_on_unpaired_replies_from_the_same_pairs(tiny_checkpoint, ctx_factory, home):
    from stages import kto
    from stages.models.loading import load_model_and_tokenizer

    data = preference_file(home, n=120, near_miss_rate=0.0, malformed_rate=1.0)
    rows = kto.unpaired(read_materialized(data), seed=0)
    assert len(rows) == 240 and sum(rows["label"]) == 120
    assert rows["label"][:8] != [True] * 8 and rows["label"][:8] != [False] * 8  # shuffled, not in blocks

    ctx = ctx_factory("kto")
    config = kto.KTOStageConfig(kind="kto", model="base", data="prefs", max_steps=10, batch_size=8, lr=3e-3,
                                logging_steps=5)
    outputs = kto.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": data}), ctx)
    for name in ("rewards/chosen", "rewards/rejected", "kl", "loss"):
        assert [m.step for m in ctx.metric_history(name)] == [5, 10], name
    assert outputs["metrics"]["heldout_reward_margin"] > 0  # desirable replies gained on undesirable ones
    before, _ = load_model_and_tokenizer(tiny_checkpoint)
    after, _ = load_model_and_tokenizer(Path(outputs["checkpoint"]))
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


def test_kto_loss_is_the_kto_loss_by_hand(tiny_checkpoint, home):
    """TRL's KTO loss on one batch of the stage's unpaired rows equals Ethayarajh et al.'s eq. 7 by hand: the
    reference point z0 = max(0, mean log-ratio of the batch's mismatched prompt/completion pairs), desirable
    replies lose w_d * (1 - sigmoid(beta * (log-ratio - z0))), undesirable ones w_u * (1 - sigmoid(beta * (z0 -
    log-ratio))), averaged over the batch; with the stage's weights and beta."""
    from transformers import AutoTokenizer
    from trl import KTOTrainer

    from stages import kto
    data = preference_file(home, n=16, near_miss_rate=0.0, malformed_rate=1.0)
    reference, policy = moved_policy(tiny_checkpoint)
    config = kto.KTOStageConfig(kind="kto", model="base", data="prefs", batch_size=8, beta=0.3,
                                desirable_weight=1.5, undesirable_weight=0.7)
    trainer = KTOTrainer(model=policy, ref_model=reference, args=kto.build_kto_config(config, home / "kto", 0),
                         train_dataset=kto.unpaired(read_materialized(data), 0),
                         processing_class=AutoTokenizer.from_pretrained(tiny_checkpoint))
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    policy.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, dict(batch)).item()

        def sequence_logps(model, prefix=""):
            ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}completion_mask"][:, 1:]
            logits = model(input_ids=ids, attention_mask=batch[f"{prefix}attention_mask"]).logits
            token_logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            return (token_logps * mask).sum(-1)

        log_ratio = sequence_logps(policy) - sequence_logps(reference)
        z0 = (sequence_logps(policy, "KL_") - sequence_logps(reference, "KL_")).mean().clamp(min=0)
    desirable = torch.as_tensor(batch["label"], dtype=torch.bool)
    assert 0 < int(desirable.sum()) < 8  # both kinds in the batch
    losses = torch.cat([1.5 * (1 - torch.sigmoid(0.3 * (log_ratio[desirable] - z0))),
                        0.7 * (1 - torch.sigmoid(0.3 * (z0 - log_ratio[~desirable])))])
    assert trl_loss == pytest.approx(losses.mean().item(), rel=1e-4)
    assert z0 > 0  # the reference point is not trivially zero: the policy moved


def test_center_rewards_coefficient_adds_the_centring_penalty(tiny_checkpoint, home):
    """``center_rewards_coefficient`` reaches TRL's loss as Eisenstein et al.'s auxiliary term: on a batch,
    -log sigmoid(r_c - r_r) + coefficient * mean((r_c + r_r)^2), by hand from the scorer's own scores."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from trl import RewardTrainer

    from stages import reward_model
    from stages.data.preferences import trl_dataset

    data = preference_file(home, n=16, near_miss_rate=0.0, malformed_rate=1.0)
    torch.manual_seed(0)  # the score head
    model, _ = reward_model.load_sequence_scorer(tiny_checkpoint, False)
    with torch.no_grad():
        model.score.weight.mul_(50.0)  # scores far from 0, so the penalty weighs
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokenizer.padding_side = "right"
    config = reward_model.RewardModelStageConfig(kind="reward_model", data="prefs", batch_size=8,
                                                 center_rewards_coefficient=0.3)
    args = reward_model.training_arguments(config, SimpleNamespace(resume_dir=home / "rm"), 0, evaluate=False)
    trainer = RewardTrainer(model=model, args=args, train_dataset=trl_dataset(read_materialized(data)),
                            processing_class=tokenizer)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model.eval()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, dict(batch)).item()
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    chosen, rejected = scores.chunk(2)
    bradley_terry = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    penalty = ((chosen + rejected) ** 2).mean()
    assert trl_loss == pytest.approx((bradley_terry + 0.3 * penalty).item(), rel=1e-5)
    assert 0.3 * penalty.item() > 0.1 * bradley_terry.item()  # the term is there, not lost in rounding


def test_heldout_pairwise_accuracy_is_pooled_over_pairs_not_batches(tiny_checkpoint, ctx_factory, home):
    """65 held-out pairs are scored in batches of 64 + 1 at batch_size 8 and in one batch at 80:
    the untrained model's held-out accuracy cannot depend on that (a mean of per-batch means
    gives the lone 65th pair half the weight)."""
    data = preference_file(home, n=130)
    accuracies = [train_reward_model(tiny_checkpoint, ctx_factory(f"rm-pool-{batch}"), data, max_steps=1,
                                     batch_size=batch, heldout_fraction=0.5)[1]["metrics"]
                  ["initial_heldout_pairwise_accuracy"] for batch in (8, 80)]
    assert accuracies[0] == pytest.approx(accuracies[1], abs=1e-6)  # float32 means
    assert accuracies[0] * 65 == pytest.approx(round(accuracies[0] * 65), abs=1e-6)  # a share of 65 pairs


def test_dpo_heldout_pairwise_accuracy_is_pooled_over_pairs_not_batches(tiny_checkpoint, ctx_factory, home,
                                                                        tmp_path):
    """As for the reward model: DPO's held-out accuracy against another reference, at a learning rate
    too small to change it, is the same whether 65 pairs come in batches of 64 + 1 or in one."""
    from stages import dpo
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint

    other = resolve_base_checkpoint(TinyModelSpec(init="tiny", hidden_size=32, num_layers=1, num_heads=2,
                                                  intermediate_size=64), 1, tmp_path, tmp_path)
    data = preference_file(home, n=130)
    accuracies = []
    for batch in (8, 80):
        config = dpo.DPOStageConfig(kind="dpo", model="base", data="prefs", max_steps=1, batch_size=batch, lr=1e-9,
                                    heldout_fraction=0.5)
        outputs = dpo.run(config, StageInputs(model=tiny_checkpoint, reference=other, datasets={"data": data}),
                          ctx_factory(f"dpo-pool-{batch}"))
        accuracies.append(outputs["metrics"]["heldout_pairwise_accuracy"])
    assert accuracies[0] == pytest.approx(accuracies[1], abs=1e-6)  # float32 means
    assert accuracies[0] * 65 == pytest.approx(round(accuracies[0] * 65), abs=1e-6)
