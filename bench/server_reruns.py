"""Does a layout's GRPO stage rerun the same? smollm2-reasoning on one seed in one fresh home: the stages before
GRPO first, each in a ``posttrain run --only`` of its own (so no in-process engine runs before GRPO in its
process, as for every later layout of bench/async_learning.py), then the pipeline twice, the second time with
``--force grpo``; then each ``--also`` layout once in the same home (its GRPO stage and evaluation only: the
stages before are cached).

    python bench/server_reruns.py                        # the synchronous server, seed 0, ~40 min on this CPU
    python bench/server_reruns.py --layout server-1 --also server-2   # ~75 min
    python bench/server_reruns.py --layout server-1 --seed 3

Printed per run: bench/async_learning.py's figures; then, per logged metric of the GRPO stage, the first step at
which the two runs differ and at how many steps they do (none: the reruns trained alike).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import print_summary  # noqa: E402
from bench.async_learning import LAYOUTS, layout_figures, layout_overrides  # noqa: E402
from bench.results import run_pipeline, stage_runs  # noqa: E402

PIPELINE = "smollm2-reasoning.yaml"
METRICS = ("loss", "grad_norm", "reward/mean", "completion/mean_tokens", "correction/logp_diff_abs_mean")


def differences(home: str) -> dict:
    """Per metric of the last two GRPO runs in ``home``: the first step they differ at and how many do."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    first, second = [run for run in stage_runs(home) if run.data.tags["posttrain.stage"] == "grpo"][-2:]
    found = {}
    for name in METRICS:
        a, b = ({p.step: p.value for p in client.get_metric_history(run.info.run_id, name)} for run in (first, second))
        differ = [step for step in sorted(a.keys() | b.keys()) if a.get(step) != b.get(step)]
        found[name] = {"steps": len(a), "first_differing_step": differ[0] if differ else None,
                       "differing_steps": len(differ)}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="server-0", choices=list(LAYOUTS))
    parser.add_argument("--also", nargs="*", default=[], choices=list(LAYOUTS),
                        help="layouts run once each after the two runs, in the same home")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    overrides = layout_overrides(args.seed, args.layout)
    home = tempfile.mkdtemp(prefix="posttrain-server-reruns-")
    summary = {}
    try:
        for stage in ("eval_base", "sft", "eval_sft"):
            run_pipeline(PIPELINE, overrides, home, ("--only", stage))
        for run, options in (("first", ()), ("second", ("--force", "grpo"))):
            summary[run] = layout_figures(home, run_pipeline(PIPELINE, overrides, home, options))
            print(run, summary[run], flush=True)
        summary["differences"] = differences(home)
        print("differences", summary["differences"], flush=True)
        for layout in args.also:
            summary[layout] = layout_figures(home, run_pipeline(PIPELINE, layout_overrides(args.seed, layout), home))
            print(layout, summary[layout], flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print_summary(summary, args.out)


if __name__ == "__main__":
    main()
