"""LLM-as-judge (`fn: judge`): replies read onto the declared scale, unreadable replies counted apart
as errors, replies cached, the audit against the exact-answer verifier counted by hand, and the
judge run on its known cases by check-reward. The scripted judges are in tests/judges.py."""

from __future__ import annotations

import json

from dataclasses import replace

import pytest

import judges
from conftest import run_cli, write
from stages.context import StageInputs
from stages.rewards.judge import audit_judges, read_judgement
from stages.scorers import bind_scorers
from stages.rewards.scoring import score_completions
from stages.rewards.spec import RewardSpec

RUBRIC = "Question: {prompt}\nReference: {answer}\nIs the reply correct? Answer yes or no.\nReply: {completion}"


@pytest.mark.parametrize("reply, scale, score", [
    ("Yes.", "yes_no", 1.0), ("no, it is 8", "yes_no", 0.0), ("  YES", "yes_no", 1.0), ("maybe", "yes_no", None),
    ("yesterday", "yes_no", None), ("Score: 9/10", "1-10", 8 / 9), ("1", "1-10", 0.0), ("11", "1-10", None),
    ("eleven", "1-10", None), ("3", "0-4", 0.75),
])
def test_replies_are_read_onto_the_declared_scale(reply, scale, score):
    assert read_judgement(reply, scale) == score


def _batch(tmp_path, judge_fn="judges:scripted", scale="yes_no"):
    rewards = {"correct": RewardSpec(fn="exact_answer"),
               "judge": RewardSpec(fn="judge", judge_fn=judge_fn, rubric=RUBRIC, scale=scale)}
    completions = ["7", "8", "seven", "6 or 7", "7", "5"]
    prompts = [[{"role": "user", "content": "What is 3+4?"}]] * len(completions)
    columns = {"answer": ["7"] * len(completions), "prompts": prompts}
    bound = bind_scorers(rewards, StageInputs(judge_cache=tmp_path / "judge-cache"))
    return rewards, bound, score_completions(rewards, completions, columns, bound), prompts, completions


def test_unreadable_replies_are_errors_and_the_audit_matches_a_hand_count(tmp_path):
    rewards, bound, scored, prompts, completions = _batch(tmp_path)
    judge = scored.components[1]
    # replies: Yes. / no / I cannot tell / YES... / Yes. / no (tests/judges.py's table)
    assert judge.scores == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert judge.errors == [(2, "judge reply 'I cannot tell' is not on scale yes_no")]  # counted apart
    assert judge.parsed == [True] * 6  # the judge's failure is not the policy's format error
    [audit] = audit_judges(rewards, scored, {"judge": bound["judge"]}, prompts, completions)
    # verifier (exact_answer, strict): 7 pass, 8 fail, seven unparsed fail, "6 or 7" fail, 7 pass, 5 fail
    assert audit.counts == {"both_pass": 2, "judge_only": 1, "verifier_only": 0, "both_fail": 2, "judge_errors": 1}
    assert audit.agreement == 4 / 5
    assert [(row["completion"], row["judge_reply"], row["verifier_score"]) for row in audit.disagreements] == [
        ("6 or 7", "YES, the answer is there", 0.0)]
    assert audit.metrics()["audit/judge/correct/agreement"] == 0.8


def test_numeric_scale_and_the_reply_cache_on_rerun(tmp_path):
    judges.CALLS.clear()
    _, _, scored, _, _ = _batch(tmp_path, "judges:numeric", "1-10")
    judge = scored.components[1]
    assert judge.scores == [8 / 9, 1 / 9, 0.0, 1 / 9, 8 / 9, 1 / 9] and [i for i, _ in judge.errors] == [2]
    assert judges.CALLS == [5]  # "7" twice in the batch: asked once
    _, bound, again, _, _ = _batch(tmp_path, "judges:numeric", "1-10")  # a new stage, the same cache
    assert again.components[1].scores == judge.scores and again.components[1].errors == judge.errors
    assert judges.CALLS == [5] and bound["judge"].asked == 0  # every reply came from the cache


