"""`posttrain compare`: checkpoints as registered model versions with their eval scores linked,
a ranking within one eval settings hash (never across), and `--promote` moving `champion`.

The verifier is the built-in `regex_format` (the whole reply is a number): a tiny model
trained for a few dozen SFT steps answers with digits, one trained for one step at a
near-zero learning rate still emits noise, so which checkpoint is better is not a coin toss.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli, write

WEAK = """\
name: cmp
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {generator: arithmetic, n: 96, max_operand: 9, role: train}
  heldout: {generator: arithmetic, n: 8, seed: 5, max_operand: 9, role: heldout}
rewards:
  number: {fn: regex_format}
stages:
  weak: {kind: sft, data: train, max_steps: 1, batch_size: 8, lr: 1.0e-7}
  eval_weak: {kind: eval, model: weak, data: heldout, rewards: [number],
              sampling: {temperature: 1.0, max_tokens: 3, attempts: 4, seed: 1}}
"""

STRONG = WEAK + """\
  strong: {kind: sft, model: weak, data: train, max_steps: 60, batch_size: 16, lr: 5.0e-3}
  eval_strong: {kind: eval, model: strong, data: heldout, rewards: [number],
                sampling: {temperature: 1.0, max_tokens: 3, attempts: 4, seed: 1}}
"""

# the same training as `strong` under another name: the same checkpoint, so the same scores: no lead at all
TWIN = STRONG + """\
  twin: {kind: sft, model: weak, data: train, max_steps: 60, batch_size: 16, lr: 5.0e-3}
  eval_twin: {kind: eval, model: twin, data: heldout, rewards: [number],
              sampling: {temperature: 1.0, max_tokens: 3, attempts: 4, seed: 1}}
"""

TWO_SETTINGS = WEAK + """\
  eval_weak_cold: {kind: eval, model: weak, data: heldout, rewards: [number],
                   sampling: {temperature: 0.3, max_tokens: 3, attempts: 4, seed: 1}}
