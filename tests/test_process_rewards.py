"""Process rewards: chain_steps checks each step by arithmetic, check-reward catches a right answer reached
through a wrong step, PPO places each step's score on that step's last token and GAE carries it back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli
from stages.data.sources import ArithmeticData, generate_arithmetic
from stages.rewards.known_cases import RewardCase, check_reward_cases
from stages.rewards.scoring import ComponentScores, ScoredBatch
from stages.rewards.spec import RewardSpec
from stages.rewards.steps import StepScore, chain_steps, chain_terms, process_metrics, split_steps
from stages.rl_math import gae

PROMPT = [{"role": "user", "content": "Compute 12+5+8-3 step by step."}]


def test_split_rules_give_the_spans_of_the_steps():
    text = " 1+2=3 ,3+4=7,, 7-1=6 "
    assert [text[a:b] for a, b in split_steps(text)] == ["1+2=3", "3+4=7", "7-1=6"]
    piped = "1+2=3 | 3+4=7"
    assert [piped[a:b] for a, b in split_steps(piped, "delimiter", " | ")] == ["1+2=3", "3+4=7"]
    lines = "1+2=3\n\n 3+4=7 \n"
    assert [lines[a:b] for a, b in split_steps(lines, "lines")] == ["1+2=3", "3+4=7"]
    tagged = "think <step>1+2=3</step> then <step> 3+4=7 </step> done"
    assert [tagged[a:b] for a, b in split_steps(tagged, "tags")] == ["1+2=3", "3+4=7"]


@pytest.mark.parametrize("completion, steps, score", [
    ("12+5=17, 17+8=25, 25-3=22", [1, 1, 1], 1.0),       # every step right
    ("12+5=17, 17+8=26, 26-3=23", [1, 0, 1], 2 / 3),     # a slip carried on consistently: only the slip is wrong
    ("12+5=17, 17+8=26, 26-3=22", [1, 0, 0], 1 / 3),     # the right answer through two wrong steps
    ("12+5=17, 17+8=26, 25-3=22", [1, 0, 0], 1 / 3),     # a step that does not continue the chain
    ("12+5=17, 17+9=26, 26-3=23", [1, 0, 1], 2 / 3),     # the wrong operand
    ("12+5=17, 17+8=25", [1, 1], 2 / 3),                 # a step missing
    ("12+5=17, 17+8=25, 25-3=22, 22+0=22", [1, 1, 1, 0], 3 / 4),  # a step too many
    ("twenty-two", [0], 0.0),
])
def test_chain_steps_checks_each_step_by_arithmetic(completion, steps, score):
    output = chain_steps([completion], [PROMPT])
    assert [s.score for s in output.steps[0]] == steps
    assert output.scores[0] == pytest.approx(score)
    assert output.parsed[0] == (completion != "twenty-two")
    assert all(completion[s.start:s.end].strip() == completion[s.start:s.end] for s in output.steps[0])


def test_chain_terms_read_the_chain_from_the_prompt():
    assert chain_terms("Compute 12+5+8-3 step by step (a+b=c).") == [("", 12), ("+", 5), ("+", 8), ("-", 3)]
    assert chain_terms("What is -4 * 2 - 1?") == [("", -4), ("*", 2), ("-", 1)]
    assert chain_terms("no chain here") is None


def test_the_chain_generator_demonstrates_running_results_and_its_slips():
    records = generate_arithmetic(ArithmeticData(generator="arithmetic_chain", role="train", n=3000, terms=4,
                                                 ops=["+", "-"], demo_error_rate=0.4))
    demos = [r["messages"][1]["content"] for r in records]
    checked = chain_steps(demos, [r["messages"][:1] for r in records])
    sound = [score == 1.0 for score in checked.scores]
    right = [demo.rsplit("=", 1)[1] == r["answer"] for demo, r in zip(demos, records)]
    assert 0.57 < sum(sound) / len(records) < 0.63  # 40% of the demonstrations write one step wrong
    # half of those carry on from the right value: a right answer reached through a wrong step
    assert 0.11 < sum(r and not s for r, s in zip(right, sound)) / len(records) < 0.16
    assert all(r for r, s in zip(right, sound) if s)  # every sound chain ends at the answer


def test_step_checks_catch_a_right_answer_reached_through_a_wrong_step():
    """The outcome reward pays the shortcut in full; its step scores give it away."""
    shortcut = "12+5=17, 17+8=26, 26-3=22"
    outcome = check_reward_cases("correct", RewardSpec(fn="exact_answer", kwargs={"extract": "last_number"}),
                                 [RewardCase(case="shortcut", completion=shortcut, answer="22", max=0.0)])
    assert outcome[0].score == 1.0 and outcome[0].violations == ["score 1 > max 0"]

    cases = [RewardCase(case="shortcut", completion=shortcut, prompt=PROMPT[0]["content"], steps=[1, 0, 0]),
             RewardCase(case="success", completion=shortcut, prompt=PROMPT[0]["content"], steps=[1, 1, 1])]
    results = check_reward_cases("steps", RewardSpec(fn="chain_steps"), cases)
    assert results[0].violations == [] and results[0].steps == [1.0, 0.0, 0.0]
    assert results[1].violations == ["step scores [1.0, 0.0, 0.0], expected [1.0, 1.0, 1.0]"]
    # a reward that scores no steps cannot meet a case that expects step scores
    plain = check_reward_cases("correct", RewardSpec(fn="exact_answer"), [RewardCase(
        case="success", completion="22", answer="22", steps=[1])])
    assert plain[0].violations == ["the reward scores no steps (not a process reward), but the case expects step "
                                   "scores"]


def test_check_reward_command_shows_and_checks_step_scores(home, tmp_path, capsys):
    pipeline = ROOT / "pipelines" / "process.yaml"
    assert run_cli("check-reward", str(pipeline)) == 0
    out = capsys.readouterr().out
    assert "7 cases, 0 violations" in out and "steps [0, 0]" in out
    # a check that expected every step of the shortcut right is a violation the command reports
    text = pipeline.read_text()
    assert text.count("max: 0.0, steps: [0, 0]}") == 1
    lenient = tmp_path / "process.yaml"
    lenient.write_text(text.replace("max: 0.0, steps: [0, 0]}", "steps: [1, 1]}"))
    assert run_cli("check-reward", str(lenient)) == 1
    out = capsys.readouterr().out
    assert "7 cases, 1 violation" in out and "VIOLATION: step scores" in out


def test_step_scores_land_on_each_steps_last_token(tiny_checkpoint):
    """A hand-built rollout: the step ending at character 7 of "12+5=17, 17+8=26, 26-3=22" is scored on the
    token that completes "12+5=17", and so on; the outcome (minus the process share) at the last token."""
    from stages.models.loading import load_model_and_tokenizer
    from stages.ppo import build_rollout, placed_scores
    from stages.engines.interface import Sample

    _, tokenizer = load_model_and_tokenizer(tiny_checkpoint)
    texts = ["12+5=17, 17+8=26, 26-3=22", "12+5=17"]
    samples = [Sample(text=t, token_ids=tokenizer(t, add_special_tokens=False)["input_ids"], logprobs=[], truncated=False)
               for t in texts]
    for sample in samples:
        sample.logprobs = [0.0] * len(sample.token_ids)
    rollout = build_rollout([[1, 2], [1, 2]], [[samples[0]], [samples[1]]], tokenizer.pad_token_id)
    steps = chain_steps(texts, [PROMPT, PROMPT])
    components = [ComponentScores("correct", 1.0, [1.0, 0.0], [True, True]),
                  ComponentScores("steps", 2.0, steps.scores, steps.parsed, steps=steps.steps)]
    scored = ScoredBatch(components, [1.0 + 2.0 * steps.scores[0], 2.0 * steps.scores[1]])

    placed = placed_scores(rollout, scored, tokenizer, process_weight=0.75, step_credit="sum")
    for row, text in enumerate(texts):
        ids = samples[row].token_ids
        ends = {len(tokenizer.decode(ids[:i + 1])): i for i in range(len(ids))}
        expected = torch.zeros(rollout.mask_B_T.shape[1])
        for step in steps.steps[row]:
            expected[ends[step.end]] += 0.75 * 2.0 * step.score
        outcome = scored.total[row] - 0.75 * 2.0 * steps.scores[row]
        expected[len(ids) - 1] += outcome
        assert torch.allclose(placed[row], expected), (row, placed[row], expected)
        assert tokenizer.decode(ids[:ends[steps.steps[row][0].end] + 1]) == "12+5=17"
    # summed over the tokens: the outcome share plus each step's own score (not the steps' mean)
    dense = [scored.total[row] + 0.75 * 2.0 * (sum(s.score for s in steps.steps[row]) - steps.scores[row])
             for row in range(2)]
    assert torch.allclose(placed.sum(-1), torch.tensor(dense))
    # step_credit min: the completion earns its worst step's score from the process share, wherever it falls
    worst = [scored.total[row] + 0.75 * 2.0 * (min(s.score for s in steps.steps[row]) - steps.scores[row])
             for row in range(2)]
    assert torch.allclose(placed_scores(rollout, scored, tokenizer, 0.75, "min").sum(-1), torch.tensor(worst))
    # process_weight 0 and no process reward: everything at the last token
    assert torch.allclose(placed_scores(rollout, scored, tokenizer, 0.0).sum(-1), torch.tensor(scored.total))


@pytest.mark.parametrize("rule, credits", [
    ("sum", [1.0, 0.0, 1.0]), ("mean", [1 / 3, 0.0, 1 / 3]), ("min", [1.0, -1.0, 0.0]), ("centred", [0.4, -0.6, 0.4])])
def test_step_credit_rules_by_hand(rule, credits):
    """Steps scored right, wrong, right (the batch's mean step score 0.6 for centred)."""
    from stages.ppo import step_credits

    assert step_credits([1.0, 0.0, 1.0], rule, centre=0.6) == pytest.approx(credits)


@pytest.mark.parametrize("rule, paid_two, paid_four", [
    ("sum", 1.8, 3.6), ("mean", 0.9, 0.9), ("min", 0.9, 0.9), ("centred", 0.0, 0.0)])
def test_only_sum_pays_a_scorer_that_likes_every_step_for_more_steps(rule, paid_two, paid_four):
    """A learned scorer that gives every step 0.9: summed, four steps earn twice what two do; the other rules
    pay a completion the same however many steps it writes (centred: the batch's mean step score is 0.9)."""
    from stages.ppo import step_credits

    assert sum(step_credits([0.9] * 2, rule, centre=0.9)) == pytest.approx(paid_two)
    assert sum(step_credits([0.9] * 4, rule, centre=0.9)) == pytest.approx(paid_four)
    # min: a wrong step takes away what the right ones before it earned, a later right one gives nothing back
    assert sum(step_credits([0.9, 0.1, 0.9], "min")) == pytest.approx(0.1)


def test_gae_over_dense_rewards_equals_a_reference_computation():
    """Step scores placed mid-sequence: GAE by the textbook recursion, written out for each row by hand."""
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.2, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.1, 0.4, 9.0], [0.5, -0.1, 0.2, 0.3, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float)
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    for row in range(2):
        n = int(mask[row].sum())
        r, v = rewards[row, :n].tolist(), values[row, :n].tolist() + [0.0]
        expected, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            delta = r[t] + gamma * v[t + 1] - v[t]
            running = delta + gamma * lam * running
            expected[t] = running
        assert advantages[row, :n].tolist() == pytest.approx(expected, abs=1e-6)
        assert returns[row, :n].tolist() == pytest.approx([a + b for a, b in zip(expected, v)], abs=1e-6)
        assert advantages[row, n:].abs().sum() == 0
    # an early step's score reaches the tokens before it, discounted by gamma * lam per token
    only_step = torch.zeros(1, 4)
    only_step[0, 1] = 1.0
    advantages, _ = gae(only_step, torch.zeros(1, 4), torch.ones(1, 4), gamma, lam)
    assert advantages[0].tolist() == pytest.approx([gamma * lam, 1.0, 0.0, 0.0])


