"""Silent failures named (stages/training/alerts.py): a sampling stage that learns nothing says why, in its run's
``posttrain.alert`` tag, on the terminal and in the summary."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from stages.training.alerts import AlertSettings, SilentFailureWatch
from stages.context import StageInputs
from stages.data.sources import ArithmeticData, materialize
from stages.rewards.spec import RewardSpec
from stages.rl_common import rl_stage_config

ALERT = "posttrain.alert"


def test_the_watch_alerts_once_per_cause_after_the_steps_in_a_row_most_likely_cause_first():
    watch = SilentFailureWatch(AlertSettings(after_steps=3), max_tokens=4)
    quiet = {"reward/mean": 0.4, "reward/zero_variance_group_frac": 0.5, "completion/truncated_frac": 0.1,
             "reward/correct/unparsed_frac": 0.2}
    broken = {"reward/mean": 0.0, "reward/zero_variance_group_frac": 1.0, "completion/truncated_frac": 0.95,
              "reward/correct/unparsed_frac": 1.0}
    assert [watch.observe(m, step) for step, m in enumerate([broken, broken, quiet, broken, broken], 1)] == [[]] * 5
    alerts = watch.observe(broken, 6)  # the third broken step in a row
    assert [a.split(":")[0] for a in alerts] == ["step 6"] * 3
    assert "token budget (sampling.max_tokens 4)" in alerts[0]  # a cut reply is also unparseable: budget first
    assert "reward 'correct' could not parse 100%" in alerts[1]
    assert "every reward was 0 for 3 steps in a row" in alerts[2] and "check-reward" in alerts[2]
    assert watch.observe(broken, 7) == []  # each cause once
    assert watch.messages == alerts


def test_online_dpo_ties_count_as_no_signal():
    watch = SilentFailureWatch(AlertSettings(after_steps=1), max_tokens=8)
    assert watch.observe({"reward/mean": 0.0, "pairs/tie_frac": 1.0}, 1)[0].startswith("step 1: every reward was 0")


def always_zero(completions, **_):
    """A broken verifier: parses everything, rewards nothing."""
    return [0.0] * len(completions)


def rl_inputs(home, checkpoint, rewards):
    data = materialize(ArithmeticData(generator="arithmetic", n=40, role="train"), Path("."), home / "data")
    return StageInputs(policy=checkpoint, datasets={"train": data}, rewards=rewards)


def rl_config(algorithm: str, **fields):
    extra = {"minibatch_size": 8, "ppo_epochs": 1} if algorithm == "ppo" else {}
    return rl_stage_config(**{"kind": "rl", "algorithm": algorithm, "policy": "base", "data": "train",
                            "rewards": ["correct"], "prompts_per_step": 4, "max_steps": 3, "lr": 1e-3, **extra,
                            **fields})


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_verifier_that_always_scores_zero_is_named_within_the_steps(tiny_checkpoint, ctx_factory, home, algorithm):
    from stages import rl

    ctx = ctx_factory(f"alert-zero-{algorithm}")
    config = rl_config(algorithm, sampling={"attempts": 4, "max_tokens": 3}, alerts={"after_steps": 2})
    rl.run(config, rl_inputs(home, tiny_checkpoint, {"correct": RewardSpec(fn="test_alerts:always_zero")}), ctx)
    tag = ctx.recorded_run().data.tags[ALERT]
    assert "step 2: every reward was 0 for 2 steps in a row" in tag
    assert ctx.alerts == tag.splitlines()  # what the summary lists


def test_an_unparseable_format_is_named_as_the_cause(tiny_checkpoint, ctx_factory, home):
    """The untrained model never writes a bare integer: exact_answer parses none of its replies."""
    from stages import rl

    ctx = ctx_factory("alert-format")
    config = rl_config("ppo", sampling={"attempts": 2, "max_tokens": 6}, alerts={"after_steps": 2})
    rl.run(config, rl_inputs(home, tiny_checkpoint, {"correct": RewardSpec(fn="exact_answer")}), ctx)
    tag = ctx.recorded_run().data.tags[ALERT]
    assert "step 2: reward 'correct' could not parse 100% of completions for 2 steps in a row" in tag
    assert "format" in tag


def test_a_too_small_token_budget_is_named_as_the_cause(tiny_checkpoint, ctx_factory, home):
    from stages import online_dpo

    ctx = ctx_factory("alert-budget")
    config = online_dpo.OnlineDPOStageConfig(
        kind="online_dpo", model="base", data="train", rewards=["short"], prompts_per_step=4, max_steps=2,
        sampling={"attempts": 2, "max_tokens": 1}, alerts={"after_steps": 2, "truncated_frac": 0.8})
    rewards = {"short": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    inputs = rl_inputs(home, tiny_checkpoint, rewards)
    online_dpo.run(config, StageInputs(model=tiny_checkpoint, datasets=inputs.datasets, rewards=rewards), ctx)
    tag = ctx.recorded_run().data.tags[ALERT]
    # one token: most replies are cut (a few end at once), past the stage's threshold of 80%
    assert tag.startswith("step 2: ") and "of completions hit the token budget (sampling.max_tokens 1)" in tag
    truncated = [p.value for p in ctx.metric_history("completion/truncated_frac")]
    assert all(0.8 <= share for share in truncated) and f"{100 * truncated[-1]:.0f}% of completions" in tag


def test_a_healthy_stage_raises_no_alert(tiny_checkpoint, ctx_factory, home):
    from stages import rl

    ctx = ctx_factory("alert-none")
    rewards = {"correct": RewardSpec(fn="length_penalty", kwargs={"target_chars": 0, "per_char": 0.5})}
    rl.run(rl_config("grpo", sampling={"attempts": 4, "max_tokens": 3}, alerts={"after_steps": 1,
                     "truncated_frac": 1.0}), rl_inputs(home, tiny_checkpoint, rewards), ctx)
    run = ctx.recorded_run()
    # rewards that differ within groups, nothing unparsed; replies may all be cut at 3 tokens, so that cause
    # alone could be named: nothing else is
    assert all("token budget" in line for line in run.data.tags.get(ALERT, "").splitlines())


def test_the_summary_lists_an_alert_and_the_fingerprint_ignores_the_thresholds(home, tmp_path):
    from rich.console import Console

    from flows.recording.home import configure_environment
    from flows.planning.lineage import RunOptions, fingerprint
    from flows.execution.pipeline import print_summary, run_pipeline, summary_markdown
    from flows.spec.loading import load_pipeline

    from conftest import QUICKSTART

    configure_environment()
    small = ["data.train.n=64", "data.heldout.n=8", "stages.sft.max_steps=2", "stages.sft.batch_size=8",
             "stages.grpo.max_steps=2", "stages.grpo.sampling.max_tokens=1", "stages.grpo.alerts.after_steps=2",
             "stages.grpo.check_rewards=false"]
    loaded = load_pipeline(QUICKSTART, small + ["stages.eval_base.max_prompts=2", "stages.eval_sft.max_prompts=2",
                                                "stages.eval_grpo.max_prompts=2"])
    report = run_pipeline(loaded, RunOptions(), home)
    rows = {row.stage: row for row in report.rows}
    assert not report.failed, [(r.stage, r.note) for r in report.rows]
    assert rows["grpo"].alerts and "token budget (sampling.max_tokens 1)" in rows["grpo"].alerts[0]
    out = io.StringIO()
    print_summary(report, Console(file=out, width=300))
    assert f"alert grpo: {rows['grpo'].alerts[0]}" in out.getvalue()
    assert f"- **alert** `grpo`: {rows['grpo'].alerts[0]}" in summary_markdown(report)

    relaxed = load_pipeline(QUICKSTART, small[:-2] + ["stages.grpo.alerts.after_steps=9",
                                                      "stages.grpo.check_rewards=false"])
    upstream = {"sft": "run-a"}
    assert fingerprint(relaxed, "grpo", upstream) == fingerprint(loaded, "grpo", upstream)


# ---------------------------------------------------------------- reward hacking: a learned reward against a check

CHAIN_PROMPT = [{"role": "user", "content": "Compute 2+3-1"}]


def pays_every_step(completions, **_):
    """A learned process reward that pays length: every step looks right to it (P(right) 0.9), as a PRM that
    has learnt little more than "steps are usually right"."""
    from stages.rewards.spec import RewardOutput
    from stages.rewards.steps import StepScore, split_steps

    steps = [[StepScore(a, b, 0.9) for a, b in split_steps(text)] for text in completions]
    return RewardOutput([0.9 if s else 0.0 for s in steps], [bool(s) for s in steps], steps=steps)


def drifting_policy(step: int) -> list[str]:
    """What a policy paid for steps writes at ``step``: the right chain, then one step more every 5 steps (each
    extra step also moves the answer, so the verifier's check falls)."""
    extra = (step - 1) // 5
    tail = "".join(f", {4 + i}+1={5 + i}" for i in range(extra))
    return ["2+3=5, 5-1=4" + tail, "2+3=5, 5-1=4" + tail, "2+3=6, 6-1=5" + tail, "2+3=5, 5-1=4" + tail]


def step_metrics(completions: list[str], learned_fn, step_credit: str) -> dict[str, float]:
    """The metrics a PPO step logs for these completions: the learned process reward ``prm`` (its credited
    pay under ``step_credit``, process_weight 1) and the verifier's step check ``steps``."""
    from stages.ppo import credited_means
    from stages.rewards.scoring import ComponentScores, ScoredBatch
    from stages.rewards.steps import chain_steps

    learned, check = learned_fn(completions, prompts=[CHAIN_PROMPT] * 4), chain_steps(completions, [CHAIN_PROMPT] * 4)
    components = [ComponentScores("prm", 1.0, learned.scores, learned.parsed, steps=learned.steps),
                  ComponentScores("steps", 0.0, check.scores, check.parsed, steps=check.steps)]
    scored = ScoredBatch(components, learned.scores)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"reward/mean": mean(learned.scores), "reward/prm/mean": mean(learned.scores),
            "reward/steps/mean": mean(check.scores), **credited_means(scored, 1.0, step_credit)}


