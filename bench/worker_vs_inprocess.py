"""A pipeline run through Prefect workers vs the same run in-process, against the same
real servers (an `mlflow server` and a `prefect server`, on loopback).

In-process: `posttrain run FILE --no-cache` with PREFECT_API_URL set (the orchestrator and
every stage in this one process, no worker). Through workers: `posttrain deploy FILE --pool cpu`, then
`prefect deployment run --watch`: a cpu process worker runs the orchestrating flow and the
stage marked `resources: {pool: gpu}` is sent to the gpu process worker. The two are
alternated (in-process, workers, in-process, workers, ...) after one untimed warm-up of
each, and the median of the per-round ratios is printed last.

    python bench/worker_vs_inprocess.py [PIPELINE] [--rounds 2] [--worker-query-seconds 10]

Default pipeline: the quickstart with its sft stage sent to the gpu pool.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from servers import MlflowServer, PrefectServer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", nargs="?", default=str(ROOT / "pipelines" / "quickstart.yaml"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker-query-seconds", type=int, default=10,
                        help="PREFECT_WORKER_QUERY_SECONDS of the workers (Prefect's default: 10)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="posttrain-bench-workers-"))
    mlflow, prefect = MlflowServer(root / "mlflow"), PrefectServer(root / "prefect")
    overrides = ["--set", "stages.sft.resources.pool=gpu"]
    try:
        mlflow.start()
        prefect.start()
        env = {**prefect.env, "POSTTRAIN_HOME": str(root / "home"), "MLFLOW_TRACKING_URI": mlflow.url,
               "PYTHONPATH": str(ROOT), "PREFECT_WORKER_QUERY_SECONDS": str(args.worker_query_seconds)}
        for pool in ("cpu", "gpu"):
            prefect.cli("work-pool", "create", pool, "--type", "process")
            prefect.worker(pool, env)

        def posttrain(*argv: str) -> None:
            subprocess.run([sys.executable, "-m", "flows.cli", *argv], env=env, cwd=root, check=True,
                           capture_output=True, text=True)

        posttrain("deploy", args.pipeline, *overrides, "--pool", "cpu", "--name", "bench")
        deployment = "posttrain-pipeline/bench"

        def in_process() -> float:
            started = time.perf_counter()
            posttrain("run", args.pipeline, "--no-cache")  # every stage here, no worker involved
            return time.perf_counter() - started

        def through_workers() -> float:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", deployment, "--param",
                            "no_cache=true", "--watch", "--watch-timeout", "1800"], env=env, check=True,
                           capture_output=True, text=True)
            return time.perf_counter() - started

        in_process(), through_workers()  # warm-up: imports, caches, deployment of posttrain-stage/gpu
        ratios, local, remote = [], [], []
        for _ in range(args.rounds):
            a, b = in_process(), through_workers()
            local.append(a)
            remote.append(b)
            ratios.append(b / a)
            print(f"round: in-process {a:.1f} s, through workers {b:.1f} s, ratio {b / a:.2f}", flush=True)
        print(f"in-process median {statistics.median(local):.1f} s; through workers median "
              f"{statistics.median(remote):.1f} s (worker query interval {args.worker_query_seconds} s)")
        print(f"through workers / in-process: {statistics.median(ratios):.2f}x")
    finally:
        prefect.stop()
        mlflow.stop()


if __name__ == "__main__":
    main()
