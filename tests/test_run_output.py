"""What `posttrain run` prints: a quickstart-like run fits in 40 lines, a failed stage in 10 ending
with its log; other libraries' output lands in the stage's log file (an MLflow artifact), not
on the terminal. Real CLI in a subprocess (real file descriptors), real Prefect server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUICKSTART, ROOT, write
from test_pipeline import FAILING

# The quickstart's five stages at a size that runs in seconds
SMALL = ["--set", "data.train.n=64", "--set", "data.heldout.n=8", "--set", "stages.sft.max_steps=4",
         "--set", "stages.sft.batch_size=8", "--set", "stages.grpo.max_steps=2"]
NOISE = ("Loading weights", "Writing model shards", "Tokenizing", "it/s]", "examples/s", "Warning", "Traceback",
         "INFO", "Error logging to API")


def posttrain(home: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "POSTTRAIN_PREFECT_IDLE_SECONDS": "600",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], env=env, cwd=home.parent, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs of real subprocesses; ~15 min when the 2 cores are shared many ways
def test_a_run_prints_its_plan_stage_lines_and_summary_and_a_failure_ends_with_its_log(tmp_path):
    home = tmp_path / "home"
    try:
        # grpo replies of one token: it alerts at its first step that the token budget cuts them (stages/training/alerts.py)
        budget = ["--set", "stages.grpo.sampling.max_tokens=1", "--set", "stages.grpo.alerts.after_steps=1",
                  "--set", "stages.grpo.alerts.truncated_frac=0.5"]
        done = posttrain(home, "run", str(QUICKSTART), *SMALL, *budget)
        lines = done.stdout.splitlines()
        assert done.returncode == 0, done.stdout
        assert len(lines) <= 40, done.stdout
        table = next(i for i, line in enumerate(lines) if "posttrain · quickstart" in line)
        live = [i for i, line in enumerate(lines) if line.startswith("  grpo: alert step 1: ")]
        assert live and live[0] < table and "token budget (sampling.max_tokens 1)" in lines[live[0]], done.stdout
        assert any(line.startswith("alert grpo: step 1: ") for line in lines[table:]), done.stdout
        assert not [line for line in lines if any(noise in line for noise in NOISE)], done.stdout
        assert lines[0] == "plan for quickstart:" and "posttrain · quickstart" in done.stdout
        for stage in ("eval_base", "sft", "eval_sft", "grpo", "eval_grpo"):
            assert any(line.split()[:2] == [stage, "done"] for line in lines), (stage, done.stdout)
        # what the terminal did not show is in the stages' logs, and on their MLflow runs
        sft_logs = list((home / "logs" / "quickstart").glob("sft-*.log"))
        assert len(sft_logs) == 1 and "Tokenizing train dataset" in sft_logs[0].read_text()
        from mlflow.tracking import MlflowClient

        sft_run = sft_logs[0].stem.split("-", 1)[1]
        client = MlflowClient(f"sqlite:///{home}/mlflow.db")
        assert [a.path for a in client.list_artifacts(sft_run, "logs")] == [f"logs/{sft_logs[0].name}"]

        failing = write(tmp_path / "failing.yaml", FAILING)
        failed = posttrain(home, "run", str(failing))
        lines = failed.stdout.splitlines()
        assert failed.returncode == 1 and len(lines) <= 10, failed.stdout
        assert "Traceback" not in failed.stdout and "Error logging" not in failed.stdout, failed.stdout
        assert "stage eval_base failed: RewardError: reward 'broken' returned 1 scores" in failed.stdout
        log = Path(lines[-1].removeprefix("  log: "))
        assert lines[-1].startswith("  log: ") and log.is_file(), failed.stdout
        assert "Traceback" in log.read_text() and "RewardError" in log.read_text()
    finally:
        posttrain(home, "server", "stop")


def test_a_published_checkpoint_takes_its_disk_space_once_in_the_embedded_store(home):
    """outputs/ and the run's artifacts share the checkpoint's files (hard links), and MLflow lists and serves
    them as the run's artifacts as before."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    from flows.recording.home import artifact_root, configure_environment
    from flows.recording.journal import Recorder
    from flows.recording.tracking import Tracker

    configure_environment()
    tracker = Tracker(home)
    run_id = tracker.client.create_run(tracker.experiment_id("once", artifact_root(home))).info.run_id
    staged = home / "work" / run_id / "staging" / "checkpoint"
    (staged / "sub").mkdir(parents=True)
    weights = os.urandom(1 << 20)
    (staged / "model.safetensors").write_bytes(weights)
    (staged / "sub" / "config.json").write_text("{}")
    published = tracker.publish_outputs(Recorder(tracker.client, run_id, home), "once", "sft",
                                        {"checkpoint": str(staged)})

    checkpoint = Path(published["checkpoint"])
    assert checkpoint.parent == home / "outputs" / "once" / "sft" / run_id
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FINISHED"
    logged = Path(local_file_uri_to_path(run.info.artifact_uri)) / "outputs" / "checkpoint"
    for name in ("model.safetensors", "sub/config.json"):
        assert os.stat(logged / name).st_ino == os.stat(checkpoint / name).st_ino  # one file, two names
    assert {a.path for a in tracker.client.list_artifacts(run_id, "outputs/checkpoint")} == {
        "outputs/checkpoint/model.safetensors", "outputs/checkpoint/sub"}
    served = tracker.client.download_artifacts(run_id, "outputs/checkpoint/model.safetensors", str(home / "dl"))
    assert Path(served).read_bytes() == weights
