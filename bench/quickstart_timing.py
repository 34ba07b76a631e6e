"""Wall time of the quickstart through the real CLI: fresh, fully cached, and --only, cold and warm.

    python bench/quickstart_timing.py [PIPELINE]

In a fresh POSTTRAIN_HOME (a temporary dir), one after the other:
1. a fresh `posttrain run` (it starts posttrain's Prefect API server for that home). Its
   orchestration ratio is its wall time over the sum of its stage runs' durations as MLflow
   recorded them (target <= 1.15).
2. the same command again: every stage cached (target <= 5% of the fresh run).
3. the last eval stage *alone*, the baseline of --only: a fresh Python process that imports
   what the stage needs, resolves its inputs and runs the stage's own function with a context
   that records nothing (flows.distributed.RankContext), then exits without the interpreter's
   teardown, as `posttrain run` does. That is what the stage costs outside posttrain, the
   libraries it imports included.
4. `--only` on that stage as a person's inner loop runs it: with posttrain's warm process
   (flows/servers/warm.py; POSTTRAIN_WARM=1, started by a first --only and waited for), over (3)
   (target <= 1.2). Also `--only` with warm runs off (POSTTRAIN_WARM=0), over (3), and over
   the stage's own duration in that run (this script's ratio before the warm process).
(3) and (4) alternate three times and report medians. Steps 1-2 run with POSTTRAIN_WARM=0.
5. the fully cached rerun again, three times, through the warm process, as a terminal runs it.
The server and the warm process are stopped at the end. The last lines are the ratios.

The migrated-database templates (flows/servers/db_templates.py) come from $POSTTRAIN_CACHE_DIR, where a
machine's first run unpacks the ones posttrain ships: POSTTRAIN_CACHE_DIR=$(mktemp -d) measures a
machine's first run; POSTTRAIN_CACHE_DIR= (empty) turns templates off, every database migrated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd, env) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - started


def stage_seconds(home: str, pipeline_run_id: str | None = None) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    query = "tags.`posttrain.role` = 'stage'"
    if pipeline_run_id:
        query += f" and tags.`mlflow.parentRunId` = '{pipeline_run_id}'"
    runs = client.search_runs(experiments, query, order_by=["attributes.start_time ASC"])
    return {r.data.tags["posttrain.stage"]: (r.info.end_time - r.info.start_time) / 1000 for r in runs}


def latest_pipeline_run(home: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, "tags.`posttrain.role` = 'pipeline'",
                              order_by=["attributes.start_time DESC"], max_results=1)[0].info.run_id


STAGE_ALONE = """
import json, os, sys
from pathlib import Path
from flows.execution.distributed import RankContext
from flows.execution.execute import resolve_inputs
from flows.spec.loading import load_pipeline
from stages.registry import stage_runner

pipeline, stage, upstream, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
loaded = load_pipeline(pipeline, [])
config = loaded.spec.stages[stage]
inputs = resolve_inputs(loaded, stage, upstream, Path(os.environ["POSTTRAIN_HOME"]))
stage_runner(config.kind)(config, inputs, RankContext(out / "work", out / "resume", loaded.spec.seed, None))
sys.stdout.flush()
os._exit(0)
"""


def upstream_outputs(home: str, pipeline: str, stage: str) -> dict[str, dict[str, str]]:
    """The outputs of the stages ``stage`` reads, from their latest finished runs in the home's store."""
    from flows.planning.graph import BASE, stage_references
    from flows.recording.home import configure_environment
    from flows.spec.loading import load_pipeline
    from flows.recording.tracking import Tracker

    os.environ["POSTTRAIN_HOME"] = home
    configure_environment()
    tracker = Tracker(Path(home))
    spec = load_pipeline(pipeline, []).spec
    outputs = {}
    for target in set(stage_references(spec, stage).values()) - {BASE}:
        run = tracker.client.search_runs(
            [e.experiment_id for e in tracker.client.search_experiments()],
            f"tags.`posttrain.stage` = '{target}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1)[0]
        outputs[target] = tracker.outputs_of(run)
    return outputs


def wait_for_warm_process(home: str, timeout: float = 300.0) -> None:
    socket_path = Path(home) / "warm" / "warm.sock"
    deadline = time.monotonic() + timeout
    while not socket_path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"the warm process did not get ready within {timeout:.0f} s; see {socket_path.parent}/warm.log")
        time.sleep(0.2)