PIPELINE = """\
name: judged
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  heldout: {generator: arithmetic, n: 6, seed: 5, role: heldout}
rewards:
  correct: {fn: exact_answer}
  lenient: {fn: judge, judge_fn: "judges:lenient", rubric: "Reply: {completion}"}
  by_model: {fn: judge, stage: base, rubric: "Is {completion} the answer to {prompt}? yes or no",
             sampling: {max_tokens: 3}}
reward_checks:
  lenient:
    - {case: success, answer: "7", completion: "7", min: 1.0}
    - {case: failure, answer: "7", completion: "8", max: MAX}
stages:
  eval_base:
    kind: eval
    model: base
    data: heldout
    rewards: [correct, lenient, by_model]
    sampling: {temperature: 1.0, max_tokens: 3, attempts: 2, seed: 1}
"""


def test_eval_audits_a_judge_and_a_rerun_asks_no_judge_twice(home, tmp_path):
    from flows.recording.home import configure_environment
    from flows.planning.lineage import RunOptions
    from flows.execution.pipeline import run_pipeline
    from flows.spec.loading import load_pipeline
    from flows.recording.tracking import Tracker

    home = configure_environment()
    loaded = load_pipeline(write(tmp_path / "p.yaml", PIPELINE.replace("MAX", "0.0")))
    judges.CALLS.clear()
    first = Tracker(home).get_run(run_pipeline(loaded, RunOptions(), home).rows[0].run_id)
    metrics, n = first.data.metrics, 12
    wrong = round(n * (1 - metrics["reward/correct/mean"]))
    assert metrics["audit/lenient/correct/judge_only"] == wrong  # the lenient judge passes every wrong answer
    assert metrics["audit/lenient/correct/both_pass"] == n - wrong
    assert metrics["audit/lenient/correct/agreement"] == (n - wrong) / n
    # an untrained model does not answer yes or no: each reply is a judge error, none is a score
    assert metrics["reward/by_model/errors"] == metrics["audit/by_model/correct/judge_errors"] == n
    if wrong:
        path = Tracker(home).client.download_artifacts(first.info.run_id, "audit/lenient_vs_correct.json",
                                                       str(tmp_path))
        assert len(json.load(open(path))["data"]) == wrong
    asked = sum(judges.CALLS)
    cached = sorted((home / "cache" / "judge").glob("*.jsonl"))
    lines = [len(p.read_text().splitlines()) for p in cached]
    second = Tracker(home).get_run(run_pipeline(loaded, RunOptions(no_cache=True), home).rows[0].run_id)
    audit_keys = [k for k in metrics if k.startswith("audit/") or k.startswith("reward/")]
    assert second.info.run_id != first.info.run_id
    assert {k: second.data.metrics[k] for k in audit_keys} == {k: metrics[k] for k in audit_keys}
    assert sum(judges.CALLS) == asked  # same samples: every judge reply came from the cache
    assert [len(p.read_text().splitlines()) for p in cached] == lines


def test_check_reward_runs_the_judge_on_its_known_cases(home, tmp_path, capsys):
    assert run_cli("check-reward", str(write(tmp_path / "p.yaml", PIPELINE.replace("MAX", "0.0"))),
                   "--reward", "lenient") == 1  # the lenient judge passes "8": a violation
    assert "score 1 > max 0" in capsys.readouterr().out
    assert run_cli("check-reward", str(write(tmp_path / "p.yaml", PIPELINE.replace("MAX", "1.0"))),
                   "--reward", "lenient") == 0


