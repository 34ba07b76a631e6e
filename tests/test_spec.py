"""The pipeline spec: every class of bad input is refused with its YAML path, before anything runs."""

from __future__ import annotations

import textwrap

import pytest

from conftest import QUICKSTART, run_cli, write
from flows.planning.graph import topological_order
from flows.spec.loading import SpecError, load_pipeline

VALID = """\
name: t
seed: 3
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}
data:
  train: {generator: arithmetic, n: 20, role: train}
  heldout: {generator: arithmetic, n: 10, seed: 9, role: heldout}
rewards:
  correct: {fn: exact_answer}
stages:
  sft: {kind: sft, model: base, data: train, max_steps: 2}
  eval_sft: {kind: eval, model: sft, data: heldout, rewards: [correct]}
"""


def issues_of(tmp_path, text, overrides=()):
    path = write(tmp_path / "p.yaml", textwrap.dedent(text))
    with pytest.raises(SpecError) as caught:
        load_pipeline(path, list(overrides))
    return caught.value.issues


def only_issue(tmp_path, text, overrides=()):
    issues = issues_of(tmp_path, text, overrides)
    assert len(issues) == 1, [i.render("p") for i in issues]
    return issues[0]


def test_valid_pipeline_loads_with_derived_graph(tmp_path):
    loaded = load_pipeline(write(tmp_path / "p.yaml", VALID))
    assert topological_order(loaded.spec) == ["sft", "eval_sft"]
    assert loaded.spec.stages["sft"].lr == 1e-3  # default filled in


def test_quickstart_is_valid_and_prints_graph(capsys):
    assert run_cli("validate", str(QUICKSTART)) == 0
    out = capsys.readouterr().out
    assert "eval_sft (eval) <- model=sft" in out
    assert out.index("sft (sft)") < out.index("eval_sft (eval)")


@pytest.mark.parametrize(
    "old, new, path, fragment",
    [
        ("max_steps: 2}", "max_step: 2}", "stages.sft.max_step", "did you mean 'max_steps'"),
        ("hidden_size: 32", "hiden_size: 32", "model.hiden_size", "did you mean 'hidden_size'"),
        ("name: t", "name: t\nseeed: 1", "seeed", "did you mean 'seed'"),
        ("{kind: sft,", "{kind: sfft,", "stages.sft", "unknown stage kind 'sfft' (did you mean 'sft'?)"),
        ("max_steps: 2}", "max_steps: two}", "stages.sft.max_steps", "valid integer"),
        ("max_steps: 2}", "max_steps: 2, lr: -0.1}", "stages.sft.lr", "must be > 0"),
        ("rewards: [correct]}", "rewards: [correct], sampling: {temperature: -1}}",
         "stages.eval_sft.sampling.temperature", "must be >= 0"),
        ("rewards: [correct]}", "rewards: [correct], sampling: {attempts: 0}}",
         "stages.eval_sft.sampling.attempts", "must be >= 1"),
        ("n: 20,", "n: -5,", "data.train.n", "must be >= 1"),
        ("role: train}", "role: training}", "data.train.role", "'train', 'probe' or 'heldout'"),
        ("model: sft,", "model: sfx,", "stages.eval_sft.model", "unknown stage 'sfx' (did you mean 'sft'?)"),
        ("model: sft,", "model: eval_sft,", "stages.eval_sft.model", "refers to itself"),
        ("data: heldout, rewards", "data: heldot, rewards", "stages.eval_sft.data", "unknown dataset 'heldot'"),
        ("data: train, max", "data: heldout, max", "stages.sft.data", "leakage guard"),
        ("[correct]}", "[corect]}", "stages.eval_sft.rewards.0", "unknown reward 'corect' (did you mean 'correct'?)"),
        ("fn: exact_answer", "fn: no_such_module_xyz:score", "rewards.correct.fn", "cannot import module"),
        ("fn: exact_answer", "fn: math:sqrt", "rewards.correct.fn", "signature"),
        ("{generator: arithmetic, n: 20, role: train}", "{path: missing.jsonl, role: train}",
         "data.train.path", "does not exist"),
        ("{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}", "{path: no/such/dir}",
         "model.path", "does not exist"),
        ("{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}", "{url: x/y}", "model", "exactly one source"),
        ("{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}", "{init: tiny, hidden_size: 30, num_heads: 4}",
         "model", "divisible"),
        ("sft: {kind: sft, model: base,", "base: {kind: sft, model: base,", "stages.base", "reserved"),
    ],
)
def test_bad_spec_is_refused_with_its_path(tmp_path, old, new, path, fragment):
    assert old in VALID
    issues = issues_of(tmp_path, VALID.replace(old, new))
    matching = [i for i in issues if i.path == path]
    assert matching, f"no issue at {path}: {[i.render('p') for i in issues]}"
    assert any(fragment in i.message for i in matching), [i.message for i in matching]


