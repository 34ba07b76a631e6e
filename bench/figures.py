"""The README's two pictures, drawn from a home that holds the quickstart's sweep over seeds.

    POSTTRAIN_HOME=/tmp/res-quickstart posttrain sweep pipelines/quickstart.yaml --seeds 0 1 2
    python bench/figures.py /tmp/res-quickstart [--out docs/img]

``quickstart-learning.png``: GRPO's training reward over its steps for each seed (the fraction of
sampled replies the verifier accepts, a 10-step running mean over the raw steps), and beside it the
held-out pass@1 of the untrained model, SFT and GRPO per seed with 95% intervals over prompts.
``quickstart-compare.png``: ``posttrain compare``'s chart of the same home (flows/compare.py
``save_chart``): every evaluated checkpoint with its 95% error bar over prompts, and each eval stage's
mean over seeds with its 95% t interval.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flows.recording.tags import TAG_SEED, TAG_STAGE, TAG_VARIANT  # noqa: E402

REWARD = "reward/correct/mean"  # the quickstart's only reward, `correct`, per GRPO step
EVALS = ("eval_base", "eval_sft", "eval_grpo")
COLOURS = ("#1c7ed6", "#e8590c", "#2b8a3e", "#ae3ec9")


def client_of(home: Path):
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home}/mlflow.db"
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("quickstart")
    if experiment is None:
        raise SystemExit(f"{home}: no quickstart experiment; run the quickstart's sweep in it first")
    return client, experiment.experiment_id


def finished(client, experiment_id: str, stage: str) -> dict[str, object]:
    """seed -> the newest finished run of ``stage`` outside any grid variant."""
    runs = client.search_runs([experiment_id], f"tags.`{TAG_STAGE}` = '{stage}' and attributes.status = "
                              "'FINISHED'", order_by=["attributes.start_time ASC"], max_results=1000)
    return {r.data.tags.get(TAG_SEED, "-"): r for r in runs if r.data.tags.get(TAG_VARIANT, "-") == "-"}


def running_mean(values: list[float], width: int = 10) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
            for i in range(len(values))]


def learning_figure(client, experiment_id: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stages.intervals import Z_95

    figure, (curve, evals) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    grpo = finished(client, experiment_id, "grpo")
    for colour, (seed, run) in zip(COLOURS, sorted(grpo.items())):
        history = sorted(client.get_metric_history(run.info.run_id, REWARD), key=lambda m: m.step)
        steps, values = [m.step for m in history], [m.value for m in history]
        curve.plot(steps, values, color=colour, alpha=0.18, linewidth=0.8)
        curve.plot(steps, running_mean(values), color=colour, linewidth=1.8, label=f"seed {seed}")
    curve.set_xlabel("GRPO step")
    curve.set_ylabel("replies the verifier accepts")
    curve.set_ylim(0, 1)
    curve.set_title("GRPO's training reward (10-step running mean)", fontsize=10)
    curve.legend(loc="lower right", fontsize=8)
    width = 0.8 / max(1, len(grpo))
    for i, (colour, seed) in enumerate(zip(COLOURS, sorted(grpo))):
        runs = [finished(client, experiment_id, stage).get(seed) for stage in EVALS]
        values = [r.data.metrics.get("pass_at_1", 0.0) if r else 0.0 for r in runs]
        errors = [Z_95 * r.data.metrics.get("se/pass_at_1", 0.0) if r else 0.0 for r in runs]
        xs = [x + (i - (len(grpo) - 1) / 2) * width for x in range(len(EVALS))]
        evals.bar(xs, values, width, yerr=errors, capsize=2, color=colour, label=f"seed {seed}")
    evals.set_xticks(range(len(EVALS)), ["untrained", "SFT", "GRPO"])
    evals.set_ylim(0, 1)
    evals.set_ylabel("held-out pass@1")
    evals.set_title("held-out pass@1, 95% interval over prompts", fontsize=10)
    figure.suptitle("pipelines/quickstart.yaml: imitation of a 35%-wrong demonstrator, then GRPO on a verifier")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def compare_figure(client, experiment_id: str, path: Path) -> Path:
    from flows.compare import add_intervals, evaluated_checkpoints, group_by_settings, save_chart

    rows = [r for r in evaluated_checkpoints(client, experiment_id, register_missing=False) if r.variant == "-"]
    groups = group_by_settings(rows, "pass_at_1")
    for group in groups:
        add_intervals(client, group, "pass_at_1")
    return save_chart(groups, "pass_at_1", path, "posttrain compare pipelines/quickstart.yaml (3 seeds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("home", type=Path, help="a POSTTRAIN_HOME holding the quickstart's sweep")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    client, experiment_id = client_of(args.home.resolve())
    for path in (learning_figure(client, experiment_id, args.out / "quickstart-learning.png"),
                 compare_figure(client, experiment_id, args.out / "quickstart-compare.png")):
        print(f"{path} ({path.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
