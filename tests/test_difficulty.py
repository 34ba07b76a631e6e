"""The rl stage's difficulty filter: score prompts under the starting policy, train on the
ones it sometimes solves (stages/difficulty.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import QUICKSTART, run_cli, torch_threads, write
from stages.data.sources import read_materialized
from stages.difficulty import DifficultyFilterEmpty, filter_prompts
from stages.rewards.spec import RewardSpec
from stages.rl_common import rl_stage_config
from stages.context import StageInputs


KINDS = ["easy", "hard", "mixed"]
N_PROMPTS = 12


def by_answer(completions, answer, seen=None, **_):
    """A verifier whose verdict the test knows: every attempt at an `easy-*` prompt is right,
    none at a `hard-*` prompt, and at a `mixed-*` prompt every other attempt (so with an even
    number of attempts per prompt, exactly half). With ``seen`` (a file), each call's answers are
    appended to it as a JSON line: rewards run in the stage's reward worker, another process."""
    if seen is not None:
        with open(seen, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(list(answer)) + "\n")
    return [1.0 if a.startswith("easy") else 0.0 if a.startswith("hard") else float(i % 2 == 0)
            for i, a in enumerate(answer)]


def write_prompts(path: Path, answers: list[str]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for i, answer in enumerate(answers):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}],
                                     "answer": answer}) + "\n")
    return path


def known_answers() -> list[str]:
    return [f"{KINDS[i % 3]}-{i}" for i in range(N_PROMPTS)]  # easy-0, hard-1, mixed-2, easy-3, ...


def rl_config(**overrides):
    fields = dict(kind="rl", algorithm="grpo", policy="base", data="train", rewards=["verdict"],
                  sampling={"attempts": 4, "max_tokens": 3}, prompts_per_step=2, max_steps=2, sample_every=1,
                  difficulty_filter={"sampling": {"attempts": 4}})
    return rl_stage_config(**(fields | overrides))


def stage_inputs(checkpoint, data: Path, rewards=None, seen: Path | None = None) -> dict:
    verdict = RewardSpec(fn="test_difficulty:by_answer", kwargs={"seen": str(seen)} if seen else {})
    return StageInputs(policy=checkpoint, datasets={"data": data}, rewards=rewards or {"verdict": verdict})


def seen_calls(seen: Path) -> list[list[str]]:
    """The answers of every call of ``by_answer`` that logged to ``seen``, call by call."""
    return [json.loads(line) for line in seen.read_text(encoding="utf-8").splitlines()]


def logged_metrics(ctx) -> dict[str, float]:
    ctx.flush()
    return ctx.recorded_run().data.metrics