def test_process_metrics_count_right_answers_reached_through_a_wrong_step():
    completions = ["12+5=17, 17+8=25, 25-3=22", "12+5=17, 17+8=26, 26-3=22", "22", "12+5=17, 17+8=25, 25-3=21"]
    steps = chain_steps(completions, [PROMPT] * 4)
    component = ComponentScores("steps", 1.0, steps.scores, steps.parsed, steps=steps.steps)
    metrics = process_metrics([component], correct=[True, True, True, False])
    assert metrics["steps/steps/all_right_rate"] == 0.25
    assert metrics["steps/steps/correct_with_wrong_step_frac"] == pytest.approx(2 / 3)  # a wrong step, no steps


def test_process_weight_is_ppos_and_refused_where_it_cannot_apply():
    from stages.rl_common import rl_stage_config

    common = dict(kind="rl", policy="base", data="train", rewards=["steps"])
    assert rl_stage_config(algorithm="ppo", process_weight=0.5, **common).process_weight == 0.5
    with pytest.raises(ValueError, match="process_weight only applies to algorithm ppo, not grpo .dense credit "
                                         "needs a critic"):
        rl_stage_config(algorithm="grpo", process_weight=0.5, **common)
    from flows.spec.validate import not_applicable

    assert rl_stage_config(algorithm="ppo", process_weight=0.5, **common).step_credit == "min"
    [(where, message)] = not_applicable(rl_stage_config(algorithm="ppo", step_credit="mean", **common))
    assert where == ("step_credit",) and "applies only when process_weight is not 0" in message
    with pytest.raises(ValueError, match="step_credit"):
        rl_stage_config(algorithm="ppo", process_weight=0.5, step_credit="product", **common)
    with pytest.raises(ValueError, match="step_credit only applies to algorithm ppo"):
        rl_stage_config(algorithm="grpo", step_credit="min", **common)
    [(where, message)] = not_applicable(rl_stage_config(algorithm="ppo", process_weight=0.5,
                                                        environment={"fn": "calculator"}, **common))
    assert where == ("process_weight",) and "with `environment` the reward scores an episode's final answer" in message
    [(where, message)] = not_applicable(ArithmeticData(generator="arithmetic", role="train", n=4, terms=3))
    assert where == ("terms",) and "applies only when generator is arithmetic_chain" in message
    assert not_applicable(ArithmeticData(generator="arithmetic_chain", role="train", n=4, terms=3)) == []