@pytest.mark.parametrize("reward, fragment", [
    ('{fn: judge, stage: sft, rubric: "{completion}"}', "rewards.bad.stage: unknown stage 'sft'"),
    ('{fn: judge, judge_fn: "judges:nowhere", rubric: "{completion}"}', "module 'judges' has no attribute"),
    ('{fn: judge, stage: base, rubric: "no placeholder"}', "containing {completion}"),
    ('{fn: judge, stage: base, rubric: "{completion}", scale: "10-1"}', "LOW-HIGH integers with LOW < HIGH"),
    ('{fn: judge, stage: base, rubric: "{completion} of {prompt.__class__}"}',
     "rewards.bad: rubric placeholder(s) {prompt.__class__} are not filled by posttrain: a rubric may use {prompt}, "
     "{completion}, {answer} only"),
    ('{fn: judge, stage: base, rubric: "{completion} {x[0]} {answer!r}"}', "placeholder(s) {answer!r}, {x[0]} are not"),
    ('{fn: math_answer, max_seconds: 0}', "rewards.bad.max_seconds: must be > 0.0 (got 0)"),
    ('{fn: judge, stage: base, rubric: "{completion}", sampling: {attempts: 3}}',
     "rewards.bad.sampling: attempts must be 1 for a judge, which reads one reply per conversation (got 3)"),
])
def test_bad_judges_are_refused_with_exit_2(tmp_path, capsys, reward, fragment):
    pipeline = PIPELINE.replace("rewards:\n", f"rewards:\n  bad: {reward}\n")
    assert run_cli("validate", str(write(tmp_path / "p.yaml", pipeline))) == 2
    assert fragment in capsys.readouterr().err


def test_grpo_audits_its_judge_every_n_reward_batches(tiny_checkpoint, ctx_factory, home):
    from test_grpo import grpo_config, inputs_for

    from stages import rl

    ctx = ctx_factory("grpo-judged")
    rewards = {"correct": RewardSpec(fn="exact_answer", weight=0.0),
               "lenient": RewardSpec(fn="judge", judge_fn="judges:lenient", rubric="Reply: {completion}",
                                     audit_every=1)}
    inputs = replace(inputs_for(home, tiny_checkpoint, rewards), judge_cache=home / "judge-cache")
    rl.run(grpo_config(max_steps=2, rewards=["correct", "lenient"]), inputs, ctx)
    ctx.flush()
    history = {name: ctx.metric_history(f"audit/lenient/correct/{name}")
               for name in ("both_pass", "judge_only", "verifier_only", "both_fail", "judge_errors")}
    assert [p.step for p in history["judge_only"]] == [1, 2]  # every batch (audit_every: 1)
    for i in range(2):  # a judge that passes everything never fails what the verifier passes
        assert history["verifier_only"][i].value == history["both_fail"][i].value == 0
        assert history["both_pass"][i].value + history["judge_only"][i].value == 16  # 4 prompts x 4 completions
    tables = {a.path for a in ctx.client.list_artifacts(ctx.run_id, "audit")}
    assert "audit/lenient_vs_correct_batch_00001.json" in tables


@pytest.mark.parametrize("policy", ["score", "fail"])
def test_an_unreadable_judge_reply_is_a_reward_error_with_the_reply_logged(tiny_checkpoint, ctx_factory, home,
                                                                          capsys, policy):
    """A reply off the judge's scale is never a score: under `score` it is counted and written to the stage's
    log with its completion, and the stage goes on; under `fail` it fails the stage naming the reply."""
    from test_grpo import grpo_config, inputs_for

    from stages import rl

    rewards = {"correct": RewardSpec(fn="exact_answer"),
               "unsure": RewardSpec(fn="judge", judge_fn="judges:unsure", rubric="Reply: {completion}", weight=0.0)}
    inputs = replace(inputs_for(home, tiny_checkpoint, rewards), judge_cache=home / "judge-cache")
    config = grpo_config(max_steps=2, rewards=["correct", "unsure"], reward_errors=policy)
    if policy == "fail":
        with pytest.raises(RuntimeError, match="reward 'unsure' raised judge reply 'I cannot tell' is not on scale "
                                               "yes_no on completion"):
            rl.run(config, inputs, ctx_factory("unsure-fail"))
        return
    ctx = ctx_factory("unsure-score")
    outputs = rl.run(config, inputs, ctx)
    assert outputs["metrics"]["reward_errors"] == 32  # 2 steps x 4 prompts x 4 completions, every one
    out = capsys.readouterr().out
    logged = [line for line in out.splitlines() if line.startswith("reward error (")]
    assert len(logged) == 20 and all("judge reply 'I cannot tell' is not on scale yes_no on completion" in line
                                     for line in logged), logged[:3]
    assert "reward errors after the first 20 are counted only (reward/errors)" in out


