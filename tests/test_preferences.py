"""Preference data, the preference-learning maths against hand computations, and the spec's
checks for reward models, DPO and best-of-N (no model is trained here)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli, write

from stages.data.sources import ArithmeticPreferenceData, DataError, FileData, load_records
from stages.preference_math import (
    RunningMeanStd,
    best_of_n,
    best_of_n_accuracy,
    bradley_terry_loss,
    dpo_loss,
    pairwise_accuracy,
    pearson,
)
from stages.rewards.builtin_rewards import exact_answer

# ---------------------------------------------------------------- maths


def test_bradley_terry_loss_matches_a_hand_computation():
    chosen, rejected = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([1.0, 1.5, -1.0])
    # deltas 1, -1, 0: -log sigmoid(1) = log(1 + e^-1) = 0.313262, -log sigmoid(-1) = 1.313262,
    # -log sigmoid(0) = log 2 = 0.693147; mean 0.773224
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(0.7732235185, abs=1e-6)
    # a margin of 0.5 shifts every delta down: 0.5, -1.5, -0.5 -> mean 1.049856
    assert bradley_terry_loss(chosen, rejected, torch.full((3,), 0.5)).item() == pytest.approx(1.0498557488, abs=1e-6)
    assert pairwise_accuracy(chosen, rejected) == pytest.approx(1 / 3)  # the tie counts as wrong


def test_dpo_loss_matches_a_hand_computation_on_fixed_logprobs():
    policy_chosen, policy_rejected = torch.tensor([-5.0, -3.0]), torch.tensor([-6.0, -2.0])
    reference_chosen, reference_rejected = torch.tensor([-5.5, -3.0]), torch.tensor([-5.0, -2.5])
    loss, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=0.1)
    # implicit rewards 0.1 * log-ratio: chosen (0.05, 0), rejected (-0.1, 0.05); margins 0.15, -0.05
    assert chosen.tolist() == pytest.approx([0.05, 0.0])
    assert rejected.tolist() == pytest.approx([-0.1, 0.05])
    # -log sigmoid(0.15) = 0.620957, -log sigmoid(-0.05) = 0.718460; mean 0.669708
    assert loss.item() == pytest.approx(0.6697083479, abs=1e-6)
    # policy == reference: every implicit reward is 0 and the loss is log 2
    same, _, _ = dpo_loss(policy_chosen, policy_rejected, policy_chosen, policy_rejected, beta=0.5)
    assert same.item() == pytest.approx(math.log(2))


def test_best_of_n_picks_the_argmax_and_the_first_on_ties():
    scores = [[0.1, 0.9, 0.3], [2.0, 2.0, 1.0], [-1.0, -3.0, -0.5]]
    assert best_of_n(scores) == [1, 0, 2]
    correct = [[False, True, False], [False, True, True], [True, False, False]]
    assert best_of_n_accuracy(scores, correct) == pytest.approx(1 / 3)
    # a scorer that agrees with the verifier picks a correct attempt wherever there is one
    oracle = [[float(c) for c in row] for row in correct]
    assert best_of_n_accuracy(oracle, correct) == 1.0


def test_running_normalisation_and_correlation_by_hand():
    stats = RunningMeanStd()
    assert stats.normalise([1.0, 3.0]) == pytest.approx([-1.0, 1.0])  # mean 2, std 1
    stats.update([5.0, 7.0])  # all four: mean 4, population std sqrt(5)
    assert (stats.mean, stats.std) == pytest.approx((4.0, math.sqrt(5.0)))
    assert pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert pearson([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == pytest.approx(-0.5)
    assert pearson([1.0, 2.0], [1.0, 1.0]) is None  # no variance: undefined, not 0


def test_group_normalisation_centres_scores_per_prompt():
    from stages.reward_model import centre_per_prompt

    a, b = [{"role": "user", "content": "What is 1+1?"}], [{"role": "user", "content": "What is 2+2?"}]
    # prompt a: 1, 3, 5 (mean 3); prompt b: 10, 20 (mean 15)
    assert centre_per_prompt([1.0, 3.0, 10.0, 20.0, 5.0], [a, a, b, b, a]) == [-2.0, 0.0, -5.0, 5.0, 2.0]


# ---------------------------------------------------------------- data


def test_arithmetic_preferences_are_labelled_by_the_verifier():
    records = load_records(ArithmeticPreferenceData(generator="arithmetic_preferences", n=300, seed=3, role="train"),
                           None)
    assert len(records) == 300
    chosen = [r["chosen"][0]["content"] for r in records]
    rejected = [r["rejected"][0]["content"] for r in records]
    answers = [r["answer"] for r in records]
    assert exact_answer(chosen, answers).scores == [1.0] * 300
    verdict = exact_answer(rejected, answers)
    assert verdict.scores == [0.0] * 300
    near = sum(p and abs(int(t) - int(a)) <= 2 for t, a, p in zip(rejected, answers, verdict.parsed))
    far = sum(p and abs(int(t) - int(a)) > 2 for t, a, p in zip(rejected, answers, verdict.parsed))
    malformed = verdict.parsed.count(False)
    assert 0.5 < near / 300 < 0.7 and 0.1 < far / 300 < 0.3 and 0.1 < malformed / 300 < 0.3
    assert all(r["prompt"][0]["role"] == "user" and r["chosen"][0]["role"] == "assistant" for r in records)


def test_preference_file_plain_and_conversational_records(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_text(
        json.dumps({"prompt": "What is 3+4?", "chosen": "7", "rejected": "8"}) + "\n\n"
        + json.dumps({"prompt": [{"role": "user", "content": "What is 1+1?"}],
                      "chosen": [{"role": "assistant", "content": "2"}],
                      "rejected": [{"role": "assistant", "content": "two"}], "answer": 2}) + "\n")
    records = load_records(FileData(path=str(path), role="train", records="preferences"), tmp_path)
    assert records[0] == {"prompt": [{"role": "user", "content": "What is 3+4?"}],
                          "chosen": [{"role": "assistant", "content": "7"}],
                          "rejected": [{"role": "assistant", "content": "8"}], "answer": None}
    assert records[1]["rejected"] == [{"role": "assistant", "content": "two"}] and records[1]["answer"] == "2"


@pytest.mark.parametrize("line, message", [
    ({"prompt": "What is 3+4?", "chosen": "7"}, "missing field `rejected`"),
    ({"chosen": "7", "rejected": "8"}, "missing field `prompt`"),
    ({"prompt": "What is 3+4?", "chosen": "  ", "rejected": "8"}, "`chosen` is empty"),
    ({"prompt": "What is 3+4?", "chosen": "7", "rejected": []}, "`rejected` is empty"),
    ({"prompt": "What is 3+4?", "chosen": "7", "rejected": [{"role": "assistant", "content": ""}]},
     "`rejected` is empty"),
    ({"prompt": "What is 3+4?", "chosen": "7", "rejected": "7"}, "identical"),
    ({"prompt": "What is 3+4?", "chosen": 7, "rejected": "8"}, "`chosen` must be a string or a list"),
])
def test_a_bad_preference_record_is_refused_with_its_line(tmp_path, line, message):
    path = tmp_path / "prefs.jsonl"
    good = json.dumps({"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"})
    path.write_text(f"{good}\n{good}\n{json.dumps(line)}\n{good}\n")
    with pytest.raises(DataError) as error:
        load_records(FileData(path=str(path), role="train", records="preferences"), tmp_path)
    assert f"{path}:3: " in str(error.value) and message in str(error.value)


# ---------------------------------------------------------------- the spec

PIPELINE = """
name: prefs
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {generator: arithmetic, n: 50, role: train}
  prefs: {generator: arithmetic_preferences, n: 50, role: train}
  heldout: {generator: arithmetic, n: 10, seed: 9, role: heldout}
