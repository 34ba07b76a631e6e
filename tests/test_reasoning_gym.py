"""reasoning-gym tasks as data and as a reward, against the real reasoning-gym package.

The reward must say what reasoning-gym's own ``score_answer`` says about the answer a reply
gives in the declared format; the data source must write that format's instruction and
demonstration; the validator must refuse unknown tasks, configs reasoning-gym rejects, and
a reasoning_gym reward on data that names no task entry.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import reasoning_gym

from conftest import run_cli, write
from stages.data.sources import ReasoningGymData, data_key, load_records, materialize, read_materialized
from stages.data.failures import failure_training_records
from stages.data.reasoning_gym import DEFAULT_INSTRUCTIONS, demonstration, last_boxed
from stages.rewards.scoring import reward_columns, score_completions
from stages.rewards.spec import RewardError, RewardSpec
from stages.context import StageInputs

ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TASKS = {"chain_sum": ONE_DIGIT_SUMS, "basic_arithmetic": {}, "leg_counting": {}}
FORMATS = ["answer_tags", "boxed", "whole"]
REWARD = {"rg": RewardSpec(fn="reasoning_gym")}


def gym(task="chain_sum", config=None, n=6, seed=0, **fields) -> ReasoningGymData:
    config = ONE_DIGIT_SUMS if config is None and task == "chain_sum" else (config or {})
    return ReasoningGymData(reasoning_gym=task, config=config, n=n, seed=seed, role="train", **fields)


def score(records: list[dict], completions: list[str]):
    columns = reward_columns(records, [r["messages"][:-1] for r in records], 1)
    return score_completions(REWARD, completions, columns).components[0]


def written(answer: str, fmt: str) -> str:
    """A reply giving ``answer`` in ``fmt``, with some reasoning around it where the format allows."""
    return {"answer_tags": f"Adding up, I get <answer>{answer}</answer>", "boxed": f"So it is $\\boxed{{{answer}}}$.",
            "whole": f"  {answer}\n"}[fmt]


# ---------------------------------------------------------------- the reward


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("task", TASKS)
def test_reward_is_reasoning_gyms_own_score(task, fmt):
    spec = gym(task, TASKS[task], answer_format=fmt)
    records = load_records(spec, Path("."))
    dataset = reasoning_gym.create_dataset(task, seed=0, size=spec.n, **TASKS[task])
    entries = [dataset[i] for i in range(spec.n)]
    wrong = [str(int(e["answer"]) + 1) for e in entries]
    unparsable = {"answer_tags": "I think it is 7", "boxed": "\\boxed{7", "whole": "   "}[fmt]

    right_out = score(records, [written(e["answer"], fmt) for e in entries])
    wrong_out = score(records, [written(w, fmt) for w in wrong])
    none_out = score(records, [unparsable] * spec.n)

    assert right_out.scores == [dataset.score_answer(e["answer"], e) for e in entries] == [1.0] * spec.n
    assert wrong_out.scores == [dataset.score_answer(w, e) for w, e in zip(wrong, entries)] == [0.0] * spec.n
    assert none_out.scores == [dataset.score_answer(None, e) for e in entries]
    assert right_out.parsed == wrong_out.parsed == [True] * spec.n
    assert none_out.parsed == [False] * spec.n
    assert not (right_out.errors or wrong_out.errors or none_out.errors)


def test_partial_credit_is_reasoning_gyms():
    # leg_counting keeps reasoning-gym's default check: a reply that contains the answer gets len(answer)/len(reply)
    records = load_records(gym("leg_counting", answer_format="whole", n=3), Path("."))
    dataset = reasoning_gym.create_dataset("leg_counting", seed=0, size=3)
    replies = [f"{r['answer']} legs" for r in records]
    out = score(records, replies)
    assert out.scores == [dataset.score_answer(reply, dataset[i]) for i, reply in enumerate(replies)]
    assert all(0.0 < s < 1.0 for s in out.scores) and out.parsed == [True] * 3


FOUR_MINUS_ONE = {"reasoning_gym": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                         "max_digits": 2}, "seed": 0, "size": 4000, "index": 1}


def test_binary_pays_only_full_credit():
    """chain_sum "4 - 1 =": reasoning-gym pays 0.5 for 13, 33, 30 and -3 (each contains the 3);
    binary, the option RL trains on, pays 1 for the answer only."""
    replies = [f"<answer>{a}</answer>" for a in ("3", "13", "33", "30", "-3", "4")]
    columns = {"answer": ["3"] * 6, "prompts": [[]] * 6, "task": [FOUR_MINUS_ONE] * 6}
    partial = score_completions(REWARD, replies, columns).components[0]
    assert partial.scores == [1.0, 0.5, 0.5, 0.5, 0.5, 0.0]  # reasoning-gym's own, unchanged
    binary = score_completions({"rg": RewardSpec(fn="reasoning_gym", kwargs={"binary": True})}, replies, columns)
    assert binary.components[0].scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert binary.components[0].parsed == [True] * 6


def test_empty_answer_tags_are_a_format_error():
    replies = ["<answer></answer>", "<answer>  </answer>", "\\boxed{}"]
    tasks = [FOUR_MINUS_ONE, FOUR_MINUS_ONE, {**FOUR_MINUS_ONE, "answer_format": "boxed"}]
    out = score_completions(REWARD, replies, {"answer": ["3"] * 3, "prompts": [[]] * 3, "task": tasks}).components[0]
    assert out.parsed == [False, False, False] and out.scores == [0.0, 0.0, 0.0]


def test_the_smollm2_pipeline_trains_on_the_binary_reward(home, capsys):
    from flows.spec.loading import load_pipeline

    path = Path(__file__).resolve().parents[1] / "pipelines" / "smollm2-reasoning.yaml"
    assert load_pipeline(path).spec.rewards["correct"].kwargs == {"binary": True}
    assert run_cli("check-reward", str(path)) == 0
    assert "0 violations" in capsys.readouterr().out


def test_an_answer_the_tasks_parser_cannot_read_is_unparsed_not_an_error():
    records = load_records(gym("prime_factorization", n=2), Path("."))
    out = score(records, ["<answer>2 x 3</answer>", demonstration(records[1]["answer"], "answer_tags")])
    assert out.scores == [0.0, 1.0] and out.parsed == [False, True] and not out.errors


def test_last_boxed_balances_braces():
    assert last_boxed("first \\boxed{1}, then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{ 12 } and \\boxed{3") == "12"
    assert last_boxed("no box") is None


def test_reward_refuses_data_without_a_task_and_data_it_did_not_generate():
    with pytest.raises(RewardError, match="scores reasoning_gym datasets only"):
        score_completions(REWARD, ["<answer>3</answer>"], {"answer": ["3"], "prompts": [[]]})
    records = load_records(gym(n=2), Path("."))
    records[1]["answer"] = str(int(records[1]["answer"]) + 1)  # as if built by another reasoning-gym version
    with pytest.raises(RewardError, match="generates different data than the materialised dataset"):
        score(records, ["<answer>0</answer>"] * 2)


def test_grpo_reward_function_decodes_the_json_task_column():
    from stages.grpo import make_reward_func
    from stages.rewards.scoring import RewardErrorPolicy, Scorer

    records = load_records(gym(n=3), Path("."))
    reward = make_reward_func("rg", Scorer(REWARD, RewardErrorPolicy("fail", 0)), None)
    completions = [[{"role": "assistant", "content": r["messages"][-1]["content"]}] for r in records]
    scores = reward([r["messages"][:-1] for r in records], completions, answer=[r["answer"] for r in records],
                    task=[json.dumps(r["task"]) for r in records])
    assert scores == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------- the data source


def test_records_carry_instruction_demonstration_and_task():
    config = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    dataset = reasoning_gym.create_dataset("chain_sum", seed=7, size=4, **config)
    for fmt in FORMATS:
        records = load_records(gym(config=config, n=4, seed=7, answer_format=fmt), Path("."))
        for i, record in enumerate(records):
            entry = dataset[i]
            user, assistant = record["messages"]
            assert user == {"role": "user", "content": f"{entry['question']}\n\n{DEFAULT_INSTRUCTIONS[fmt]}"}
            assert assistant["content"] == {"answer_tags": f"<answer>{entry['answer']}</answer>",
                                            "boxed": f"\\boxed{{{entry['answer']}}}", "whole": entry["answer"]}[fmt]
            assert record["answer"] == entry["answer"]
            assert record["task"] == {"reasoning_gym": "chain_sum", "config": config, "seed": 7, "size": 4,
                                      "index": i, "answer_format": fmt}
    custom = load_records(gym(n=1, system_prompt="Be brief.", instruction="Answer as <answer>N</answer>."), Path("."))
    assert [m["role"] for m in custom[0]["messages"]] == ["system", "user", "assistant"]
    assert custom[0]["messages"][1]["content"].endswith("\n\nAnswer as <answer>N</answer>.")
    bare = load_records(gym(n=1, instruction=""), Path("."))
    question = reasoning_gym.create_dataset("chain_sum", seed=0, size=1, **ONE_DIGIT_SUMS)[0]["question"]
    assert bare[0]["messages"][0]["content"] == question.rstrip()


def test_seed_decides_the_records_and_every_field_the_cache_key(monkeypatch):
    same = [load_records(gym(seed=3), Path(".")) for _ in range(2)]
    assert same[0] == same[1]
    other = load_records(gym(seed=1000), Path("."))
    assert [r["messages"][0]["content"] for r in other] != [r["messages"][0]["content"] for r in same[0]]

    base = gym()
    keys = {data_key(base, Path(".")), data_key(gym(seed=1), Path(".")), data_key(gym(n=7), Path(".")),
            data_key(gym(answer_format="boxed"), Path(".")), data_key(gym(instruction="Answer."), Path(".")),
            data_key(gym(system_prompt="Hi."), Path(".")),
            data_key(gym(config={**ONE_DIGIT_SUMS, "max_terms": 3}), Path("."))}
    assert len(keys) == 7
    monkeypatch.setattr("stages.data.reasoning_gym.reasoning_gym_version", lambda: "99.0")
    assert data_key(base, Path(".")) not in keys  # an upgrade regenerates the dataset


# ---------------------------------------------------------------- validation

GYM_PIPELINE = """\
name: t
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}
data:
  train: {reasoning_gym: chain_sum, config: &sums {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}, n: 50, role: train, exclude: [heldout]}
  heldout: {reasoning_gym: chain_sum, config: *sums, n: 10, seed: 1000, role: heldout}
  sums: {generator: arithmetic, n: 10, seed: 9, role: heldout}