def test_issues_carry_line_numbers(tmp_path):
    issue = only_issue(tmp_path, VALID.replace("max_steps: 2}", "max_steps: 2, lr: -1}"))
    assert issue.line == 10
    assert issue.render("p.yaml").startswith("p.yaml:10: stages.sft.lr: must be > 0")


def test_cycle_is_reported_as_a_path(tmp_path):
    text = VALID + "  a: {kind: sft, model: b, data: train}\n  b: {kind: sft, model: a, data: train}\n"
    issue = only_issue(tmp_path, text)
    assert "dependency cycle: a -> b -> a" in issue.message


def test_eval_stage_has_no_checkpoint_to_train_from(tmp_path):
    text = VALID + "  again: {kind: sft, model: eval_sft, data: train}\n"
    issue = only_issue(tmp_path, text)
    assert issue.path == "stages.again.model" and "produces no checkpoint" in issue.message


def test_all_errors_come_back_at_once(tmp_path):
    text = VALID.replace("max_steps: 2}", "max_step: 2, lr: -1}").replace("[correct]}", "[nope]}")
    text = text.replace("data: train,", "data: heldout,")
    paths = {i.path for i in issues_of(tmp_path, text)}
    assert {"stages.sft.max_step", "stages.sft.lr", "stages.sft.data", "stages.eval_sft.rewards.0"} <= paths


@pytest.mark.parametrize(
    "text, fragment, line",
    [
        ("", "the file is empty", None),
        ("- a\n- b\n", "a pipeline is a mapping", 1),
        ("name: t\nstages: {a: [}\n", "YAML syntax error", 2),
    ],
)
def test_unreadable_documents(tmp_path, text, fragment, line):
    issue = only_issue(tmp_path, text)
    assert fragment in issue.message and issue.line == line


def test_missing_sections_are_named(tmp_path):
    paths = {i.path for i in issues_of(tmp_path, "name: t\n")}
    assert {"model", "data", "stages"} <= paths


def test_overrides_are_type_checked_like_the_file(tmp_path):
    path = write(tmp_path / "p.yaml", VALID)
    loaded = load_pipeline(path, ["stages.sft.max_steps=7", "stages.eval_sft.sampling.attempts=4"])
    assert loaded.spec.stages["sft"].max_steps == 7
    assert loaded.spec.stages["eval_sft"].sampling.attempts == 4
    issue = only_issue(tmp_path, VALID, ["stages.sft.max_steps=lots"])
    assert issue.path == "stages.sft.max_steps" and "(from --set)" in issue.message
    issue = only_issue(tmp_path, VALID, ["stages.sft.max_stepz=3"])
    assert "did you mean 'max_steps'" in issue.message and "(from --set)" in issue.message
    issue = only_issue(tmp_path, VALID, ["seed.x=1"])
    assert "not a mapping" in issue.message


def test_an_override_of_one_stage_leaves_stages_sharing_a_yaml_anchor_alone(tmp_path):
    text = VALID.replace("eval_sft: {kind: eval, model: sft, data: heldout, rewards: [correct]}",
                         "eval_sft: {kind: eval, model: sft, data: heldout, rewards: [correct], sampling: &s {seed: 1}}\n"
                         "  eval_base: {kind: eval, model: base, data: heldout, rewards: [correct], sampling: *s}")
    loaded = load_pipeline(write(tmp_path / "p.yaml", text), ["stages.eval_sft.sampling.seed=5"])
    assert loaded.spec.stages["eval_sft"].sampling.seed == 5
    assert loaded.spec.stages["eval_base"].sampling.seed == 1  # the alias is a copy, not the same object


def test_an_override_indexes_a_list_and_a_bad_index_is_named(tmp_path):
    text = VALID.replace("eval_sft: {kind: eval, model: sft, data: heldout, rewards: [correct]}",
                         "eval_sft: {kind: eval, model: sft, data: heldout, rewards: [correct, correct]}")
    path = write(tmp_path / "p.yaml", text)
    assert load_pipeline(path, ["stages.eval_sft.rewards.1=correct"]).spec.stages["eval_sft"].rewards == \
        ["correct", "correct"]
    issue = only_issue(tmp_path, text, ["stages.eval_sft.rewards.2=correct"])
    assert issue.message == "stages.eval_sft.rewards is a list of 2: index it with 0 to 1, not '2'"
    issue = only_issue(tmp_path, text, ["stages.eval_sft.rewards.first=correct"])
    assert "index it with 0 to 1, not 'first'" in issue.message
    issue = only_issue(tmp_path, text, ["stages.eval_sft.rewards.0.fn=x"])
    assert issue.message == "stages.eval_sft.rewards.0 is not a mapping, cannot set inside it"