def test_ppo_with_process_rewards_trains_and_refuses_rewards_without_steps(tiny_checkpoint, ctx_factory, home):
    from stages.context import StageInputs
    from stages.data.sources import materialize
    from stages.ppo import train_ppo
    from stages.rl_common import rl_stage_config

    data = materialize(ArithmeticData(generator="arithmetic_chain", role="train", n=40, terms=3), Path("."),
                       home / "data")
    rewards = {"correct": RewardSpec(fn="exact_answer", kwargs={"extract": "last_number"}),
               "steps": RewardSpec(fn="chain_steps")}
    fields = dict(kind="rl", algorithm="ppo", policy="base", data="train", prompts_per_step=2, max_steps=2,
                  sampling={"attempts": 2, "max_tokens": 12}, minibatch_size=4, process_weight=1.0)
    outputs = train_ppo(rl_stage_config(rewards=["correct", "steps"], **fields),
                        StageInputs(policy=tiny_checkpoint, datasets={"train": data}, rewards=rewards),
                        ctx_factory("ppo-process"))
    assert outputs["metrics"]["steps"] == 2.0 and "reward/steps/mean" in outputs["metrics"]
    # what the process reward paid under the default step_credit min: each completion its worst step, at most 1
    assert 0.0 <= outputs["metrics"]["reward/steps/credited"] <= 1.0
    with pytest.raises(RuntimeError, match="none of the stage's rewards .correct. scored steps"):
        train_ppo(rl_stage_config(rewards=["correct"], **fields),
                  StageInputs(policy=tiny_checkpoint, datasets={"train": data}, rewards={"correct": rewards["correct"]}),
                  ctx_factory("ppo-no-steps"))