rewards:
  rg: {fn: reasoning_gym}
reward_checks:
  rg:
    - {case: success, completion: "<answer>-4</answer>", answer: "-4", min: 1.0,
       task: {reasoning_gym: chain_sum, config: *sums, seed: 0, size: 50, index: 0}}
    - {case: malformed, completion: "minus four", max: 0.0, parsed: false,
       task: {reasoning_gym: chain_sum, config: *sums, size: 50, index: 0}}
stages:
  sft: {kind: sft, data: train, max_steps: 2}
  eval_sft: {kind: eval, model: sft, data: heldout, rewards: [rg]}
"""


def test_a_reasoning_gym_pipeline_validates_and_its_reward_checks_pass(tmp_path, home):
    path = write(tmp_path / "p.yaml", GYM_PIPELINE)
    assert run_cli("validate", str(path)) == 0
    assert run_cli("check-reward", str(path)) == 0


@pytest.mark.parametrize("old, new, expected", [
    ("train: {reasoning_gym: chain_sum", "train: {reasoning_gym: chain_sun",
     "p.yaml:4: data.train.reasoning_gym: unknown reasoning-gym task 'chain_sun' (did you mean 'chain_sum'?)"),
    ("&sums {min_terms: 2", "&sums {min_terms: 3",
     "p.yaml:4: data.train.config: reasoning-gym refuses this config for chain_sum: AssertionError: "
     "max_terms must be >= min_terms"),
    ("&sums {min_terms: 2", "&sums {min_term: 2",
     "p.yaml:4: data.train.config: reasoning-gym refuses this config for chain_sum: TypeError: "
     "ChainSumConfig.__init__() got an unexpected keyword argument 'min_term'; its config keys: min_terms, "),
    ("&sums {min_terms: 2", "&sums {seed: 1, min_terms: 2",
     "p.yaml:4: data.train.config: config may not set seed: they are the dataset's own `seed:` and `n:`"),
    ("data: heldout, rewards: [rg]", "data: sums, rewards: [rg]",
     "p.yaml:17: stages.eval_sft.rewards.0: reward 'rg' (fn reasoning_gym) scores reasoning_gym datasets only, "
     "and dataset 'sums' is not one"),
    ("seed: 0, size: 50, index: 0}", "seed: 0, index: 0}",
     "p.yaml:12: reward_checks.rg.0.task: task {'reasoning_gym': 'chain_sum', 'config': {'min_terms': 2, "
     "'max_terms': 2, 'min_digits': 1, 'max_digits': 1}, 'seed': 0, 'index': 0}: missing size"),
    ("parsed: false,\n       task: {reasoning_gym: chain_sum, config: *sums, size: 50, index: 0}}", "parsed: false}",
     "p.yaml:13: reward_checks.rg.1: a reasoning_gym reward's case needs `task:`"),
    ("n: 10, seed: 1000, role: heldout", "n: 10, seed: 45, role: heldout",
     "p.yaml:5: data.heldout.seed: heldout dataset 'heldout' shares entries with train dataset 'train' (same task "
     "and config; reasoning-gym draws entry i from seed + i, so seeds 45..54 and 0..49 overlap): leakage guard; "
     "e.g. seed: 50"),
])
def test_bad_reasoning_gym_pipelines_exit_2_naming_the_yaml_path(tmp_path, home, capsys, old, new, expected):
    assert GYM_PIPELINE.count(old) == 1, old
    path = write(tmp_path / "p.yaml", GYM_PIPELINE.replace(old, new))
    assert run_cli("validate", str(path)) == 2
    assert expected in capsys.readouterr().err


def test_without_reasoning_gym_installed_validation_says_how_to_install(tmp_path, home, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    assert run_cli("validate", str(write(tmp_path / "p.yaml", GYM_PIPELINE))) == 2
    err = capsys.readouterr().err
    assert "data.train.reasoning_gym: reasoning-gym is not installed" in err and "pip install reasoning-gym" in err


# ---------------------------------------------------------------- an eval stage end to end


def test_eval_stage_scores_a_reasoning_gym_dataset(tiny_checkpoint, ctx_factory, home):
    from stages import eval as eval_stage
    from stages.eval import EvalConfig

    spec = gym(n=6, seed=1000)
    data_path = materialize(spec, Path("."), home / "cache")
    config = EvalConfig(kind="eval", model="base", data="heldout", rewards=["rg"],
                        sampling={"temperature": 1.0, "max_tokens": 4, "attempts": 2, "seed": 1})
    ctx = ctx_factory("eval-gym")
    inputs = StageInputs(model=tiny_checkpoint, datasets={"data": data_path}, rewards=REWARD)
    outputs = eval_stage.run(config, inputs, ctx)
    ctx.flush()
    logged = ctx.recorded_run().data.metrics
    assert {"pass_at_1", "pass_at_2", "reward/rg/mean", "format_error_rate"} <= set(logged)
    assert logged["reward/rg/errors"] == 0.0
    assert logged["format_error_rate"] == 1.0  # an untrained tiny model writes no <answer> tags

    # every prompt failed: the failure set keeps each entry's task, and a later sft round demonstrates its format
    records = read_materialized(data_path)
    failures = [json.loads(line) for line in Path(outputs["failures"]).read_text().splitlines()]
    assert [f["task"] for f in failures] == [r["task"] for r in records]
    assert [r["messages"][-1]["content"] for r in failure_training_records(failures, demonstrations=True)] == \
        [f"<answer>{r['answer']}</answer>" for r in records]

    # the right answers, scored as the stage scores its attempts, pass every prompt
    right = score(records, [r["messages"][-1]["content"] for r in records])
    assert sum(s >= config.success_threshold for s in right.scores) / len(records) == 1.0


CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def test_an_imperfect_demonstrator_shows_wrong_answers_but_keeps_the_reference():
    spec = ReasoningGymData(reasoning_gym="chain_sum", config=CHAIN, n=400, seed=0, role="train", demo_error_rate=0.4)
    records = load_records(spec, Path("."))
    shown = [r["messages"][-1]["content"] for r in records]
    wrong = [s != demonstration(r["answer"], "answer_tags") for s, r in zip(shown, records)]
    assert 0.3 < sum(wrong) / len(records) < 0.5
    for s, r, w in zip(shown, records, wrong):
        if w:  # a slipped digit: off by 1 or 10, in the answer's own format
            value = int(s.removeprefix("<answer>").removesuffix("</answer>"))
            assert abs(value - int(r["answer"])) in (1, 10)
    clean = load_records(spec.model_copy(update={"demo_error_rate": 0.0}), Path("."))
    assert [r["answer"] for r in clean] == [r["answer"] for r in records]  # references never change


def test_exclude_drops_every_prompt_of_the_named_dataset_and_keys_the_cache(tmp_path):
    from stages.data.sources import prompt_text

    train = ReasoningGymData(reasoning_gym="chain_sum", config=CHAIN, n=600, seed=0, role="train", exclude=["heldout"])
    heldout = ReasoningGymData(reasoning_gym="chain_sum", config=CHAIN, n=200, seed=1_000_000, role="heldout")
    plain = load_records(train, Path("."))
    held = {prompt_text(r) for r in load_records(heldout, Path("."))}
    assert sum(prompt_text(r) in held for r in plain) > 0  # this small space does collide
    path = materialize(train, Path("."), tmp_path, {"heldout": heldout})
    kept = read_materialized(path)
    assert kept and not any(prompt_text(r) in held for r in kept)
    assert len(kept) == sum(prompt_text(r) not in held for r in plain)
    other = materialize(train, Path("."), tmp_path, {"heldout": heldout.model_copy(update={"seed": 7})})
    assert other != path  # what is excluded is part of the content key


def test_exclude_names_a_dataset(tmp_path, home, capsys):
    text = (Path(__file__).resolve().parents[1] / "pipelines" / "smollm2-reasoning.yaml").read_text(encoding="utf-8")
    bad = text.replace("exclude: [heldout]", "exclude: [heldot]")
    assert bad != text
    assert run_cli("validate", str(write(tmp_path / "p.yaml", bad))) == 2
    err = capsys.readouterr().err
    assert "data.train.exclude.0" in err and "did you mean 'heldout'" in err


def test_a_training_set_that_asks_heldout_questions_is_refused_by_content(tmp_path, home, capsys):
    """Disjoint seed ranges are not enough when the question space is small: the guard compares text."""
    text = (Path(__file__).resolve().parents[1] / "pipelines" / "smollm2-reasoning.yaml").read_text(encoding="utf-8")
    leaky = text.replace("    exclude: [heldout]\n", "")
    assert leaky != text
    assert run_cli("validate", str(write(tmp_path / "p.yaml", leaky))) == 2
    err = capsys.readouterr().err
    assert "data.train.exclude" in err and "add `exclude: [heldout]`" in err
    assert not (home / "mlflow.db").exists()
