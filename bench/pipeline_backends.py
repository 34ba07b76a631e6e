"""A pipeline end to end with its default generation backends, then with HF generate everywhere,
one after the other on this machine, each in a fresh POSTTRAIN_HOME (nothing cached).

    python bench/pipeline_backends.py [PIPELINE] [--seed 0] [--only-hf]

Every eval and rl stage is sent to HF generate with ``--set stages.NAME.backend=hf`` for the
second run; everything else is the file's own. Prints each run's wall time, its stages'
times (as MLflow timed them) and held-out pass_at_1, and last the ratio HF / default.
``--only-hf`` runs the HF half alone (when the default run's time is known already).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generating_stages(pipeline: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from flows.spec.loading import load_pipeline

    spec = load_pipeline(pipeline).spec
    return [name for name, config in spec.stages.items() if hasattr(config, "backend")]


def run(pipeline: Path, seed: int, overrides: list[str]) -> tuple[float, dict[str, tuple[float, float | None]]]:
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, POSTTRAIN_HOME=home)
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [sys.executable, "-m", "flows.cli", "run", str(pipeline), "--set", f"seed={seed}"]
        for item in overrides:
            cmd += ["--set", item]
        started = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        seconds = time.perf_counter() - started
        client = MlflowClient(f"sqlite:///{home}/mlflow.db")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`posttrain.role` = 'stage'")
        stages = {r.data.tags["posttrain.stage"]: ((r.info.end_time - r.info.start_time) / 1000,
                                                   r.data.metrics.get("pass_at_1")) for r in runs}
    return seconds, stages


def report(label: str, seconds: float, stages: dict) -> None:
    print(f"{label}: {seconds:.0f} s  " + "  ".join(
        f"{name} {t:.0f}s" + (f" (pass_at_1 {p:.3f})" if p is not None else "") for name, (t, p) in stages.items()),
        flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline", nargs="?", default=str(ROOT / "pipelines" / "smollm2-reasoning.yaml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-hf", action="store_true")
    args = parser.parse_args()
    pipeline = Path(args.pipeline).resolve()
    to_hf = [f"stages.{name}.backend=hf" for name in generating_stages(pipeline)]
    default = None
    if not args.only_hf:
        default, stages = run(pipeline, args.seed, [])
        report("default backends", default, stages)
    hf, stages = run(pipeline, args.seed, to_hf)
    report("HF generate everywhere", hf, stages)
    if default:
        print(f"HF / default wall time: {hf / default:.2f}x")


if __name__ == "__main__":
    main()
