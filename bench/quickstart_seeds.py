"""Run a pipeline under several seeds and print held-out pass_at_1 per eval stage (and, where the
pipeline has them, best_of_n_accuracy per eval stage and the reward model's held-out pairwise
accuracy).

    python bench/quickstart_seeds.py [PIPELINE] [--seeds 0 1 2] [--set PATH=VALUE ...]

Each seed runs in its own fresh POSTTRAIN_HOME (a temporary dir) through the real CLI,
so nothing is cached between seeds. The last line is the mean gain of the last eval
stage over the one before it (e.g. eval_grpo over eval_sft), in pass_at_1 points.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pipeline", nargs="?", default=str(ROOT / "pipelines" / "quickstart.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient

    results: dict[int, dict[str, float]] = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as home:
            env = dict(os.environ, POSTTRAIN_HOME=home)
            env.pop("MLFLOW_TRACKING_URI", None)
            cmd = [sys.executable, "-m", "flows.cli", "run", args.pipeline, "--set", f"seed={seed}"]
            for item in args.overrides:
                cmd += ["--set", item]
            started = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            seconds = time.perf_counter() - started
            client = MlflowClient(f"sqlite:///{home}/mlflow.db")
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                      "tags.`posttrain.kind` = 'eval'")
            results[seed] = {r.data.tags["posttrain.stage"]: r.data.metrics["pass_at_1"] for r in runs}
            extra = {f"{r.data.tags['posttrain.stage']}.best_of_n": r.data.metrics["best_of_n_accuracy"]
                     for r in runs if "best_of_n_accuracy" in r.data.metrics}
            for run in client.search_runs([e.experiment_id for e in client.search_experiments()],
                                          "tags.`posttrain.kind` = 'reward_model'"):
                extra[f"{run.data.tags['posttrain.stage']}.heldout_acc"] = run.data.metrics["heldout_pairwise_accuracy"]
            print(f"seed {seed}: {seconds:.0f} s  " +
                  "  ".join(f"{k}={v:.3f}" for k, v in sorted({**results[seed], **extra}.items())), flush=True)
    stages = sorted({s for r in results.values() for s in r})
    print("stage       " + "  ".join(f"seed {s}" for s in args.seeds) + "   mean")
    for stage in stages:
        values = [results[s].get(stage, float("nan")) for s in args.seeds]
        print(f"{stage:<11} " + "  ".join(f"{v:6.3f}" for v in values) + f"  {sum(values) / len(values):6.3f}")
    names = [n for n in ("eval_base", "eval_sft", "eval_grpo", "eval_ppo", "eval_dpo") if n in stages]
    if len(names) >= 2:
        before, after = names[-2], names[-1]
        gains = [results[s][after] - results[s][before] for s in args.seeds]
        print(f"{after} - {before} pass_at_1 gain per seed: " + ", ".join(f"{g:+.3f}" for g in gains)
              + f"; mean {sum(gains) / len(gains):+.3f}")


if __name__ == "__main__":
    main()
