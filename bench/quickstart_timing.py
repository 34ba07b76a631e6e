"""Wall time of the quickstart through the real CLI: fresh, fully cached, and --only.

    python bench/quickstart_timing.py [PIPELINE]

In a fresh POSTTRAIN_HOME (a temporary dir), one after the other: (1) a fresh `posttrain
run` (it starts posttrain's Prefect API server for that home); its orchestration ratio is
its wall time over the sum of its stage runs' durations as MLflow recorded them (target
<= 1.15); (2) the same command again (every stage cached; target <= 5% of the fresh run);
(3) `--only` on the last eval stage (the server from (1) still up), over that stage's own
duration (target <= 1.2). The server is stopped at the end. The last two lines are the
ratios.
"""

from __future__ import annotations

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


def main() -> None:
    pipeline = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "pipelines" / "quickstart.yaml")
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, POSTTRAIN_HOME=home)
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop("PREFECT_API_URL", None)
        run = [sys.executable, "-m", "flows.cli", "run", pipeline]
        try:
            measure(run, env, home)
        finally:  # the Prefect API server the first run started for this home
            subprocess.run([sys.executable, "-m", "flows.cli", "server", "stop"], env=env, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(run: list[str], env: dict, home: str) -> None:
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
    only = timed(run + ["--only", last_eval], env)
    own = stage_seconds(home, latest_pipeline_run(home))[last_eval]
    print(f"--only {last_eval}: {only:.1f} s wall; the stage itself {own:.1f} s")
    print(f"load average before / after: {load_before} / {os.getloadavg()[0]:.1f} (2 cores)")
    print(f"cached_rerun_vs_fresh_wall_ratio={cached / fresh:.3f} (target <= 0.05)")
    print(f"orchestration_ratio={fresh / sum(stages.values()):.2f} (fresh wall / sum of stages; target <= 1.15)")
    print(f"only_ratio={only / own:.2f} (--only {last_eval} wall / the stage; target <= 1.2)")


if __name__ == "__main__":
    main()
