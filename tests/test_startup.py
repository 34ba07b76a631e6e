"""A posttrain program starts up without garbage collection and its stages work with it on (flows/servers/startup.py).

Real processes: the real CLI running a real eval stage, whose judge function (a user's module; a judge runs
in the stage's own process, where other rewards run in the reward worker) reports the collector's state
from inside the stage's work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PIPELINE = """\
name: startup
seed: 1
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}
data:
  heldout: {generator: arithmetic, n: 4, seed: 9, role: heldout}
rewards:
  correct: {fn: exact_answer}
  probe: {fn: judge, judge_fn: "gc_probe:ask", rubric: "{completion}", weight: 0.0}
stages:
  eval: {kind: eval, model: base, data: heldout, rewards: [correct, probe], sampling: {attempts: 2, max_tokens: 4}}
"""

PROBE = """\
import gc, json, os

def ask(conversations):
    with open(os.environ["GC_PROBE_OUT"], "a") as out:
        out.write(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}) + "\\n")
    return ["yes"] * len(conversations)
"""


def test_the_stage_works_with_collection_on_and_start_up_frozen(tmp_path):
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "gc_probe.py").write_text(PROBE)
    probe = tmp_path / "probe.jsonl"
    env = {**os.environ, "POSTTRAIN_HOME": str(tmp_path / "home"), "POSTTRAIN_WARM": "0", "GC_PROBE_OUT": str(probe)}
    for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        env.pop(name, None)
    run = [sys.executable, "-m", "flows.cli", "run", "p.yaml"]
    try:
        done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        seen = [json.loads(line) for line in probe.read_text().splitlines()]
        assert seen and all(s["enabled"] for s in seen), seen  # no stage work with collection off
        assert all(s["frozen"] > 100_000 for s in seen), seen  # start-up's imports kept out of every collection

        again = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0 and "every selected stage is cached" in again.stdout, again.stdout + again.stderr
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "server", "stop"], cwd=tmp_path, env=env,
                       capture_output=True, timeout=60)


def test_start_up_ends_once_and_only_where_it_was_paused():
    script = textwrap.dedent("""
        import gc
        from flows.servers import startup
        startup.end()  # a process that never paused (a program calling posttrain's functions) is left alone
        assert gc.isenabled() and gc.get_freeze_count() == 0
        startup.pause()
        assert not gc.isenabled() and startup.paused()
        startup.end()
        frozen = gc.get_freeze_count()
        assert gc.isenabled() and frozen > 0 and not startup.paused()
        model = {"weights": [0.0] * 1000}
        model["self"] = model  # a stage's garbage, in a cycle
        del model
        startup.pause()  # start-up is over: no second pause, so no second freeze keeps that garbage
        assert gc.isenabled()
        startup.end()
        assert gc.get_freeze_count() == frozen and gc.collect() > 0
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