def test_filter_keeps_prompts_strictly_between_the_bounds(tiny_checkpoint, ctx_factory, tmp_path):
    ctx = ctx_factory("difficulty")
    data = write_prompts(tmp_path / "prompts.jsonl", known_answers())
    seen = tmp_path / "seen.jsonl"
    with torch_threads(1):
        kept_path = filter_prompts(rl_config(), stage_inputs(tiny_checkpoint, data, seen=seen), ctx)

    calls = seen_calls(seen)  # every prompt, 4 attempts, prompt-major, in calls of at most 32 (the worker's chunks)
    assert [a for call in calls for a in call] == [a for a in known_answers() for _ in range(4)]
    assert [len(call) for call in calls] == [32, 16]
    kept = read_materialized(kept_path)
    assert [r["answer"] for r in kept] == [a for a in known_answers() if a.startswith("mixed")]
    assert kept == [r for r in read_materialized(data) if r["answer"].startswith("mixed")]  # records unchanged
    assert ctx.staged["difficulty_kept"] == str(kept_path)  # published with the stage's outputs
    metrics = logged_metrics(ctx)
    assert {k: metrics[f"difficulty/{k}"] for k in ("prompts_scored", "kept", "too_easy", "too_hard")} == \
        {"prompts_scored": 12.0, "kept": 4.0, "too_easy": 4.0, "too_hard": 4.0}
    assert metrics["difficulty/kept_frac"] == pytest.approx(1 / 3)
    assert metrics["difficulty/pass_mean"] == pytest.approx((4 * 1.0 + 4 * 0.5) / 12)
    assert metrics["difficulty/generated_tokens"] > 0 and metrics["difficulty/seconds"] > 0
    params = ctx.recorded_run().data.params
    assert params["difficulty/resolved_verifier"] == "verdict"
    # the sampler defaults to the stage's rollout settings and seed
    assert (params["difficulty/sampling/max_tokens"], params["difficulty/sampling/attempts"],
            params["difficulty/sampling/seed"]) == ("3", "4", "0")
    table = json.loads(Path(ctx.client.download_artifacts(ctx.run_id, "difficulty.json", str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(r["answer"], r["pass_rate"], r["verdict"]) for r in rows[:3]] == \
        [("easy-0", 1.0, "too_easy"), ("hard-1", 0.0, "too_hard"), ("mixed-2", 0.5, "kept")]


def test_max_prompts_scores_only_the_first_prompts(tiny_checkpoint, ctx_factory, tmp_path):
    ctx = ctx_factory("difficulty-first")
    data = write_prompts(tmp_path / "prompts.jsonl", known_answers())
    config = rl_config(algorithm="ppo", difficulty_filter={"sampling": {"attempts": 2}, "max_prompts": 6})
    with torch_threads(1):
        kept = read_materialized(filter_prompts(config, stage_inputs(tiny_checkpoint, data), ctx))
    assert [r["answer"] for r in kept] == ["mixed-2", "mixed-5"]
    assert logged_metrics(ctx)["difficulty/prompts_scored"] == 6.0


def test_bounds_that_exclude_every_prompt_fail_the_stage_with_the_counts(tiny_checkpoint, ctx_factory, tmp_path):
    """min_pass is exclusive: the mixed prompts' pass rate 0.5 is not above 0.5."""
    ctx = ctx_factory("difficulty-empty")
    data = write_prompts(tmp_path / "prompts.jsonl", known_answers())
    config = rl_config(algorithm="ppo", difficulty_filter={"sampling": {"attempts": 4}, "min_pass": 0.5})
    with torch_threads(1), pytest.raises(DifficultyFilterEmpty) as raised:
        filter_prompts(config, stage_inputs(tiny_checkpoint, data), ctx)
    message = str(raised.value)
    assert "kept 0 of 12 prompts scored (4 too easy: pass rate >= max_pass 1.0; 8 too hard: pass rate <= " \
           "min_pass 0.5; 4 attempts each, verifier 'verdict')" in message, message
    assert logged_metrics(ctx)["difficulty/kept"] == 0.0  # the cost is logged even when the stage fails
    assert "difficulty_kept" not in ctx.staged


def test_grpo_needs_prompts_per_step_kept_prompts(tiny_checkpoint, ctx_factory, tmp_path):
    ctx = ctx_factory("difficulty-few")
    data = write_prompts(tmp_path / "prompts.jsonl", known_answers())
    with torch_threads(1), pytest.raises(DifficultyFilterEmpty, match=r"kept 4 of 12 .* grpo needs at least "
                                         r"prompts_per_step \(8\) distinct prompts per step"):
        filter_prompts(rl_config(prompts_per_step=8), stage_inputs(tiny_checkpoint, data), ctx)


def test_the_builtin_verifier_on_the_real_policy(tiny_checkpoint, ctx_factory, tmp_path):
    """exact_answer against answers the untrained policy cannot write in 3 tokens: all too hard."""
    ctx = ctx_factory("difficulty-exact")
    data = write_prompts(tmp_path / "prompts.jsonl", ["123456789"] * 5)
    config = rl_config(algorithm="ppo", rewards=["correct"], difficulty_filter={"sampling": {"attempts": 3}})
    with torch_threads(1), pytest.raises(DifficultyFilterEmpty, match=r"kept 0 of 5 prompts scored \(0 too easy"):
        filter_prompts(config, stage_inputs(tiny_checkpoint, data, {"correct": RewardSpec(fn="exact_answer")}), ctx)
    assert logged_metrics(ctx)["difficulty/too_hard"] == 5.0


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rl_stage_trains_only_on_the_kept_prompts(tiny_checkpoint, ctx_factory, tmp_path, algorithm):
    from stages import rl

    ctx = ctx_factory(f"difficulty-{algorithm}")
    data = write_prompts(tmp_path / "prompts.jsonl", known_answers())
    extra = {"minibatch_size": 8, "ppo_epochs": 1} if algorithm == "ppo" else {}
    seen = tmp_path / "seen.jsonl"
    with torch_threads(1):
        outputs = rl.run(rl_config(algorithm=algorithm, **extra), stage_inputs(tiny_checkpoint, data, seen=seen), ctx)

    first, second, *training = seen_calls(seen)
    assert len(first) + len(second) == N_PROMPTS * 4  # the filter's two calls
    assert training, "training never scored a rollout"
    trained_on = {answer for call in training for answer in call}
    assert trained_on and all(a.startswith("mixed") for a in trained_on), trained_on
    assert ctx.recorded_run().data.params["prompts"] == "4"  # the trainer read the kept set
    assert Path(outputs["checkpoint"]).is_dir()
    assert logged_metrics(ctx)["difficulty/kept"] == 4.0


FILTER_LINE = "    max_steps: 250\n"


@pytest.mark.parametrize("block, path, message", [
    ("{min_pass: 0.6, max_pass: 0.4}", "stages.grpo.difficulty_filter",
     "min_pass (0.6) must be below max_pass (0.4)"),
    ("{max_pass: 1.5}", "stages.grpo.difficulty_filter.max_pass", "1"),
    ("{min_pass: -0.1}", "stages.grpo.difficulty_filter.min_pass", "0"),
    ("{sampling: {attempts: 1}}", "stages.grpo.difficulty_filter.sampling", "attempts must be at least 2"),
    ("{attempts: 4}", "stages.grpo.difficulty_filter", "attempts was renamed (did you mean sampling.attempts?)"),
    ("{sampling: {temperature: 0}}", "stages.grpo.difficulty_filter.sampling", "temperature must be above 0"),
    ("{verifier: nope}", "stages.grpo", "difficulty_filter.verifier 'nope' must be one of the stage's rewards"),
])
def test_validate_refuses_a_bad_filter(tmp_path, capsys, block, path, message):
    text = QUICKSTART.read_text()
    assert FILTER_LINE in text
    file = write(tmp_path / "p.yaml", text.replace(FILTER_LINE, FILTER_LINE + f"    difficulty_filter: {block}\n"))
    assert run_cli("validate", str(file)) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and message in err, err


def test_validate_accepts_a_filter_and_its_settings_are_in_the_fingerprint(tmp_path, capsys):
    from flows.planning.lineage import fingerprint
    from flows.spec.loading import load_pipeline

    text = QUICKSTART.read_text().replace(
        FILTER_LINE, FILTER_LINE + "    difficulty_filter: {sampling: {attempts: 4}, max_prompts: 200}\n")
    file = write(tmp_path / "p.yaml", text)
    assert run_cli("validate", str(file)) == 0, capsys.readouterr().err
    runs = {"sft": "run-sft"}
    filtered = fingerprint(load_pipeline(file), "grpo", runs)
    assert filtered != fingerprint(load_pipeline(QUICKSTART), "grpo", runs)
    assert filtered != fingerprint(load_pipeline(file, ["stages.grpo.difficulty_filter.max_pass=0.9"]), "grpo", runs)
