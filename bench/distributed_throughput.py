"""A dpo stage on 2 processes (gloo, torchrun) against 1 process, on this machine.

    python bench/distributed_throughput.py [--steps 30] [--batch 32] [--rounds 2] [--hidden 128]

Both sides are the real stage through ``flows.execute.execute`` (what ``posttrain run``
does for one stage, without Prefect): a fresh MLflow child run, ``resources: {processes:
N}``, the same global batch of ``--batch`` preference pairs per optimizer step, the same
steps. 2 processes are torchrun's, each on 1 thread (torchrun sets ``OMP_NUM_THREADS=1``);
1 process runs in this process on ``--threads`` threads, 1 by default. With 2 threads the
1-process side measured 3-15 pairs/s against 50-69 for 2 processes under a load average of
13-20: two spinning OpenMP threads on a busy 2-core box (tests/test_ppo.py saw the same),
not data parallelism; 1 thread per process on both sides compares like with like.

Two figures per run, both from the run itself:
- ``train``: pairs per second inside the trainer loop (the stage's ``train_seconds``
  metric: optimizer steps only, no process start, no model load);
- ``stage``: pairs per second over the whole stage as the user waits for it (launching the
  ranks, importing torch/transformers/TRL in each, loading policy and reference, training,
  saving, publishing).

The sides alternate (1 2, 2 1, ...); the load average is printed before and after, since
other jobs share the cores. Last line: ``dpo_2proc_vs_1proc_train_throughput_ratio``, the
median over rounds of 2-process train pairs/s over 1-process train pairs/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

PIPELINE = """\
name: bench-dist
model: {{init: tiny, hidden_size: {hidden}, num_layers: 2, num_heads: 4, intermediate_size: {ffn}}}
data:
  prefs: {{generator: arithmetic_preferences, n: {pairs}, role: train}}
stages:
  dpo: {{kind: dpo, model: base, data: prefs, max_steps: {steps}, batch_size: {batch}, heldout_fraction: 0.0,
        logging_steps: {steps}}}
"""


def run_stage(loaded, tracker, experiment: str, parent: str, processes: int) -> tuple[float, float]:
    """(train pairs/s, whole-stage pairs/s) of one execution of the dpo stage on ``processes``."""
    from dataclasses import replace

    from flows.execution.execute import execute
    from flows.planning.job import StageJob
    from stages.context import Resources

    config = loaded.spec.stages["dpo"]
    job = StageJob(pipeline=loaded.spec, pipeline_file=loaded.path, overrides=(), stage="dpo", seed=0,
                   resources=Resources(processes=processes), time_limit_seconds=None, experiment_id=experiment,
                   parent_run_id=parent, may_reuse=False, upstream_outputs={},
                   fingerprint=f"bench-{time.time_ns()}")
    job = replace(job, extra_tags={"bench.processes": str(processes)})
    started = time.perf_counter()
    row = execute(job, tracker)
    wall = time.perf_counter() - started
    run = tracker.get_run(row.run_id)
    assert run.data.params["world_size"] == str(processes), run.data.params["world_size"]
    pairs = config.max_steps * config.batch_size
    return pairs / run.data.metrics["train_seconds"], pairs / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the 1-process side")
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # the ranks inherit it
    home = _common.isolated_home()
    import torch

    from flows.spec.loading import load_pipeline
    from flows.recording.tracking import Tracker

    torch.set_num_threads(args.threads)
    path = Path(tempfile.mkdtemp()) / "bench-dist.yaml"
    path.write_text(PIPELINE.format(hidden=args.hidden, ffn=4 * args.hidden, steps=args.steps, batch=args.batch,
                                    pairs=max(args.steps * args.batch, 64)))
    loaded = load_pipeline(path)
    tracker = Tracker(home)
    experiment = tracker.experiment_id("bench-dist", None)
    parent = tracker.start_pipeline_run(experiment, "bench-dist", {})
    print(f"load average before: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores; dpo, "
          f"{args.steps} steps x {args.batch} pairs, tiny model hidden {args.hidden}, 2 layers; 1 process on "
          f"{args.threads} thread(s), 2 processes on 1 each", flush=True)
    run_stage(loaded, tracker, experiment, parent, 1)  # warm-up: data and base checkpoint cached
    results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for round_ in range(args.rounds):
        for processes in ((1, 2) if round_ % 2 == 0 else (2, 1)):
            results[processes].append(run_stage(loaded, tracker, experiment, parent, processes))
            train, stage = results[processes][-1]
            print(f"  round {round_ + 1}: {processes} process(es): train {train:.1f} pairs/s, "
                  f"stage {stage:.1f} pairs/s", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f} (1 min)")
    for index, name in ((0, "train"), (1, "stage")):
        ratios = [two[index] / one[index] for one, two in zip(results[1], results[2])]
        print(f"{name}: 1 process {statistics.median(r[index] for r in results[1]):.1f} pairs/s, "
              f"2 processes {statistics.median(r[index] for r in results[2]):.1f} pairs/s, "
              f"ratio {statistics.median(ratios):.2f}")
    train_ratios = [two[0] / one[0] for one, two in zip(results[1], results[2])]
    print(f"dpo_2proc_vs_1proc_train_throughput_ratio {statistics.median(train_ratios):.3f}")


if __name__ == "__main__":
    main()