def honest_prm(completions, prompts, **_):
    """A learned process reward that agrees with the verifier (chain_steps' own step scores)."""
    from stages.rewards.steps import chain_steps

    return chain_steps(completions, prompts)


def test_hacking_pairs_are_each_learned_reward_trained_on_beside_each_check():
    from stages.training.alerts import hacking_pairs

    assert hacking_pairs({"correct": ("exact_answer", 1.0), "prm": ("reward_model", 1.0), "judge": ("judge", 0.5),
                          "rm_off": ("reward_model", 0.0), "steps": ("chain_steps", 0.0)}) == [
        ("prm", "correct"), ("prm", "steps"), ("judge", "correct"), ("judge", "steps")]
    assert hacking_pairs({"correct": ("exact_answer", 1.0), "steps": ("chain_steps", 1.0)}) == []


def test_a_length_paying_learned_reward_is_named_as_hacking_within_the_windows(ctx_factory):
    """A PRM that pays every step, under PPO's summed step credit, pays the drifting policy more each window
    while the verifier's check falls: the alert comes at step hacking_window x (hacking_windows + 1) = 20, in
    the run's tag and the summary's list, and not before."""
    from stages.training.alerts import SilentFailureWatch

    ctx = ctx_factory("alert-hacking")
    watch = SilentFailureWatch(AlertSettings(hacking_window=5, hacking_windows=3), 24, [("prm", "steps")])
    for step in range(1, 20):
        watch.report(ctx, step, step_metrics(drifting_policy(step), pays_every_step, "sum"))
        assert watch.messages == [], step
    watch.report(ctx, 20, step_metrics(drifting_policy(20), pays_every_step, "sum"))
    tag = ctx.recorded_run().data.tags[ALERT]
    assert tag.startswith("step 20: reward hacking? the learned reward 'prm' rose (1.800 -> 4.500) while the check "
                          "'steps' fell (0.875 -> 0.350), 3 windows of 5 steps in a row")
    assert ctx.alerts == tag.splitlines() == watch.messages
    watch.report(ctx, 25, step_metrics(drifting_policy(25), pays_every_step, "sum"))
    assert len(watch.messages) == 1  # once