def flagged_steps(completions, **_):
    """A process reward for the tests: a step of two letters is wrong when they are the same ("bb"), right when
    they differ ("ab"): the label at a step's last letter depends on the letter before it."""
    from stages.rewards.spec import RewardOutput

    steps = [[StepScore(a, b, 0.0 if len(set(text[a:b])) == 1 else 1.0) for a, b in split_steps(text)]
             for text in completions]
    return RewardOutput([sum(s.score for s in st) / len(st) if st else 0.0 for st in steps],
                        [bool(st) for st in steps], steps=steps)


def flagged_file(path: Path, rated: bool) -> Path:
    """240 demonstrations of three two-letter steps, a third of the steps wrong (one letter twice): as
    conversations (labelled by ``flagged_steps``) or as a step-rated file in PRM800K's shape."""
    import json
    import random

    rng = random.Random(0)
    with open(path, "w") as handle:
        for _ in range(240):
            steps = [rng.choice("abc") + rng.choice("abc") for _ in range(3)]
            if rated:
                record = {"prompt": "Write three steps.", "steps": steps,
                          "ratings": [-1 if len(set(step)) == 1 else 1 for step in steps]}
            else:
                record = {"messages": [{"role": "user", "content": "Write three steps."},
                                       {"role": "assistant", "content": ", ".join(steps)}]}
            handle.write(json.dumps(record) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("labelled_by", ["a process reward", "a step-rated file"])
def test_a_step_reward_model_learns_step_labels_and_scores_steps_as_a_reward(labelled_by, tiny_checkpoint,
                                                                             ctx_factory, home):
    """level: step on tiny data: steps labelled by a process reward (here: a step of one letter twice is wrong)
    or rated in a file of PRM800K's shape; the held-out step accuracy climbs well past always answering "right",
    the first wrong step is found, and the trained model scores each step of a completion as a reward."""
    from stages import reward_model
    from stages.context import StageInputs
    from stages.data.specs import FileData
    from stages.data.sources import materialize
    from stages.rewards.reward_model import StepRewardModel, is_step_scorer

    rated = labelled_by == "a step-rated file"
    path = flagged_file(home.parent / "flagged.jsonl", rated)
    data = materialize(FileData(path=str(path), role="train", records="steps" if rated else "conversations"),
                       Path("."), home / "data")
    rewards = {} if rated else {"flags": RewardSpec(fn="test_process_rewards:flagged_steps")}
    config = reward_model.RewardModelStageConfig(kind="reward_model", level="step", labels=None if rated else "flags",
                                                 step_head="token", data="train", max_steps=300, batch_size=16,
                                                 lr=3e-3, logging_steps=50, heldout_fraction=0.2)
    from flows.spec.validate import not_applicable

    [(where, message)] = not_applicable(reward_model.RewardModelStageConfig(kind="reward_model", labels="flags",
                                                                            data="train"))
    assert where == ("labels",) and "applies only when level is step (here level is pair)" in message
    outputs = reward_model.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": data}, rewards=rewards),
                               ctx_factory("prm"))
    metrics = outputs["metrics"]
    assert metrics["heldout_steps"] == 48 * 3
    assert metrics["heldout_right_step_share"] < 0.8
    assert metrics["heldout_step_accuracy"] > 0.95 > metrics["initial_heldout_step_accuracy"]
    assert metrics["heldout_first_wrong_step_detection"] > 0.9
    assert metrics["heldout_majority_accuracy"] == pytest.approx(max(metrics["heldout_right_step_share"],
                                                                     1 - metrics["heldout_right_step_share"]))
    assert metrics["heldout_wrong_step_recall"] > 0.9 and metrics["heldout_wrong_step_precision"] > 0.9

    checkpoint = Path(outputs["checkpoint"])
    assert is_step_scorer(checkpoint)
    split = {"split": "lines"} if rated else {}
    scorer = StepRewardModel(checkpoint, RewardSpec(fn="reward_model", stage="prm", kwargs=split))
    prompt = [{"role": "user", "content": "Write three steps."}]
    joiner = "\n" if rated else ", "
    scored = scorer([joiner.join(["ab", "cc", "ba"]), joiner.join(["ab", "ca", "bb"]), ""], [prompt] * 3)
    assert [[round(s.score) for s in steps] for steps in scored.steps] == [[1, 0, 1], [1, 1, 0], []]
    assert scored.scores[0] == pytest.approx(sum(s.score for s in scored.steps[0]) / 3)
    assert scored.parsed == [True, True, False] and scored.scores[2] == 0.0


