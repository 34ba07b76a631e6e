"""Are two runs of one pipeline the same run? Compares, stage by stage, every metric's whole history (each logged
step and its value, exactly) between two posttrain homes: what "no change of behaviour" means for a refactor.

    python bench/same_histories.py /tmp/before /tmp/after --pipeline quickstart --seed 0

Each home holds the pipeline run (``posttrain run`` or ``posttrain sweep``) with that seed; where a stage has several
finished runs of the seed, the newest is taken. Timing metrics (wall time, throughput, memory) differ between any
two runs and are left out. Exit status 0 when every compared history is equal, 1 when one differs, 2 when a stage
is missing from one home.
"""

from __future__ import annotations

import argparse
import re
import sys

TIMING = re.compile(r"(seconds|_s$|/s$|per_s|per_second|time|runtime|elapsed|wall|throughput|memory|_mb$|_gb$|rss)",
                    re.IGNORECASE)


def finished_runs(home: str, pipeline: str, seed: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiment = client.get_experiment_by_name(pipeline)
    if experiment is None:
        raise SystemExit(f"{home}: no pipeline {pipeline!r} in its store")
    runs = client.search_runs([experiment.experiment_id], f"tags.`posttrain.seed` = '{seed}' and "
                              "attributes.status = 'FINISHED' and tags.`posttrain.role` != 'pipeline'",
                              order_by=["attributes.start_time DESC"])
    newest: dict = {}
    for run in runs:
        stage = run.data.tags.get("posttrain.stage")
        if stage and stage not in newest:
            newest[stage] = run
    return {stage: (client, run) for stage, run in newest.items()}


def history(client, run, key: str) -> list[tuple[int, float]]:
    """The metric's distinct (step, value) points: a value logged twice at one step is one point, since MLflow's
    store keeps both only when they were logged in different milliseconds (the trainer's last step and its
    closing summary both carry ``epoch``)."""
    return sorted({(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--seed", default="0")
    args = parser.parse_args(argv)
    before, after = (finished_runs(h, args.pipeline, args.seed) for h in (args.before, args.after))
    if set(before) != set(after):
        print(f"stages differ: only before {sorted(set(before) - set(after))}, "
              f"only after {sorted(set(after) - set(before))}")
        return 2
    differ = 0
    for stage in sorted(before):
        (client_a, run_a), (client_b, run_b) = before[stage], after[stage]
        keys = sorted(k for k in set(run_a.data.metrics) | set(run_b.data.metrics) if not TIMING.search(k))
        steps, unequal = 0, []
        for key in keys:
            a, b = history(client_a, run_a, key), history(client_b, run_b, key)
            steps += len(a)
            if a != b:
                first = next((x, y) for x, y in zip(a + [None] * len(b), b + [None] * len(a)) if x != y)
                unequal.append(f"{key} (first difference {first[0]} vs {first[1]})")
        differ += bool(unequal)
        print(f"{stage}: {len(keys)} metrics, {steps} logged values, "
              + ("equal" if not unequal else "DIFFER: " + "; ".join(unequal[:5])))
    print(f"{len(before)} stages, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