@pytest.mark.parametrize("learned_fn, step_credit", [(honest_prm, "sum"), (pays_every_step, "min")])
def test_no_hacking_alert_where_the_learned_reward_does_not_rise_as_the_check_falls(learned_fn, step_credit):
    """The same drifting policy: a learned reward that agrees with the verifier falls with it; the length-paying
    one under step_credit min pays the worst step, which extra steps cannot raise. Neither alerts in 40 steps."""
    from stages.training.alerts import SilentFailureWatch

    watch = SilentFailureWatch(AlertSettings(hacking_window=5, hacking_windows=3), 24, [("prm", "steps")])
    for step in range(1, 41):
        assert watch.observe(step_metrics(drifting_policy(step), learned_fn, step_credit), step) == [], step


def test_the_hacking_watch_resumes_where_it_stopped():
    from stages.training.alerts import SilentFailureWatch

    settings = AlertSettings(hacking_window=5, hacking_windows=3)
    first = SilentFailureWatch(settings, 24, [("prm", "steps")])
    for step in range(1, 13):
        first.observe(step_metrics(drifting_policy(step), pays_every_step, "sum"), step)
    resumed = SilentFailureWatch(settings, 24, [("prm", "steps")])
    resumed.restore(first.state())
    alerts = [resumed.observe(step_metrics(drifting_policy(step), pays_every_step, "sum"), step)
              for step in range(13, 21)]
    assert alerts[-1] and alerts[-1][0].startswith("step 20: reward hacking?") and not any(alerts[:-1])