"""


def client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def stage_run(stage: str):
    c = client()
    experiment = c.get_experiment_by_name("cmp")
    return c.search_runs([experiment.experiment_id], f"tags.`posttrain.stage` = '{stage}'",
                         order_by=["attributes.start_time DESC"], max_results=1)[0]


def champion() -> str:
    return str(client().get_model_version_by_alias("cmp", "champion").version)


@pytest.mark.slow
def test_checkpoints_are_registered_ranked_and_promote_moves_champion(home, prefect_server, tmp_path, capsys):
    path = write(tmp_path / "cmp.yaml", WEAK)
    assert run_cli("run", str(path)) == 0

    # the sft checkpoint is version 1 of the pipeline's registered model, its eval scores linked
    weak, eval_weak = stage_run("weak"), stage_run("eval_weak")
    assert weak.data.tags["posttrain.model_version"] == "cmp/1"
    version = client().get_model_version("cmp", "1")
    model = client().get_logged_model(weak.data.tags["posttrain.model_id"])
    assert version.run_id == weak.info.run_id and version.source == f"models:/{model.model_id}"
    assert version.tags["posttrain.checkpoint_uri"].endswith(f"{weak.info.run_id}/artifacts/outputs/checkpoint")
    assert model.source_run_id == weak.info.run_id and model.name == "weak"
    linked = {m.key: m for m in model.metrics}
    assert linked["pass_at_1"].value == eval_weak.data.metrics["pass_at_1"]
    assert linked["pass_at_1"].dataset_digest == eval_weak.data.tags["posttrain.eval_settings"]
    assert model.tags["posttrain.eval_settings"] == eval_weak.data.tags["posttrain.eval_settings"]

    capsys.readouterr()
    assert run_cli("compare", str(path), "--promote") == 0
    out = capsys.readouterr().out
    assert "1 evaluated checkpoint(s) in 1 settings group(s)" in out
    assert "promoted: champion -> cmp version 1 (stage weak" in out and "there was no champion before" in out
    assert champion() == "1"
    chart = home / "compare" / "cmp" / "compare-pass_at_1.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a better checkpoint appears: the ranking puts it first and --promote moves the alias to it
    path = write(tmp_path / "cmp.yaml", STRONG)
    assert run_cli("run", str(path)) == 0
    strong, eval_strong = stage_run("strong"), stage_run("eval_strong")
    assert strong.data.tags["posttrain.model_version"] == "cmp/2"
    assert eval_strong.data.metrics["pass_at_1"] > eval_weak.data.metrics["pass_at_1"] + 0.1, \
        (eval_weak.data.metrics["pass_at_1"], eval_strong.data.metrics["pass_at_1"])
    capsys.readouterr()
    assert run_cli("compare", "--experiment", "cmp", "--promote") == 0
    out = capsys.readouterr().out
    ranked = [line for line in out.splitlines() if re.search(r"│\s+[12]\s+│\s+(weak|strong)\s", line)]
    assert [("strong" in line, "weak" in line) for line in ranked] == [(True, False), (False, True)], out
    assert "promoted: champion -> cmp version 2 (stage strong" in out and "replaced version 1 (stage weak)" in out
    assert "strong leads the champion weak by +" in out and "beyond noise" in out  # a clear lead is accepted
    assert champion() == "2"
    # every score carries its SE over prompts, every other row its paired difference from #1
    assert re.search(r"│\s+0\.\d{3} ± 0\.\d{3}\s+│", out) and "vs #1 (95%)" in out, out
    assert re.search(r"│\s+-0\.\d{3} \[-0\.\d{3}, [-+]0\.\d{3}\]", out), out  # weak's paired difference from #1
    assert "the smallest difference in pass_at_1 this evaluation detects at 80% power is" in out

    # the comparison is logged to MLflow: a compare run with the table and the chart
    c = client()
    experiment = c.get_experiment_by_name("cmp")
    compare_runs = c.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'compare'",
                                 order_by=["attributes.start_time DESC"])
    assert len(compare_runs) == 2 and compare_runs[0].data.tags["posttrain.compare.promoted"] == "cmp/2"
    artifacts = {a.path for a in c.list_artifacts(compare_runs[0].info.run_id)}
    assert {"compare.json", "compare-pass_at_1.png", "compare.txt"} <= artifacts
    local = c.download_artifacts(compare_runs[0].info.run_id, "compare.json", str(tmp_path))
    table = json.loads(Path(local).read_text(encoding="utf-8"))
    assert table["data"][0][table["columns"].index("stage")] == "strong"

    # promoting again changes nothing and says so
    capsys.readouterr()
    assert run_cli("compare", "--experiment", "cmp", "--promote") == 0
    assert "champion unchanged: cmp version 2 already was the best" in capsys.readouterr().out

    # a challenger that leads by nothing (the same checkpoint under another name) is refused, with the interval
    path = write(tmp_path / "cmp.yaml", TWIN)
    assert run_cli("run", str(path)) == 0
    capsys.readouterr()
    assert run_cli("compare", "--experiment", "cmp", "--promote") == 1
    captured = capsys.readouterr()
    assert "--promote refused: twin (cmp/3) leads the champion strong (cmp/2) by +0.000 [+0.000, +0.000]" \
        in captured.err and "within noise" in captured.err and "--force" in captured.err, captured.err
    assert "within noise of #1 twin" in captured.out and "strong" in captured.out
    assert champion() == "2"
    # --force promotes it anyway, and the compare run and the model version record that it was forced
    assert run_cli("compare", "--experiment", "cmp", "--promote", "--force") == 0
    assert "--force: promoting although twin (cmp/3) leads" in capsys.readouterr().out
    assert champion() == "3"
    forced_run = c.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'compare'",
                               order_by=["attributes.start_time DESC"])[0]
    assert "within noise" in forced_run.data.tags["posttrain.compare.forced"]
    assert forced_run.data.tags["posttrain.compare.promoted"] == "cmp/3"
    assert "within noise" in client().get_model_version("cmp", "3").tags["posttrain.compare.forced"]


@pytest.mark.slow
def test_compare_never_ranks_across_eval_settings(home, prefect_server, tmp_path, capsys):
    path = write(tmp_path / "cmp.yaml", TWO_SETTINGS)
    assert run_cli("run", str(path)) == 0
    hot, cold = (stage_run(s).data.tags["posttrain.eval_settings"] for s in ("eval_weak", "eval_weak_cold"))
    assert hot != cold

    capsys.readouterr()
    assert run_cli("compare", str(path)) == 0
    out = capsys.readouterr().out
    assert "2 settings group(s)" in out
    assert "not ranked together: checkpoints evaluated under different settings are not ranked against each other" \
        in out
    assert f"settings {hot}: T=1.0" in out and f"settings {cold}: T=0.3" in out  # each group on its own

    assert run_cli("compare", str(path), "--promote") == 2
    err = capsys.readouterr().err
    assert "--promote refused" in err and hot in err and cold in err and "--settings HASH" in err
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="champion"):  # nothing was promoted
        client().get_model_version_by_alias("cmp", "champion")

    assert run_cli("compare", str(path), "--settings", cold[:6], "--promote") == 0
    out = capsys.readouterr().out
    assert "1 settings group(s)" in out and "promoted: champion -> cmp version 1" in out
    assert champion() == "1"


def test_a_registration_failure_is_recorded_not_raised(home, capsys):
    """A finished stage never fails because its model could not be registered."""
    from flows.recording.home import configure_environment
    from flows.recording.journal import Recorder
    from flows.recording.tracking import Tracker

    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("cmp", None)
    parent = tracker.start_pipeline_run(experiment, "cmp", {})
    run_id = tracker.start_stage_run(experiment, parent, "eval_x", {})
    Recorder(tracker.client, run_id, home).model({"op": "model.link_eval", "checkpoint_run_id": "0" * 32})
    error = tracker.get_run(run_id).data.tags["posttrain.model_error"]
    assert error.startswith("model.link_eval: ") and "0" * 32 in error
    assert "was not recorded in MLflow" in capsys.readouterr().err


def test_registration_waits_in_the_journal_while_the_store_is_unreachable(home):
    """An outage at publication time journals the registration; `posttrain sync` replays it."""
    from flows.recording.home import configure_environment
    from flows.recording.journal import Recorder, pending_runs, replay_pending
    from flows.recording.tracking import Tracker

    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("cmp", None)
    parent = tracker.start_pipeline_run(experiment, "cmp", {})
    run_id = tracker.start_stage_run(experiment, parent, "sft", {"posttrain.kind": "sft"})
    recorder = Recorder(tracker.client, run_id, home)
    recorder.unavailable = "ConnectionError: simulated outage"  # what the first failed write sets
    recorder.model({"op": "model.register", "pipeline": "cmp", "stage": "sft", "kind": "sft", "produces": "policy",
                    "artifact": "outputs/checkpoint"})
    recorder.terminate("FINISHED")
    assert pending_runs(home) == [run_id] and "posttrain.model_version" not in tracker.get_run(run_id).data.tags
    assert "1 model registrations" in recorder.summary()

    assert replay_pending(tracker.client, home) == ([run_id], [])
    run = tracker.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["posttrain.model_version"] == "cmp/1"
    assert tracker.client.get_model_version("cmp", "1").run_id == run_id