@pytest.mark.slow
def test_the_surprise_head_beats_always_right_where_the_token_classifier_does_not(ctx_factory, home,
                                                                                   tmp_path_factory):
    """process.yaml in small: a tiny model SFT'd on chains of sums from a demonstrator that slips, then a PRM on
    the chains' steps labelled by chain_steps. The surprise head (the SFT model's log-probabilities of a step's
    tokens) beats always answering "right" on held-out steps by a wide margin, catches most wrong steps, and
    scores a completion's steps as a reward; the token classifier (the old head), trained from the same model,
    stays near the baseline."""
    from stages import reward_model, sft
    from stages.context import StageInputs
    from stages.data.sources import materialize
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint
    from stages.rewards.reward_model import StepRewardModel, is_step_scorer
    from stages.sft import SFTStageConfig

    cache = tmp_path_factory.mktemp("prm-models")
    base = resolve_base_checkpoint(TinyModelSpec(init="tiny", hidden_size=64, num_layers=2, num_heads=2,
                                                 intermediate_size=128), 0, cache, cache)
    data = materialize(ArithmeticData(generator="arithmetic_chain", role="train", n=1000, terms=3, max_operand=3,
                                      demo_error_rate=0.35), Path("."), home / "data")
    tuned = sft.run(SFTStageConfig(kind="sft", data="train", max_steps=300, batch_size=32, lr=5e-3),
                    StageInputs(model=base, datasets={"data": data}), ctx_factory("sft"))["checkpoint"]
    inputs = StageInputs(model=tuned, datasets={"data": data}, rewards={"steps": RewardSpec(fn="chain_steps")})
    fields = dict(kind="reward_model", level="step", labels="steps", data="train", heldout_fraction=0.2)
    surprise = reward_model.run(reward_model.RewardModelStageConfig(max_steps=300, batch_size=256, lr=1e-2, **fields),
                                inputs, ctx_factory("prm-surprise"))
    token = reward_model.run(reward_model.RewardModelStageConfig(step_head="token", max_steps=150, batch_size=32,
                                                                 lr=1e-3, **fields), inputs, ctx_factory("prm-token"))

    learnt, old = surprise["metrics"], token["metrics"]
    baseline = learnt["heldout_majority_accuracy"]
    assert old["heldout_majority_accuracy"] == baseline and 0.7 < baseline < 0.9
    assert learnt["heldout_step_accuracy"] > baseline + 0.08
    assert learnt["heldout_wrong_step_recall"] > 0.6 and learnt["heldout_wrong_step_precision"] > 0.7
    assert old["heldout_step_accuracy"] < baseline + 0.04  # the old head, same model and labels: near the baseline

    checkpoint = Path(surprise["checkpoint"])
    assert is_step_scorer(checkpoint)
    scorer = StepRewardModel(checkpoint, RewardSpec(fn="reward_model", stage="prm"))
    prompt = [{"role": "user", "content": "Compute 2+3+1 step by step, writing each running result (a+b=c), "
                                          "separated by commas."}]
    scored = scorer(["2+3=5, 5+1=6", "2+3=6, 6+1=7", "2+3=5, 5+1=7"], [prompt] * 3)
    assert [[round(s.score) for s in steps] for steps in scored.steps] == [[1, 1], [0, 1], [1, 0]]