def served(home: str) -> int:
    from flows.servers.warm import read_state

    return read_state(Path(home))["served"]


def main() -> None:
    pipeline = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "pipelines" / "quickstart.yaml")
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, POSTTRAIN_HOME=home, POSTTRAIN_WARM="0")
        for name in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME"):
            env.pop(name, None)
        run = [sys.executable, "-m", "flows.cli", "run", pipeline]
        try:
            measure(run, env, home, pipeline)
        finally:  # the Prefect API server and the warm process the runs started for this home
            subprocess.run([sys.executable, "-m", "flows.cli", "server", "stop"], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(run: list[str], env: dict, home: str, pipeline: str) -> None:
    load_before = f"{os.getloadavg()[0]:.1f}"
    fresh = timed(run, env)
    stages = stage_seconds(home, latest_pipeline_run(home))
    print(f"fresh run: {fresh:.1f} s wall; stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    overhead = fresh - sum(stages.values())
    print(f"orchestration overhead (wall - sum of stage runs): {overhead:.1f} s "
          f"({overhead / fresh:.0%} of the fresh run)")

    cached = timed(run, env)
    print(f"cached rerun: {cached:.1f} s wall")

    last_eval = [s for s in stages if s.startswith("eval")][-1]
    only = run + ["--only", last_eval]
    cold = timed(only, env)
    cold_stage = stage_seconds(home, latest_pipeline_run(home))[last_eval]
    print(f"--only {last_eval}, warm runs off: {cold:.1f} s wall; the stage's run {cold_stage:.1f} s of it")

    upstream = json.dumps(upstream_outputs(home, pipeline, last_eval))
    warm_env = dict(env, POSTTRAIN_WARM="1")
    timed(only, warm_env)  # cold (no warm process yet): starts one as it ends
    wait_for_warm_process(home)
    alone, warm = [], []
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as out:
            alone.append(timed([sys.executable, "-c", STAGE_ALONE, pipeline, last_eval, upstream, out], env))
        before = served(home)
        warm.append(timed(only, warm_env))
        if served(home) != before + 1:
            sys.exit("the warm process did not serve the --only run")
    warm_stage = stage_seconds(home, latest_pipeline_run(home))[last_eval]
    cached_warm = []
    for attempt in range(3):  # the fully cached rerun as a person's terminal runs it
        before = served(home)
        cached_warm.append(timed(run, warm_env))
        if served(home) != before + 1:
            sys.exit("the warm process did not serve the cached rerun")
    print(f"{last_eval} alone (fresh process, no orchestration): " + ", ".join(f"{t:.2f}" for t in alone) + " s")
    print(f"--only {last_eval}, warm process: " + ", ".join(f"{t:.2f}" for t in warm)
          + f" s; the stage's run {warm_stage:.2f} s of the last")
    print(f"load average before / after: {load_before} / {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    print("cached rerun, warm process: " + ", ".join(f"{t:.2f}" for t in cached_warm) + " s")
    print(f"cached_rerun_vs_fresh_wall_ratio={cached / fresh:.3f} (warm runs off; target <= 0.05)")
    print(f"cached_rerun_warm_vs_fresh_wall_ratio={median(cached_warm) / fresh:.3f} (with the warm process; "
          "target <= 0.05)")
    print(f"orchestration_ratio={fresh / sum(stages.values()):.2f} (fresh wall / sum of stages; target <= 1.15)")
    print(f"only_cold_vs_its_stage_run={cold / cold_stage:.2f} (warm runs off, over the stage's run in it)")
    print(f"only_cold_ratio={cold / median(alone):.2f} (warm runs off, over the stage alone)")
    print(f"only_ratio={median(warm) / median(alone):.2f} (--only {last_eval} with the warm process / the stage alone; "
          "target <= 1.2)")


if __name__ == "__main__":
    main()