rewards:
  rm_score: {fn: reward_model, stage: rm, normalize: running}
  verifier: {fn: exact_answer, weight: 0}
stages:
  sft: {kind: sft, data: train, max_steps: 2}
  rm: {kind: reward_model, model: sft, data: prefs, max_steps: 2}
  ppo: {kind: rl, algorithm: ppo, policy: sft, data: train, rewards: [rm_score, verifier], critic: rm, max_steps: 1}
  dpo: {kind: dpo, model: sft, data: prefs, max_steps: 2}
  eval_ppo: {kind: eval, model: ppo, data: heldout, rewards: [verifier], select: reward_model, reward_model: rm}
"""


def test_a_reward_models_stage_is_an_edge_of_the_graph_and_the_fingerprint(tmp_path):
    from flows.planning.graph import upstream_of
    from flows.planning.lineage import fingerprint
    from flows.spec.loading import load_pipeline

    loaded = load_pipeline(write(tmp_path / "p.yaml", PIPELINE))
    edges = upstream_of(loaded.spec)
    assert set(edges["ppo"]) == {"sft", "rm"} and set(edges["eval_ppo"]) == {"ppo", "rm"}
    assert edges["dpo"] == ["sft"]
    runs = {"sft": "run-sft", "rm": "run-rm-1", "ppo": "run-ppo"}
    first = fingerprint(loaded, "ppo", runs)
    assert fingerprint(loaded, "ppo", {**runs, "rm": "run-rm-2"}) != first  # a retrained RM makes PPO stale
    assert fingerprint(loaded, "eval_ppo", runs) != fingerprint(loaded, "eval_ppo", {**runs, "rm": "run-rm-2"})


@pytest.mark.parametrize("edit, where, message", [
    (("rm_score: {fn: reward_model, stage: rm, normalize: running}", "rm_score: {fn: reward_model, stage: rmm}"),
     "rewards.rm_score.stage", "unknown stage 'rmm' (did you mean 'rm'?)"),
    (("rm_score: {fn: reward_model, stage: rm, normalize: running}", "rm_score: {fn: reward_model, stage: sft}"),
     "rewards.rm_score.stage", "stage 'sft' is kind sft; a reward_model reward scores with a reward_model stage"),
    (("select: reward_model, reward_model: rm", "select: reward_model, reward_model: dpo"),
     "stages.eval_ppo.reward_model", "stage 'dpo' is kind dpo; reward_model needs a reward_model stage"),
    (("critic: rm", "critic: sft"), "stages.ppo.critic", "critic needs a reward_model stage"),
    (("dpo: {kind: dpo, model: sft", "dpo: {kind: dpo, model: rm"),
     "stages.dpo.model", "stage 'rm' is a reward model (a scorer, not a policy)"),
    (("dpo: {kind: dpo, model: sft, data: prefs", "dpo: {kind: dpo, model: sft, data: train"),
     "stages.dpo.data", "stage kind dpo reads preference pairs"),
    (("sft: {kind: sft, data: train", "sft: {kind: sft, data: prefs"),
     "stages.sft.data", "stage kind sft reads conversations, not preference pairs"),
    (("verifier: {fn: exact_answer, weight: 0}", "verifier: {fn: exact_answer, stage: rm}"),
     "rewards.verifier.stage", "this field applies only when fn is reward_model or fn is judge (here fn is "
     "exact_answer)"),
])
def test_the_spec_refuses_misused_reward_models_and_preference_data(tmp_path, edit, where, message):
    from flows.spec.loading import SpecError, load_pipeline

    assert PIPELINE.count(edit[0]) == 1
    with pytest.raises(SpecError) as error:
        load_pipeline(write(tmp_path / "p.yaml", PIPELINE.replace(*edit)))
    issues = [(i.path, i.message) for i in error.value.issues]
    assert any(path == where and message in text for path, text in issues), issues


def test_validate_exits_2_naming_the_preference_files_bad_line(home, tmp_path, capsys):
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps({"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"}) + "\n"
                     + json.dumps({"prompt": "What is 1+2?", "chosen": "", "rejected": "4"}) + "\n")
    pipeline = PIPELINE.replace("prefs: {generator: arithmetic_preferences, n: 50, role: train}",
                                "prefs: {path: prefs.jsonl, records: preferences, role: train}")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", pipeline))) == 2
    err = capsys.readouterr().err
    assert "data.prefs.path" in err and f"{prefs}:2: `chosen` is empty" in err