def test_balanced_step_classes_weigh_each_class_by_the_inverse_of_its_share():
    """Three right steps and one wrong: balanced weights (wrong 2.0, right 2/3), and the loss is torch's weighted
    mean over the labelled tokens, computed here by hand."""
    import math

    from stages import reward_model
    from stages.process_reward_model import class_weights, weighted_token_loss

    fields = dict(kind="reward_model", level="step", labels="flags", data="train")
    balanced = reward_model.RewardModelStageConfig(step_class_weights="balanced", **fields)
    train = [{"step_labels": [1, 1, 0]}, {"step_labels": [1]}]
    assert class_weights(balanced, train) == pytest.approx([2.0, 2 / 3])
    assert class_weights(reward_model.RewardModelStageConfig(**fields), train) is None
    with pytest.raises(ValueError, match="needs right and wrong steps .* hold 2 right and 0 wrong"):
        class_weights(balanced, [{"step_labels": [1, 1]}])
    from flows.spec.validate import not_applicable

    [(where, message)] = not_applicable(reward_model.RewardModelStageConfig(kind="reward_model", data="train",
                                                                            step_class_weights="balanced"))
    assert where == ("step_class_weights",) and "applies only when level is step (here level is pair)" in message

    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]])  # three tokens, the last not labelled
    labels = torch.tensor([[1, 1, -100]])
    loss = weighted_token_loss([2.0, 0.5])({"logits": logits}, labels)
    p_right = [math.exp(1) / (1 + math.exp(1)), 1 / (1 + math.exp(2))]
    expected = (0.5 * -math.log(p_right[0]) + 0.5 * -math.log(p_right[1])) / (0.5 + 0.5)
    assert float(loss) == pytest.approx(expected)
    labels = torch.tensor([[0, 1, -100]])
    expected = (2.0 * -math.log(1 - p_right[0]) + 0.5 * -math.log(p_right[1])) / 2.5
    assert float(weighted_token_loss([2.0, 0.5])({"logits": logits}, labels)) == pytest.approx(expected)


