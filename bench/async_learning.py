"""What drawing rollouts ahead does to learning: smollm2-reasoning's whole pipeline with its GRPO stage colocated
(in-process vLLM, synchronous) and on a generation server at ``max_staleness`` 0, 1 and 2, one seed.

    python bench/async_learning.py                  # seed 0, the four layouts, ~70 min on this CPU
    python bench/async_learning.py --layouts colocated server-1 --seed 1

Every layout runs without dynamic sampling (its extra prompts depend on the step being trained, so it is refused
with ``max_staleness`` > 0), the colocated baseline too, so the four differ in where and when rollouts are drawn
only. They run one after the other through the real CLI in one fresh home: the base evaluation and SFT run once
and are reused from the cache; each layout's GRPO stage and its evaluation (the pipeline's fixed settings, 200
heldout prompts) run anew.

Printed per layout: ``eval_grpo`` pass@1 and pass@4 and their difference from the colocated run, ``eval_sft`` pass@1
(the starting point: equal across homes on one seed and install), the GRPO stage's seconds (start to end of its
MLflow run) and without the server's start-up, the colocated stage's seconds over it (> 1: faster), and means over
the steps of the reward, the completion length in tokens, the staleness, the trainer's wait for rollouts, the
weight sync to the server and the sampler/trainer mismatch (|delta log p| per token).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import print_summary  # noqa: E402
from bench.results import run_pipeline, stage_runs  # noqa: E402

LAYOUTS = {"colocated": [], "server-0": ["stages.grpo.generation.mode=server"],
           "server-1": ["stages.grpo.generation.mode=server", "stages.grpo.generation.max_staleness=1"],
           "server-2": ["stages.grpo.generation.mode=server", "stages.grpo.generation.max_staleness=2"],
           "server-0-merged": ["stages.grpo.generation.mode=server", "stages.grpo.generation.lora_weights=merged"]}
HISTORIES = ("reward/mean", "completion/mean_tokens", "ahead/staleness_mean", "ahead/wait_seconds", "ahead/sync_seconds",
             "correction/logp_diff_abs_mean")


def layout_overrides(seed: int, layout: str) -> list[str]:
    """The pipeline overrides that run smollm2-reasoning's GRPO stage in ``layout`` on ``seed``."""
    return [f"seed={seed}", "stages.grpo.dynamic_sampling=null", *LAYOUTS[layout]]


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def newest(runs: list, stage: str):
    return [run for run in runs if run.data.tags["posttrain.stage"] == stage][-1]


def layout_figures(home: str, pipeline_seconds: float) -> dict:
    """The figures of the layout that ran last in ``home``: its GRPO stage and that stage's evaluation."""
    from mlflow.tracking import MlflowClient

    runs = stage_runs(home)
    grpo, evaluation = newest(runs, "grpo"), newest(runs, "eval_grpo")
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    history = {name: [p.value for p in client.get_metric_history(grpo.info.run_id, name)] for name in HISTORIES}
    seconds = (grpo.info.end_time - grpo.info.start_time) / 1000
    startup = grpo.data.metrics.get("generation_server_startup_seconds", 0.0)
    figures = {name: round(value, 3) for name, value in evaluation.data.metrics.items() if name.startswith("pass_at")}
    # the starting point, so that layouts run in different homes can be checked to start from the same SFT model
    figures["sft_pass_at_1"] = round(newest(runs, "eval_sft").data.metrics["pass_at_1"], 3)
    figures.update({"grpo_stage_seconds": round(seconds, 1), "without_startup": round(seconds - startup, 1),
                    "server_startup_seconds": round(startup, 1), "pipeline_seconds": round(pipeline_seconds, 1),
                    "steps": len(history["reward/mean"]), "reward_mean": mean(history["reward/mean"]),
                    "completion_tokens_mean": mean(history["completion/mean_tokens"]),
                    "staleness_mean": mean(history["ahead/staleness_mean"]),
                    "wait_seconds_per_step": mean(history["ahead/wait_seconds"]),
                    "sync_seconds_per_step": mean(history["ahead/sync_seconds"]),
                    "logp_diff_abs_mean": mean(history["correction/logp_diff_abs_mean"])})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    home = tempfile.mkdtemp(prefix="posttrain-async-learning-")
    results = {}
    try:
        for layout in args.layouts:
            overrides = layout_overrides(args.seed, layout)
            results[layout] = layout_figures(home, run_pipeline("smollm2-reasoning.yaml", overrides, home))
            print(layout, results[layout], flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    base = results.get("colocated")
    for layout, row in results.items():
        if base and layout != "colocated":
            row["pass_at_1_vs_colocated"] = round(row["pass_at_1"] - base["pass_at_1"], 3)
            row["speed_vs_colocated"] = round(base["grpo_stage_seconds"] / row["grpo_stage_seconds"], 2)
            row["speed_vs_colocated_without_startup"] = round(base["without_startup"] / row["without_startup"], 2)
    print_summary(results, args.out)


if __name__ == "__main__":
    main()