def test_ppo_audits_its_judge_every_n_reward_batches(tiny_checkpoint, ctx_factory, home):
    """posttrain's PPO scores a batch on every reward at once; its judge is audited like GRPO's."""
    from test_grpo import grpo_config, inputs_for

    from stages import rl

    ctx = ctx_factory("ppo-judged")
    rewards = {"correct": RewardSpec(fn="exact_answer", weight=0.0),
               "lenient": RewardSpec(fn="judge", judge_fn="judges:lenient", rubric="Reply: {completion}",
                                     audit_every=2)}
    inputs = replace(inputs_for(home, tiny_checkpoint, rewards), judge_cache=home / "judge-cache")
    rl.run(grpo_config(algorithm="ppo", max_steps=2, rewards=["correct", "lenient"], minibatch_size=8, ppo_epochs=1),
           inputs, ctx)
    history = {name: ctx.metric_history(f"audit/lenient/correct/{name}")
               for name in ("both_pass", "judge_only", "verifier_only", "both_fail")}
    assert [p.step for p in history["judge_only"]] == [2]  # every second batch (audit_every: 2)
    assert history["verifier_only"][0].value == history["both_fail"][0].value == 0  # the judge passes everything
    assert history["both_pass"][0].value + history["judge_only"][0].value == 16  # 4 prompts x 4 completions
    tables = {a.path for a in ctx.client.list_artifacts(ctx.run_id, "audit")}
    assert tables == {"audit/lenient_vs_correct_batch_00002.json"}


def test_online_dpo_audits_its_judge_every_n_reward_batches(tiny_checkpoint, ctx_factory, home):
    from test_grpo import inputs_for

    from stages.online_dpo import OnlineDPOStageConfig, run

    ctx = ctx_factory("online-dpo-judged")
    rewards = {"correct": RewardSpec(fn="exact_answer", weight=0.0),
               "lenient": RewardSpec(fn="judge", judge_fn="judges:lenient", rubric="Reply: {completion}",
                                     audit_every=1)}
    train = replace(inputs_for(home, tiny_checkpoint, rewards), judge_cache=home / "judge-cache")
    inputs = StageInputs(model=tiny_checkpoint, datasets=train.datasets, rewards=rewards, judge_cache=train.judge_cache)
    config = OnlineDPOStageConfig(kind="online_dpo", model="base", data="train", rewards=["correct", "lenient"],
                                  prompts_per_step=4, max_steps=2, backend="hf",
                                  sampling={"attempts": 2, "max_tokens": 3})
    run(config, inputs, ctx)
    history = {name: ctx.metric_history(f"audit/lenient/correct/{name}") for name in ("both_pass", "judge_only")}
    assert [p.step for p in history["judge_only"]] == [1, 2]
    assert all(a.value + b.value == 8 for a, b in zip(history["both_pass"], history["judge_only"]))  # 4 x 2


def test_rewards_other_than_judges_hash_as_before_judges_existed():
    """Stage fingerprints and eval settings hash ``RewardSpec.identity()``: a judge's fields appear only on a
    judge, so upgrading keeps every cached run and every comparable evaluation of other rewards."""
    assert set(RewardSpec(fn="exact_answer").identity()) == {"fn", "weight", "kwargs", "stage", "normalize", "offset",
                                                              "batch_size"}
    judged = RewardSpec(fn="judge", judge_fn="judges:lenient", rubric="{completion}").identity()
    assert judged["rubric"] == "{completion}" and judged["sampling"]["temperature"] == 0.0
    # the one sampling schema with a judge's defaults: greedy, 8 tokens, one reply; set fields kept
    assert {k: judged["sampling"][k] for k in ("max_tokens", "attempts")} == {"max_tokens": 8, "attempts": 1}
    short = RewardSpec(fn="judge", judge_fn="judges:lenient", rubric="{completion}", sampling={"max_tokens": 3})
    assert (short.sampling.temperature, short.sampling.max_tokens, short.sampling.attempts) == (0.0, 3, 1)