def test_counterfactual_steps_move_one_result_and_are_relabelled_by_the_verifier(tiny_checkpoint, home, tmp_path):
    """Each copy differs from its demonstration in one step's last number, by 1; chain_steps relabels every step
    of it: the moved step is wrong and so is the one that no longer continues from it, whatever the original."""
    import json

    from transformers import AutoTokenizer

    from stages import reward_model
    from stages.context import StageInputs
    from stages.process_reward_model import counterfactual_records, step_examples

    path = tmp_path / "demos.jsonl"
    demos = ["2+3=5, 5-1=4", "2+3=6, 5-1=4"]  # right; a slip the next step ignores
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Compute 2+3-1"},
                                                     {"role": "assistant", "content": d}]}) + "\n" for d in demos))
    config = reward_model.RewardModelStageConfig(kind="reward_model", level="step", labels="steps", data="train",
                                                 counterfactual_steps=3)
    inputs = StageInputs(model=tiny_checkpoint, datasets={"data": path}, rewards={"steps": RewardSpec(fn="chain_steps")})
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    examples = step_examples(config, inputs, tokenizer)
    assert [e["step_labels"] for e in examples] == [[1, 1], [0, 0]]
    made = counterfactual_records(examples, 3, seed=0)
    assert len(made) == 6
    texts = [r["messages"][-1]["content"] for r in made]
    for text, original in zip(texts, [demos[0]] * 3 + [demos[1]] * 3):
        changed = [(a, b) for a, b in zip(text.split(", "), original.split(", ")) if a != b]
        assert len(changed) == 1 and abs(int(changed[0][0].split("=")[1]) - int(changed[0][1].split("=")[1])) == 1
    relabelled = step_examples(config, inputs, tokenizer, made)
    for text, example in zip(texts, relabelled):
        prompt = [{"role": "user", "content": "Compute 2+3-1"}]
        assert example["step_labels"] == [round(s.score) for s in chain_steps([text], [prompt]).steps[0]]
    # the right demonstration's copies: a moved first result breaks both steps, a moved second one the second only
    assert {tuple(e["step_labels"]) for e in relabelled[:3]} <= {(0, 0), (1, 0)}
    from flows.spec.validate import not_applicable

    [(where, message)] = not_applicable(reward_model.RewardModelStageConfig(kind="reward_model", level="step",
                                                                            data="train", counterfactual_steps=1))
    assert where == ("counterfactual_steps",) and "relabelled by the `labels` reward" in message


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "steps": ["a", "b"], "ratings": [1]}, "`ratings` must hold one of -1, 0, 1 per step (2 steps)"),
    ({"prompt": "p", "steps": ["a", "b\nc"], "ratings": [1, 1]}, "step 1 holds a line break"),
    ({"prompt": "p", "steps": [], "ratings": []}, "`steps` must be a non-empty list"),
    ({"steps": ["a"], "ratings": [1]}, "needs `prompt`"),
])
def test_a_step_rated_file_is_refused_with_the_record_and_what_is_wrong(record, message, home, tmp_path):
    import json

    from stages.data.specs import DataError, FileData
    from stages.data.sources import materialize

    path = tmp_path / "rated.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "steps": ["a"], "ratings": [0]}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"rated.jsonl:2: .*{re.escape(message)}"):
        materialize(FileData(path=str(path), role="train", records="steps"), Path("."), home / "data")
